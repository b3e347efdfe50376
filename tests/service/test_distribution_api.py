"""`distribution` at the API: a strategy only for its framework, 1..8 devices that divide the batch,
each refusal a 422 naming the field; a good one stored as given."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient


def body(framework: str = "torch", batch_size: int = 64, **distribution: Any) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"name": "adam", "params": {"lr": 0.001}}
    if framework == "tensorflow":
        optimizer["style"] = "keras"
    return {
        "framework": framework,
        "workload": {"name": "digits_mlp"},
        "optimizer": optimizer,
        "steps": 100,
        "batch_size": batch_size,
        "distribution": distribution,
    }


# (body, text the messages must contain, field the error points at)
BAD = [
    (body("tensorflow", strategy="ddp", devices=2), "strategy 'ddp' trains torch jobs only", "distribution"),
    (
        body("torch", strategy="mirrored", devices=2),
        "strategy 'mirrored' trains tensorflow jobs only",
        "distribution",
    ),
    (body(strategy="ddp", devices=3), "devices must divide batch_size", "distribution"),
    (body(strategy="ddp", devices=9), "less than or equal to 8", "devices"),
    (body(strategy="ddp", devices=0), "greater than or equal to 1", "devices"),
    (body(strategy="horovod", devices=2), "'ddp' or 'mirrored'", "strategy"),
    (body(strategy="ddp"), "Field required", "devices"),
    (
        {**body("tensorflow", strategy="mirrored", devices=2), "jit_compile": True, "device": "cpu"},
        "jit_compile (XLA) cannot compile a step mirrored over logical CPUs",
        "distribution",
    ),
]


@pytest.mark.parametrize(("request_body", "expected", "field"), BAD, ids=[b[1] for b in BAD])
def test_a_distribution_that_cannot_run_gets_422_naming_the_field(
    client: TestClient, request_body: dict[str, Any], expected: str, field: str
) -> None:
    response = client.post("/jobs", json=request_body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert expected in " | ".join(item["msg"] for item in detail), detail
    assert any(field in map(str, item["loc"]) for item in detail), detail
    assert client.get("/jobs").json()["total"] == 0


@pytest.mark.parametrize(("framework", "strategy"), [("torch", "ddp"), ("tensorflow", "mirrored")])
def test_a_distribution_is_stored_with_the_job(client: TestClient, framework: str, strategy: str) -> None:
    response = client.post("/jobs", json=body(framework, strategy=strategy, devices=2))
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["distribution"] == {"strategy": strategy, "devices": 2}
