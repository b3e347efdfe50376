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


# Published signatures: Prodigy's `beta3: float | None = None` (null: the class decides) and `eps:
# float | None = 1e-8` (null: no epsilon), torch's LBFGS `line_search_fn: str | None = None`, SOAP's
# `data_format: Literal["channels_first", "channels_last"]`, Adan's three `betas`; Ranger21's
# unannotated `num_epochs=None`, any scalar.
OPTIONAL_AND_OPTION_VALUES = [
    ("prodigy", "beta3", None, True),
    ("prodigy", "beta3", 0.5, True),
    ("prodigy", "beta3", "sqrt", False),
    ("prodigy", "beta3", True, False),
    ("prodigy", "eps", None, True),
    ("prodigy", "eps", 1e-6, True),
    ("lbfgs", "line_search_fn", "strong_wolfe", True),
    ("lbfgs", "line_search_fn", None, True),
    ("lbfgs", "line_search_fn", "x" * 201, False),
    ("lbfgs", "line_search_fn", "new\nline", False),
    ("lbfgs", "line_search_fn", 1, False),
    ("soap", "data_format", "channels_last", True),
    ("soap", "data_format", "nchw", False),
    ("soap", "data_format", None, False),
    ("adan", "betas", [0.9, 0.9, 0.99], True),
    ("adan", "betas", [], False),
    ("adan", "betas", [0.9, "high", 0.99], False),
    ("epoch_scheduled", "num_epochs", 3, True),
    ("epoch_scheduled", "num_epochs", "auto", True),
    ("epoch_scheduled", "num_epochs", None, True),
    ("epoch_scheduled", "num_epochs", [3], True),  # a list of scalars, as Keras Muon's exclude_layers
    ("epoch_scheduled", "num_epochs", [[3]], False),
    ("epoch_scheduled", "num_epochs", {"epochs": 3}, False),
    ("epoch_scheduled", "lr", None, True),
    ("epoch_scheduled", "lr", "auto", False),
]


def test_optional_values_and_options_agree_in_the_schema_and_the_server(
    tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    """Each value is valid in the schema exactly when the server accepts it, for classes of a plugin's
    catalogue whose signatures take null, a string, one of listed strings or three numbers."""
    from pytorch_optimizer import SOAP, Adan, Prodigy
    from torch.optim import LBFGS, SGD

    class EpochScheduled(SGD):
        """Ranger21's spelling: `num_epochs=None` unannotated, and an `lr=None` the class derives."""

        def __init__(self, params: Any, lr=None, num_epochs=None) -> None:  # type: ignore[no-untyped-def]
            super().__init__(params, lr=0.1 if lr is None else lr)

    from optimizers.registry import entry_for_class

    published = [
        entry_for_class(cls, source="test").describe() for cls in (Prodigy, LBFGS, SOAP, Adan, EpochScheduled)
    ]
    catalogue = {**catalogue_data, "optimizers": [*catalogue_data["optimizers"], *published]}
    for client in _client(Settings(data_dir=tmp_path, trusted_hosts="testserver"), catalogue):
        document = client.get("/openapi.json").json()
        schema = Draft202012Validator(
            {"$ref": "#/components/schemas/JobSpec", "components": document["components"]}
        )
        for optimizer, name, value, allowed in OPTIONAL_AND_OPTION_VALUES:
            body = {
                "workload": {"name": "digits_mlp"},
                "optimizer": {"name": optimizer, "params": {name: value}},
                "steps": 5,
            }
            case = (optimizer, name, value)
            assert (not list(schema.iter_errors(body))) is allowed, case
            answer = client.post("/jobs", json=body)
            assert (answer.status_code == 201) is allowed, (case, answer.text)
            if not allowed:
                assert answer.status_code == 422 and name in answer.text, (case, answer.text)
