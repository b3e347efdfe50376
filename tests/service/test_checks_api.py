"""POST /checks, check jobs in GET /jobs, and the latest check summary in GET /optimizers/{name}."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.checks.report import CHECK_IDS
from jobs.result import JobResult, JobStatus
from service import store
from service.app import create_app
from service.settings import Settings

GOOD: dict[str, Any] = {"framework": "torch", "optimizer": {"name": "lion", "params": {"lr": 0.0003}}}
TRAINING: dict[str, Any] = {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "adam"}, "steps": 10}


def test_a_check_is_queued_as_a_job_of_kind_check(client: TestClient) -> None:
    response = client.post("/checks", json={**GOOD, "checks": ["dense_step", "construct"]})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["kind"] == "check" and job["status"] == "queued"
    assert job["spec"] == {
        "kind": "check",
        "framework": "torch",
        "optimizer": {
            "name": "lion",
            "params": {"lr": 0.0003},
            "style": None,
            "base": None,
            "needs": None,
            "param_groups": None,
            "source": None,  # a built-in's: no plugin file can change it
        },
        "checks": ["dense_step", "construct"],
        "experiment": "optimizer-checks",
        "timeout_s": None,
    }
    assert job["progress"] == {"step": 0, "total": 2, "fraction": 0.0}
    assert client.get(f"/jobs/{job['id']}").json()["kind"] == "check"


def test_without_a_subset_every_check_counts_towards_progress(client: TestClient) -> None:
    job = client.post("/checks", json=GOOD).json()
    assert job["progress"]["total"] == len(CHECK_IDS)


def test_the_style_is_resolved_at_submission(client: TestClient) -> None:
    keras = client.post("/checks", json={"framework": "tensorflow", "optimizer": {"name": "lion"}}).json()
    assert keras["spec"]["optimizer"]["style"] == "keras"
    legacy = {"framework": "tensorflow", "optimizer": {"name": "lion", "style": "tf_legacy"}}
    assert client.post("/checks", json=legacy).json()["spec"]["optimizer"]["style"] == "tf_legacy"


# (the body, text the messages must contain, a part of the location the error points at)
BAD_CHECKS = [
    ({**GOOD, "optimizer": {"name": "nope"}}, ["unknown optimizer 'nope'", "known:", "lion"], "name"),
    ({**GOOD, "optimizer": {"name": "lion", "params": {"gamma": 1}}}, ["no hyperparameter 'gamma'"], "gamma"),
    ({**GOOD, "optimizer": {"name": "lion", "params": {"lr": -1.0}}}, ["lr must be a number > 0"], "lr"),
    (
        {**GOOD, "optimizer": {"name": "lion", "style": "keras"}},
        ["optimizer.style chooses between keras and tf_legacy", "'torch'"],
        "style",
    ),
    (
        {"framework": "tensorflow", "optimizer": {"name": "adamw", "style": "tf_legacy"}},
        ["has no tf_legacy style", "it exists in"],
        "style",
    ),
    ({**GOOD, "checks": ["construct", "fast"]}, ["unknown check id 'fast'", "known: construct"], "checks"),
    ({**GOOD, "checks": []}, ["checks", "at least 1"], "checks"),
    ({**GOOD, "checks": "construct"}, ["checks", "list", 'received "construct"'], "checks"),
    ({**GOOD, "framework": "jax"}, ["framework", "'torch' or 'tensorflow'"], "framework"),
    ({**GOOD, "workload": {"name": "digits_mlp"}}, ["unknown field 'workload'", "allowed: kind"], "workload"),
    ({**GOOD, "optimizer": {"name": "lion", "lr": 1}}, ["unknown field 'optimizer.lr'", "params"], "lr"),
    ({**GOOD, "kind": "train"}, ["kind", "'check'"], "kind"),
    ({"framework": "torch"}, ["optimizer", "Field required"], "optimizer"),
]


@pytest.mark.parametrize(("body", "expected", "field"), BAD_CHECKS, ids=[str(b[1][0]) for b in BAD_CHECKS])
def test_bad_checks_get_422_naming_the_field_and_what_is_allowed(
    client: TestClient, body: dict[str, Any], expected: list[str], field: str
) -> None:
    response = client.post("/checks", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    messages = " | ".join(item["msg"] for item in detail)
    for text in expected:
        assert text in messages, messages
    assert any(field in map(str, item["loc"]) for item in detail), detail
    assert client.get("/jobs").json()["total"] == 0, "a rejected request stored something"


def test_checking_before_any_worker_published_a_catalogue_is_503(settings: Settings) -> None:
    with TestClient(create_app(settings)) as fresh:
        response = fresh.post("/checks", json=GOOD)
    assert response.status_code == 503
    assert "optlab worker" in response.json()["detail"]


def test_jobs_can_be_listed_by_kind(client: TestClient) -> None:
    trained = client.post("/jobs", json=TRAINING).json()
    checked = client.post("/checks", json=GOOD).json()
    assert trained["kind"] == "train"
    assert [j["id"] for j in client.get("/jobs", params={"kind": "check"}).json()["items"]] == [checked["id"]]
    assert [j["id"] for j in client.get("/jobs", params={"kind": "train"}).json()["items"]] == [trained["id"]]
    assert client.get("/jobs").json()["total"] == 2
    refused = client.get("/jobs", params={"kind": "bogus"})
    assert refused.status_code == 422 and "'train' or 'check'" in refused.text


def report(failed: list[str], warned: list[str]) -> dict[str, Any]:
    """The part of a check job's result that the optimizer summary reads."""
    summary = {"pass": 3, "fail": len(failed), "warn": len(warned), "skip": 1, "duration_s": 2.5}
    return {"report": {"summary": {**summary, "failed": failed, "warned": warned}}, "steps_completed": 6}


