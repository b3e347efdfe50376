"""The study routes without a worker: validation (422 naming the field), the job cap, quotas and
atomicity (all of a study's jobs or none), the `?study=` filter, cancelling, 404/409s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service import store
from service.settings import Settings

STUDY: dict[str, Any] = {
    "name": "lion-vs-adam",
    "workload": {"name": "digits_mlp"},
    "optimizers": [
        {"name": "lion", "params": {"lr": [0.0001, 0.0003]}},
        {"name": "adam", "params": {"lr": [0.001, 0.003], "eps": 1e-7}},
    ],
    "seeds": [0, 1],
    "steps": 20,
    "eval_every": 10,
    "baseline": "adam",
}


def study_with(change: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(STUDY))
    change(body)
    return body


def test_a_study_expands_into_queued_jobs_seen_through_jobs(client: TestClient) -> None:
    response = client.post("/studies", json=STUDY)
    assert response.status_code == 201, response.text
    study = response.json()
    assert study["status"] == "running" and study["mlflow"] is None and study["summary"] is None
    assert study["progress"]["counts"]["queued"] == 8 and study["progress"]["steps_total"] == 160
    assert [(o["optimizer"], o["jobs"]) for o in study["progress"]["optimizers"]] == [
        ("lion", 4),
        ("adam", 4),
    ]
    members = [(j["optimizer"], j["grid"], j["seed"]) for j in study["jobs"]]
    assert members[:2] == [("lion", {"lr": 0.0001}, 0), ("lion", {"lr": 0.0001}, 1)]
    client.post("/jobs", json={"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 5})
    jobs = client.get("/jobs", params={"study": study["id"]}).json()
    assert jobs["total"] == 8 and client.get("/jobs").json()["total"] == 9
    adam = [j for j in jobs["items"] if j["spec"]["optimizer"]["name"] == "adam"]
    assert {j["spec"]["optimizer"]["params"]["eps"] for j in adam} == {1e-7}  # fixed params kept
    assert {j["spec"]["experiment"] for j in jobs["items"]} == {"lion-vs-adam"}
    assert client.get(f"/studies/{study['id']}").json()["jobs"] == study["jobs"]
    listed = client.get("/studies").json()
    assert listed["total"] == 1 and listed["items"][0]["id"] == study["id"]


# (change to the good study, the field the error points at, text the message contains)
BAD_STUDIES = [
    (lambda b: b.update(baseline="sgd"), ["body", "baseline"], "one of the study's optimizers (lion, adam)"),
    (
        lambda b: b["optimizers"][1]["params"].update(lr=[0.001, -1.0]),
        ["body", "optimizers", 1, "params", "lr", 1],
        "lr must be a number > 0; received -1.0",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[0.1 * (i + 1) for i in range(99)]),
        ["body", "optimizers"],
        "expands to 202 jobs",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[]),
        ["body", "optimizers", 0, "params", "lr"],
        "at least one",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[0.1, 0.1]),
        ["body", "optimizers", 0, "params", "lr"],
        "repeats a value",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(gamma=[1, 2]),
        ["body", "optimizers", 0, "params", "gamma", 0],
        "no hyperparameter 'gamma'",
    ),
    (
        lambda b: b["optimizers"][0].update(name="nope"),
        ["body", "optimizers", 0, "name"],
        "unknown optimizer",
    ),
    (
        lambda b: b["optimizers"].append({"name": "adam"}),
        ["body", "optimizers", 2, "label"],
        "distinct label",
    ),
    (lambda b: b.update(seeds=[1, 1]), ["body", "seeds"], "seeds must differ"),
    (lambda b: b.update(eval_every=50), ["body", "eval_every"], "at most steps (20)"),
    (lambda b: b.update(workload={"name": "imagenet"}), ["body", "workload", "name"], "unknown workload"),
    (
        lambda b: b.update(target={"metric": "val/loss", "mode": "up", "value": 1}),
        ["body", "target", "mode"],
        "min",
    ),
    (lambda b: b.update(name="a/b"), ["body", "name"], "may contain only"),
    (
        # A metric the workload's jobs never log: every job had run, and nothing was ranked.
        lambda b: b.update(target={"metric": "val/rmse", "mode": "min", "value": 1}),
        ["body", "target", "metric"],
        "workload 'digits_mlp' logs train/loss, val/loss, val/accuracy; received 'val/rmse'",
    ),
    (
        # Accuracy to be minimized: the study would pick and rank the worst grid points.
        lambda b: b.update(target={"metric": "val/accuracy", "mode": "min", "value": 0.5}),
        ["body", "target", "mode"],
        "val/accuracy improves upward: mode must be 'max'; received 'min'",
    ),
]


@pytest.mark.parametrize(("change", "loc", "text"), BAD_STUDIES)
def test_bad_studies_get_422_naming_the_field_and_store_nothing(
    client: TestClient, change: Any, loc: list[Any], text: str
) -> None:
    response = client.post("/studies", json=study_with(change))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(item["loc"] == loc and text in item["msg"] for item in detail), detail
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_the_job_cap_is_a_setting(settings: Settings, client: TestClient) -> None:
    client.app.state.settings = settings.model_copy(update={"max_study_jobs": 7})  # type: ignore[attr-defined]
    refused = client.post("/studies", json=STUDY)
    assert refused.status_code == 422 and "at most 7 (OPTLAB_MAX_STUDY_JOBS)" in refused.text


def test_quotas_count_the_whole_study_at_once(settings: Settings, client: TestClient) -> None:
    client.app.state.settings = settings.model_copy(update={"max_queued": 12})  # type: ignore[attr-defined]
    assert client.post("/studies", json=STUDY).status_code == 201
    refused = client.post("/studies", json=STUDY)  # 8 queued + 8 > 12: none of the 8 is stored
    assert refused.status_code == 429 and "this request adds 8" in refused.json()["detail"]
    assert client.get("/studies").json()["total"] == 1 and client.get("/jobs").json()["total"] == 8


def test_a_study_larger_than_any_queue_may_hold_is_refused_not_told_to_retry(
    settings: Settings, client: TestClient
) -> None:
    """8 jobs against a cap of 6: waiting never helps, so a 422 saying so, not a 429 with Retry-After."""
    client.app.state.settings = settings.model_copy(update={"max_queued": 6})  # type: ignore[attr-defined]
    refused = client.post("/studies", json=STUDY)
    assert refused.status_code == 422 and "Retry-After" not in refused.headers
    [problem] = refused.json()["detail"]
    assert problem["msg"].startswith(
        "this request adds 8 jobs, more than the 6 queued jobs this service holds"
    )
    assert "submit it in parts" in problem["msg"]
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_a_failure_while_writing_leaves_no_half_study(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = store.job_row

    def fails_on_the_fifth(**kwargs: Any) -> Any:
        made.append(1)
        if len(made) == 5:
            raise RuntimeError("disk full")
        return real(**kwargs)

    monkeypatch.setattr(store, "job_row", fails_on_the_fifth)
    assert client.post("/studies", json=STUDY).status_code == 500
    assert len(made) == 5
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_cancelling_a_study_cancels_its_queued_jobs(client: TestClient) -> None:
    study = client.post("/studies", json=STUDY).json()
    other = client.post("/studies", json={**STUDY, "name": "other"}).json()
    cancelled = client.post(f"/studies/{study['id']}/cancel", json={})
    assert cancelled.status_code == 200, cancelled.text
    body = cancelled.json()
    assert body["cancel_requested"] and body["progress"]["counts"]["cancelled"] == 8
    assert body["status"] == "summarizing"  # every job ended; a worker makes the summary
    assert {j["status"] for j in client.get(f"/studies/{other['id']}").json()["jobs"]} == {"queued"}
    report = client.get(f"/studies/{study['id']}/report")
    assert report.status_code == 409 and "no report yet" in report.json()["detail"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/studies/99"), ("POST", "/studies/99/cancel"), ("GET", "/studies/99/report")],
)
def test_unknown_studies_are_404(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path, json={} if method == "POST" else None)
    assert response.status_code == 404 and "no study with id 99" in response.json()["detail"]


def test_the_openapi_declares_the_study_routes(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    paths = document["paths"]
    assert set(paths["/studies"]["post"]["responses"]) >= {"201", "422", "429", "503"}
    assert "text/html" in paths["/studies/{study_id}/report"]["get"]["responses"]["200"]["content"]
    assert {"404", "409"} <= set(paths["/studies/{study_id}/cancel"]["post"]["responses"])
    schemas = document["components"]["schemas"]
    assert "lion" in schemas["StudyOptimizer"]["properties"]["name"]["enum"]
    assert "study" in {p["name"] for p in paths["/jobs"]["get"]["parameters"]}


def test_the_example_study_is_accepted(client: TestClient) -> None:
    import yaml  # type: ignore[import-untyped]

    from tests.conftest import ROOT

    example = yaml.safe_load((ROOT / "examples" / "studies" / "lion-vs-adamw.yaml").read_text())
    response = client.post("/studies", json=example)
    assert response.status_code == 201, response.text
    assert response.json()["progress"]["jobs"] == 12
