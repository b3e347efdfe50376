"""A TensorFlow job or check whose optimizer needs what Keras training steps cannot serve (a
closure, a second-order backward, a base optimizer to wrap) is refused at submission, 422 at the
field, from the catalogue the API has (`optimizers.loop_needs.loop_problem`), and nothing is stored."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service import store


@pytest.fixture
def tf_client(
    client: TestClient, sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> TestClient:
    """The real catalogue plus a Keras optimizer whose catalogue entry needs a closure, as a class
    declaring `optlab_needs = {"closure": True}` would be published."""
    data = copy.deepcopy(catalogue_data)
    keras_sgd = next(o for o in data["optimizers"] if o["name"] == "sgd" and o["style"] == "keras")
    data["optimizers"].append(
        {**keras_sgd, "name": "keras_sam", "needs": {**keras_sgd["needs"], "closure": True}}
    )
    data["optimizers"].append(
        {**keras_sgd, "name": "keras_schedule_free", "needs": {**keras_sgd["needs"], "train_eval": True}}
    )
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=data)
    return client


def tf_job(optimizer: dict[str, Any]) -> dict[str, Any]:
    return {
        "framework": "tensorflow",
        "workload": {"name": "digits_mlp"},
        "optimizer": optimizer,
        "steps": 10,
    }


# (the optimizer part of a tensorflow spec, the field the 422 points at, text its message has)
REFUSED = [
    (
        {"name": "adam", "params": {}, "base": {"name": "sgd", "params": {"lr": 0.1}}},
        "base",
        "tensorflow jobs build no wrapper around a base optimizer (wrappers run in torch jobs); "
        "leave optimizer.base out",
    ),
    (
        {"name": "adam", "params": {}, "needs": {"base_optimizer": "optimizer"}, "base": {"name": "sgd"}},
        "base",
        "tensorflow jobs build no wrapper",
    ),
    (
        {"name": "adam", "params": {}, "needs": {"base_optimizer": "optimizer"}},
        "name",
        "optimizer 'adam' wraps a base optimizer (its 'optimizer' argument), and tensorflow jobs and checks "
        "build no wrapper",
    ),
    ({"name": "keras_sam", "params": {}}, "name", "needs closure, which tensorflow training steps cannot"),
    (
        # The spec's own need, at its own field: the optimizer was blamed for it.
        {"name": "sgd", "params": {}, "needs": {"create_graph": True}},
        "needs.create_graph",
        "optimizer.needs.create_graph: tensorflow training steps cannot serve it (a torch job's loop does); "
        "leave it out; received True",
    ),
    (
        {"name": "sgd", "params": {}, "needs": {"closure": True}},
        "needs.closure",
        "optimizer.needs.closure: tensorflow training steps cannot serve it",
    ),
    (
        # A schedule-free class's train() and eval(): a Keras job called neither, silently.
        {"name": "keras_schedule_free", "params": {}},
        "name",
        "optimizer 'keras_schedule_free' needs train_eval, which tensorflow training steps cannot provide",
    ),
    (
        {"name": "sgd", "params": {}, "needs": {"train_eval": True}},
        "needs.train_eval",
        "optimizer.needs.train_eval: tensorflow training steps cannot serve it",
    ),
]
IDS = [
    "a base",
    "a stated wrapper with a base",
    "a stated wrapper",
    "a catalogued closure",
    "a stated graph",
    "a stated closure",
    "a catalogued train_eval",
    "a stated train_eval",
]


@pytest.mark.parametrize(("optimizer", "field", "says"), REFUSED, ids=IDS)
def test_a_tensorflow_job_is_refused_at_the_field(
    tf_client: TestClient, optimizer: dict[str, Any], field: str, says: str
) -> None:
    response = tf_client.post("/jobs", json=tf_job(optimizer))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [item["loc"] for item in detail] == [["body", "optimizer", *field.split(".")]], detail
    assert says in detail[0]["msg"]
    assert tf_client.get("/jobs").json()["total"] == 0, "a refused job was stored"


@pytest.mark.parametrize(("optimizer", "field", "says"), REFUSED, ids=IDS)
def test_a_tensorflow_check_is_refused_at_the_field(
    tf_client: TestClient, optimizer: dict[str, Any], field: str, says: str
) -> None:
    response = tf_client.post("/checks", json={"framework": "tensorflow", "optimizer": optimizer})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [item["loc"] for item in detail] == [["body", "optimizer", *field.split(".")]]
    assert says in detail[0]["msg"]


def test_the_same_optimizers_are_accepted_where_torch_serves_them(tf_client: TestClient) -> None:
    body = {**tf_job({"name": "sgd", "params": {}, "needs": {"create_graph": True}}), "framework": "torch"}
    assert tf_client.post("/jobs", json=body).status_code == 201
    keras_plain = tf_client.post("/jobs", json=tf_job({"name": "adam", "params": {}}))
    assert keras_plain.status_code == 201, keras_plain.text
