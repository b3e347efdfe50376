"""The OpenAPI document states each catalogue item's parameters and ranges, and the server agrees:
for every bounded parameter of every optimizer implementation, schedule and workload, a value at an
inclusive bound is valid in the schema and accepted, one just outside is invalid there and a 422."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jsonschema_rs import Draft202012Validator  # schemathesis brings it

from service.settings import Settings
from tests.service.test_auth import _client


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, catalogue_data: dict[str, Any]) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("ranges"), trusted_hosts="testserver", max_queued=10**6
    )
    yield from _client(settings, catalogue_data)


@pytest.fixture(scope="module")
def job_schema(api: TestClient) -> Draft202012Validator:
    document = api.get("/openapi.json").json()
    return Draft202012Validator(
        {"$ref": "#/components/schemas/JobSpec", "components": document["components"]}
    )


def _cases(catalogue: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any], Any, bool]]:
    """(id, a job body without the value, where the value goes, the value, whether it is allowed)."""
    cases = []
    kinds = (
        ("optimizer", catalogue["optimizers"]),
        ("schedule", catalogue["schedules"]),
        ("workload", catalogue["workloads"]),
    )
    for kind, items in kinds:
        for item in items:
            if any(param["required"] for param in item["params"]):
                continue  # e.g. npz's `path`: a user's file, which only the server can judge
            for param in item["params"]:
                for value, allowed in _edges(param):
                    body = _body(kind, item)
                    cases.append(
                        (
                            f"{kind}:{item['name']}:{item.get('style', '')}:{param['name']}={value}",
                            body,
                            {"kind": kind, "name": param["name"]},
                            value,
                            allowed,
                        )
                    )
    return cases


def _edges(param: dict[str, Any]) -> list[tuple[Any, bool]]:
    if param["type"] not in ("float", "int", "number"):
        return []
    step = 1 if param["type"] == "int" else 1e-6
    edges = []
    for bound, inclusive, outward in (("low", "low_inclusive", -step), ("high", "high_inclusive", step)):
        value = param[bound]
        if value is None:
            continue
        edges.append((value, True) if param[inclusive] else (value, False))
        if param[inclusive]:
            edges.append((value + outward, False))
    return edges


def _body(kind: str, item: dict[str, Any]) -> dict[str, Any]:
    optimizer = item if kind == "optimizer" else {"name": "sgd", "framework": "torch", "style": "torch"}
    body: dict[str, Any] = {
        "framework": optimizer["framework"],
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": optimizer["name"], "params": {}},
        "steps": 1000,
        "batch_size": 32,
    }
    if optimizer["framework"] == "tensorflow":
        body["optimizer"]["style"] = optimizer["style"]
    if kind == "schedule":
        body["schedule"] = {"name": item["name"], "params": {}}
    if kind == "workload":
        body["workload"] = {"name": item["name"], "params": {}}
        body["framework"] = item["frameworks"][0]
        body["batch_size"] = min(32, item["train_size"] or 32)
    return body


def test_schema_and_server_agree_at_every_bound(
    api: TestClient, job_schema: Draft202012Validator, catalogue_data: dict[str, Any]
) -> None:
    cases = _cases(catalogue_data)
    disagreements = []
    for case_id, body, where, value, allowed in cases:
        body[where["kind"]]["params"][where["name"]] = value
        schema_ok = not list(job_schema.iter_errors(body))
        answer = api.post("/jobs", json=body)
        located = answer.status_code == 422 and answer.json()["detail"][0]["loc"][-1] == where["name"]
        if (schema_ok, answer.status_code == 201) != (allowed, allowed) or not (allowed or located):
            disagreements.append(
                f"{case_id}: schema {'allows' if schema_ok else 'refuses'}, server {answer.text}"
            )
    assert len(cases) > 100  # every bounded parameter of every implementation, schedule, workload
    assert not disagreements, "\n".join(disagreements)


def test_the_schema_refuses_a_name_s_unknown_parameter(
    api: TestClient, job_schema: Draft202012Validator
) -> None:
    body = {
        "workload": {"name": "digits_mlp", "params": {"width": 3}},
        "optimizer": {"name": "lion"},
        "steps": 5,
    }
    assert list(job_schema.iter_errors(body))
    assert api.post("/jobs", json=body).status_code == 422
    body["workload"]["params"] = {"hidden": 3}
    assert not list(job_schema.iter_errors(body))
    assert api.post("/jobs", json=body).status_code == 201


def test_an_optional_number_is_a_number_or_null_in_the_schema_and_the_server(
    tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    """Prodigy's `beta3: float | None = None`, from a plugin's catalogue: null (the class decides) and
    a number are valid in the schema and accepted, anything else is neither."""
    from pytorch_optimizer import Prodigy

    from optimizers.registry import entry_for_class

    prodigy = entry_for_class(Prodigy, source="test").describe()
    catalogue = {**catalogue_data, "optimizers": [*catalogue_data["optimizers"], prodigy]}
    for client in _client(Settings(data_dir=tmp_path, trusted_hosts="testserver"), catalogue):
        document = client.get("/openapi.json").json()
        schema = Draft202012Validator(
            {"$ref": "#/components/schemas/JobSpec", "components": document["components"]}
        )
        for value, allowed in ((None, True), (0.5, True), ("sqrt", False), (True, False)):
            body = {
                "workload": {"name": "digits_mlp"},
                "optimizer": {"name": "prodigy", "params": {"beta3": value}},
                "steps": 5,
            }
            assert (not list(schema.iter_errors(body))) is allowed, value
            assert (client.post("/jobs", json=body).status_code == 201) is allowed, value