def finish_next(sessions: sessionmaker[Session], status: JobStatus, result: dict[str, Any] | None) -> None:
    """Finish the next job as a worker would, with `result` as the job's own part of result.json."""
    with sessions() as session:
        job = store.claim_next(session=session, worker_id="w", lease_s=30)
        assert job is not None
        run = {"job_id": str(job.id), "attempt": job.attempt, "workdir": "/tmp/w", "status": status}
        typed = None if result is None else JobResult.model_validate({**run, **result})
        store.finish_job(
            session=session,
            job_id=job.id,
            worker_id="w",
            attempt=job.attempt,
            status=status,
            result=typed,
            error=None,
        )


def test_the_optimizer_shows_its_latest_finished_check_per_style(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    def latest_checks() -> dict[str, Any]:
        items = client.get("/optimizers/lion").json()["implementations"]
        return {item["style"]: item["latest_check"] for item in items}

    assert latest_checks() == {"torch": None, "keras": None, "tf_legacy": None}  # never checked

    client.post("/checks", json={**GOOD, "checks": ["construct"]})
    first = client.post(
        "/checks", json={**GOOD, "optimizer": {"name": "lion", "params": {"lr": 0.001}}}
    ).json()
    client.post("/checks", json={"framework": "tensorflow", "optimizer": {"name": "lion"}})  # keras
    client.post("/jobs", json=TRAINING)  # a training job is no check
    client.post("/checks", json=GOOD)  # queued behind the others; fails without a report below
    finish_next(sessions, JobStatus.SUCCEEDED, report(failed=[], warned=[]))
    finish_next(sessions, JobStatus.SUCCEEDED, report(failed=["sparse"], warned=["step_cost"]))
    finish_next(sessions, JobStatus.SUCCEEDED, report(failed=[], warned=[]))
    finish_next(sessions, JobStatus.SUCCEEDED, {"steps_completed": 10})
    finish_next(sessions, JobStatus.FAILED, None)

    latest = latest_checks()
    assert latest["tf_legacy"] is None
    assert latest["keras"]["failed"] == []
    torch = latest["torch"]
    assert torch["job_id"] == first["id"] and torch["params"] == {"lr": 0.001}
    assert torch["checks"] is None and torch["finished_at"]
    assert {k: torch[k] for k in ("pass", "fail", "warn", "skip")} == {
        "pass": 3,
        "fail": 1,
        "warn": 1,
        "skip": 1,
    }
    assert torch["failed"] == ["sparse"] and torch["warned"] == ["step_cost"]
    assert client.get(f"/jobs/{first['id']}").json()["progress"] == {
        "step": 6,
        "total": 19,
        "fraction": 0.3158,
    }
