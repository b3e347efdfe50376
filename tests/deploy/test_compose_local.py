"""docker-compose.yml proven without Docker (tests/deploy/compose_local.py says what is mapped): the
services come up in the file's order, each passing its own healthcheck, and a job and a check run
to the end through the API with a token, tracked by the MLflow server with its served artifacts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.compose_local import TOKEN, LocalStack, local_stack

pytestmark = [pytest.mark.xdist_group("compose_local"), pytest.mark.timeout(400)]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENDED = {"succeeded", "failed", "diverged", "cancelled"}
JOB = {
    "framework": "torch",
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "sgd", "params": {"lr": 0.05}},
    "steps": 20,
    "batch_size": 32,
    "checkpoint_every": 10,
    "eval_every": 10,
    "experiment": "compose-test",
}
CHECK = {
    "framework": "torch",
    "optimizer": {"name": "lion", "params": {"lr": 0.001}},
    "checks": ["construct"],
}
# The smallest real study: two optimizers x one lr x one seed on a 2-D function (no data to load).
STUDY: dict[str, Any] = {
    "name": "compose-smoke",
    "workload": {"name": "rosenbrock"},
    "optimizers": [{"name": "adam", "params": {"lr": [0.05]}}, {"name": "sgd", "params": {"lr": [0.001]}}],
    "seeds": [0],
    "steps": 20,
    "batch_size": 1,
    "eval_every": 10,
    "checkpoint_every": 10,
    "baseline": "sgd",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from local_stack(tmp_path_factory.mktemp("compose"))


@pytest.fixture(scope="module")
def api(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.api_url, headers=AUTH, timeout=30) as client:
        yield client


def wait_ended(api: httpx.Client, job_id: int, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(f"/jobs/{job_id}").json()
        if job["status"] in ENDED:
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not end within {timeout_s:.0f}s: {job}")


def test_services_start_in_dependency_order_and_pass_their_healthchecks(stack: LocalStack) -> None:
    assert stack.order.index("db") < stack.order.index("mlflow") < stack.order.index("api")
    assert stack.order.index("mlflow") < stack.order.index("worker")
    assert all(started.healthy_after_s is not None for started in stack.started.values())
    print({name: started.healthy_after_s for name, started in stack.started.items()})  # seconds, with -s
    ready = httpx.get(f"{stack.api_url}/readyz", timeout=10)  # no token: a probe
    assert ready.status_code == 200 and ready.json()["missing"] == [], ready.text
    # Without the token the API refuses, as it must when it listens beyond localhost.
    assert httpx.get(f"{stack.api_url}/jobs", timeout=10).status_code == 401


def test_a_job_trains_through_the_api_and_mlflow_keeps_its_artifacts(
    stack: LocalStack, api: httpx.Client
) -> None:
    created = api.post("/jobs", json=JOB)
    assert created.status_code == 201, created.text
    assert created.json()["submitted_by"] == "alice"
    job = wait_ended(api, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["result"]["checkpoints_verified"] >= 2, job["result"]
    run_id = job["mlflow"]["run_id"]
    assert job["mlflow"]["tracking_uri"] == stack.mlflow_url  # the worker's, i.e. `mlflow:5000` mapped
    run = httpx.get(f"{stack.mlflow_url}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10)
    assert {m["key"] for m in run.json()["run"]["data"]["metrics"]} >= {"train/loss", "val/accuracy"}
    # --serve-artifacts: the artifacts went through the server into its volume, not the worker's disk.
    artifacts = stack.mapping.paths["/mlartifacts"]
    assert any(path.name == "result.json" for path in artifacts.rglob("*")), list(artifacts.rglob("*"))[:20]


def test_a_check_runs_through_the_api(api: httpx.Client) -> None:
    created = api.post("/checks", json=CHECK)
    assert created.status_code == 201, created.text
    job = wait_ended(api, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    report = job["result"]["report"]
    assert [check["id"] for check in report["checks"]] == ["construct"]
    assert report["checks"][0]["status"] == "pass", report


def test_a_study_runs_through_the_api(api: httpx.Client) -> None:
    created = api.post("/studies", json=STUDY)
    assert created.status_code == 201, created.text
    study_id = created.json()["id"]
    deadline = time.monotonic() + 300
    while (study := api.get(f"/studies/{study_id}").json())["status"] != "done":
        assert time.monotonic() < deadline, study
        time.sleep(1)
    assert [job["status"] for job in study["jobs"]] == ["succeeded", "succeeded"], study["jobs"]
    assert [row["optimizer"] for row in study["summary"]["ranking"]] == ["adam", "sgd"], study["summary"]
    report = api.get(f"/studies/{study_id}/report")
    assert report.status_code == 200 and "data:image/png;base64," in report.text


def test_volumes_are_where_the_services_wrote(stack: LocalStack) -> None:
    """The worker's checkpoints went into its checkpoints volume (mapped), nowhere else."""
    checkpoints = stack.mapping.paths["/checkpoints"]
    assert any(Path(p).is_file() for p in (checkpoints / "jobs").rglob("*")), "no job folder in /checkpoints"
