"""The opt-in speed switches at the API: `compile` (torch jobs only) and the optimizers' `fused`
(where the catalogue declares it); each refusal a 422 naming the field, a good one stored as given."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient


def body(framework: str = "torch", optimizer: str = "ema_momentum", **fields: Any) -> dict[str, Any]:
    params = fields.pop("params", {"lr": 0.05})
    choice: dict[str, Any] = {"name": optimizer, "params": params}
    if framework == "tensorflow":
        choice["style"] = "keras"
    return {
        "framework": framework,
        "workload": {"name": "digits_mlp"},
        "optimizer": choice,
        "steps": 10,
        **fields,
    }


def _properties_named(name: str, node: Any) -> list[Any]:
    """Every JSON Schema `properties[name]` anywhere in an OpenAPI document."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict) and name in node["properties"]:
            found.append(node["properties"][name])
        for value in node.values():
            found += _properties_named(name, value)
    elif isinstance(node, list):
        for value in node:
            found += _properties_named(name, value)
    return found


# (body, text the messages must contain, field the error points at)
BAD = [
    (body("tensorflow", compile=True), "compile (torch.compile) is for torch jobs", "compile"),
    (body(compile="true"), "valid boolean", "compile"),
    (body(params={"lr": 0.05, "fused": "yes"}), "fused must be true or false", "fused"),
    (
        body(optimizer="sgd", params={"lr": 0.05, "fused": True}),
        "has no hyperparameter 'fused'",
        "fused",
    ),
    (
        body("tensorflow", params={"lr": 0.05, "fused": True}),
        "has no hyperparameter 'fused'",
        "fused",
    ),
]


@pytest.mark.parametrize(("request_body", "expected", "field"), BAD, ids=[b[1] for b in BAD])
def test_a_switch_that_cannot_apply_gets_422_naming_the_field(
    client: TestClient, request_body: dict[str, Any], expected: str, field: str
) -> None:
    response = client.post("/jobs", json=request_body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert expected in " | ".join(item["msg"] for item in detail), detail
    assert any(field in map(str, item["loc"]) for item in detail), detail
    assert client.get("/jobs").json()["total"] == 0


@pytest.mark.parametrize("optimizer", ["ema_momentum", "adamw_ref", "lion"])
def test_compile_and_fused_are_stored_with_the_job(client: TestClient, optimizer: str) -> None:
    response = client.post(
        "/jobs", json=body(optimizer=optimizer, compile=True, params={"lr": 0.01, "fused": True})
    )
    assert response.status_code == 201, response.text
    spec = response.json()["spec"]
    assert spec["compile"] is True
    assert spec["optimizer"]["params"] == {"lr": 0.01, "fused": True}


def test_the_schema_shows_both_switches(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    job_spec = document["components"]["schemas"]["JobSpec"]
    assert job_spec["properties"]["compile"]["type"] == "boolean"
    # The optimizers' parameters, per name: `fused` a boolean where it is declared.
    assert {schema.get("type") for schema in _properties_named("fused", document)} == {"boolean"}
    items = client.get("/optimizers", params={"framework": "torch"}).json()["items"]
    fused = {
        item["name"]: param
        for item in items
        if item["style"] == "torch"
        for param in item["params"]
        if param["name"] == "fused"
    }
    assert sorted(fused) == ["adamw_ref", "ema_momentum", "lion"]
    assert all(param["type"] == "bool" and param["default"] is False for param in fused.values())
