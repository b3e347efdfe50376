"""`python -m jobs.run` on a check spec: the conformance checks as a job, with progress, result and MLflow.

The fresh-process tests start together in one module fixture (each pays its imports) and use
small `checks` subsets. The MLflow tests run in this process against a stand-in for
MlflowClient, with a fake check table so the metric mapping does not depend on the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs import run, tracking
from jobs.checks import runner
from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from tests.jobs.test_run_entrypoint import Job, start_job
from tests.jobs.test_tracking import FakeMlflowClient

# The module fixture's check jobs start once: on one pytest-xdist worker, not on each one that
# runs some of these tests.
pytestmark = pytest.mark.xdist_group("run_checks")

LION: dict[str, Any] = {
    "kind": "check",
    "framework": "torch",
    "optimizer": {"name": "lion", "params": {"lr": 0.001}},
    "checks": ["construct", "dense_step"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("checks")
    legacy = {**LION, "framework": "tensorflow", "optimizer": {"name": "sgd", "style": "tf_legacy"}}
    started = {
        "lion": start_job(root, "lion", LION),
        "legacy": start_job(root, "legacy", {**legacy, "checks": ["construct"]}),
        "unknown": start_job(root, "unknown", {**LION, "optimizer": {"name": "no_such_optimizer"}}),
        "bad_params": start_job(
            root, "bad_params", {**LION, "optimizer": {"name": "lion", "params": {"x": 1}}}
        ),
    }
    yield started
    for job in started.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


def test_a_check_job_reports_every_check_asked_for(jobs: dict[str, Job]) -> None:
    returncode, result = jobs["lion"].result()
    assert returncode == 0, jobs["lion"].log.read_text()
    assert result["status"] == "succeeded"
    report = result["report"]
    assert (report["optimizer"], report["style"], report["params"]) == ("lion", "torch", {"lr": 0.001})
    assert [c["id"] for c in report["checks"]] == ["construct", "dense_step"]
    assert all(c["status"] in ("pass", "fail", "warn", "skip") for c in report["checks"])
    assert result["checks_failed"] == report["summary"]["fail"]
    assert result["steps_completed"] == 2
    progress = jobs["lion"].progress()
    assert (progress["step"], progress["total"], progress["check"]) == (2, 2, "dense_step")
    workdir = jobs["lion"].workdir
    assert json.loads((workdir / "report.json").read_text())["checks"] == report["checks"]
    assert "| construct |" in (workdir / "report.md").read_text()


def test_a_legacy_check_job_runs_in_a_legacy_keras_process(jobs: dict[str, Job]) -> None:
    returncode, result = jobs["legacy"].result()
    assert returncode == 0, jobs["legacy"].log.read_text()
    assert result["report"]["style"] == "tf_legacy"
    assert result["report"]["class"].endswith("SGD")


def test_an_unknown_optimizer_fails_the_job_saying_so(jobs: dict[str, Job]) -> None:
    returncode, result = jobs["unknown"].result()
    assert returncode == 1
    assert result["status"] == "failed" and "report" not in result
    assert result["error"]["type"] == "UsageError"
    assert "no optimizer named 'no_such_optimizer'" in result["error"]["message"]


def test_unknown_hyperparameters_fail_the_job_naming_them(jobs: dict[str, Job]) -> None:
    _, result = jobs["bad_params"].result()
    assert result["status"] == "failed"
    assert "'x'" in result["error"]["message"] and "lr" in result["error"]["message"]


# -- MLflow, in this process ------------------------------------------------------------------------


class RecordingMlflowClient(FakeMlflowClient):
    """The tracking tests' stand-in, keeping each artifact's name and text too."""

    def __init__(self) -> None:
        super().__init__()
        self.artifacts: dict[str, str] = {}

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        path = Path(local_path)
        self.artifacts[f"{artifact_path}/{path.name}" if artifact_path else path.name] = path.read_text()

    def metrics(self) -> dict[str, float]:
        return {m.key: m.value for batch in self.metric_batches for m in batch}


def outcome_table(**outcomes: Any) -> dict[str, Any]:
    def check_of(outcome: Any) -> Any:
        def check(ctx: CheckContext) -> Outcome:
            return outcome() if callable(outcome) else outcome

        return check

    return {check_id: check_of(outcome) for check_id, outcome in outcomes.items()}


@pytest.fixture
def mlflow_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingMlflowClient]:
    import mlflow

    fake = RecordingMlflowClient()
    monkeypatch.setattr(mlflow, "MlflowClient", lambda tracking_uri: fake)
    monkeypatch.setattr(tracking, "DEFAULT_DELIVERY", "thread")  # the stand-in answers in this process
    handler = signal.getsignal(signal.SIGTERM)
    yield fake
    signal.signal(signal.SIGTERM, handler)  # run_job ignores SIGTERM while it finishes the run


def run_in_process(tmp_path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    argv = [str(spec_path), "--workdir", str(tmp_path / "work"), "--tracking-uri", "http://mlflow.test"]
    args: argparse.Namespace = run.parse_args([*argv, "--job-id", "42"])
    return run.run_job(args).to_json()


def test_a_check_job_becomes_an_mlflow_run_with_one_metric_per_check(
    tmp_path: Path, mlflow_client: RecordingMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = outcome_table(
        construct=passed("builds"),
        dense_step=failed("a variable did not move", fix="update it in place"),
        descends=warned("slow", fix="none"),
        none_grads=skipped("not applicable"),
    )
    monkeypatch.setattr(runner, "checks_for_style", lambda style: table)
    # The thread count a worker gives its jobs (OMP_NUM_THREADS among them) is tagged; set here so
    # the tags do not depend on how the suite itself was started.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    result = run_in_process(tmp_path, {**LION, "checks": list(table)})

    assert result["status"] == "succeeded", result.get("error")  # the checks ran; one found a fault
    assert result["checks_failed"] == 1
    assert result["report"]["summary"]["failed"] == ["dense_step"]
    ((experiment, _),) = mlflow_client.experiments.items()
    (created,) = mlflow_client.runs
    assert experiment == "optimizer-checks" and created["run_name"] == "check lion lr=0.001 (torch)"
    assert created["tags"] == {
        "job_id": "42",
        "framework": "torch",
        "optimizer": "lion",
        "style": "torch",
        "attempt": "1",
        "kind": "check",
        "threads": "3",
    }
    params = {p.key: p.value for batch in mlflow_client.param_batches for p in batch}
    assert params["optimizer.lr"] == "0.001" and params["optimizer.name"] == "lion"
    assert mlflow_client.metrics() == {
        "checks/construct": 1.0,
        "checks/dense_step": 0.0,
        "checks/descends": 1.0,
    }
    assert {"report.json", "report.md", "spec.json", "result.json"} == set(mlflow_client.artifacts)
    assert json.loads(mlflow_client.artifacts["report.json"])["summary"]["warned"] == ["descends"]
    assert "| dense_step | fail |" in mlflow_client.artifacts["report.md"]
    assert mlflow_client.terminated == [("run-1", "FINISHED")]
    # The class it checked, as a training job records the class it trained.
    source = {"source": "builtin:optimizers.torch.lion", "class_name": "Lion", "sha256": None}
    assert result["optimizer_source"] == source and "warnings" not in result, result
    tags = mlflow_client.tags["run-1"]
    assert (tags["optimizer_source"], tags["optimizer_class"]) == (source["source"], "Lion")


def test_sigterm_during_the_checks_cancels_the_job_and_kills_the_run(
    tmp_path: Path, mlflow_client: RecordingMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stopped_by_the_worker() -> Outcome:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM should have stopped the check")

    table = outcome_table(construct=passed("builds"), dense_step=stopped_by_the_worker)
    monkeypatch.setattr(runner, "checks_for_style", lambda style: table)
    signal.signal(signal.SIGTERM, run._on_sigterm)  # as main() installs it
    result = run_in_process(tmp_path, {**LION, "checks": list(table)})

    assert result["status"] == "cancelled" and result["error"]["type"] == "Cancelled"
    assert mlflow_client.metrics() == {"checks/construct": 1.0}
    assert mlflow_client.terminated == [("run-1", "KILLED")]
    assert "report.json" not in mlflow_client.artifacts
