"""`optlab submit --wait`: its progress bar's label and counter, and the line it ends with (service/cli.py,
service/progress.py), fed by stand-in clients instead of a running service."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from service import cli
from service.client import ApiClient
from service.progress import follow_jobs

TF_LEGACY_JOB = {
    "id": 7,
    "status": "queued",
    "spec": {
        "framework": "tensorflow",
        "optimizer": {"name": "lion", "params": {"lr": 3e-4}, "style": "tf_legacy"},
    },
}
RESULT = {"job_id": "7", "attempt": 1, "workdir": "/w", "status": "succeeded"}


def submitted(
    final: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, labels: dict[int, str]
) -> int:
    """`optlab submit --wait` of a tf_legacy job whose wait ends with `final`; `labels` gets its bars'."""
    spec = tmp_path / "job.json"
    spec.write_text('{"steps": 1}')
    monkeypatch.setattr(ApiClient, "submit", lambda self, body: TF_LEGACY_JOB)

    def follow(client: ApiClient, shown: dict[int, str]) -> dict[int, dict[str, Any]]:
        labels.update(shown)
        return {7: {"id": 7, **final}}

    monkeypatch.setattr("service.progress.follow_jobs", follow)
    return cli.main(["submit", str(spec), "--wait", "--api", "http://127.0.0.1:9"])


def test_the_final_line_shows_the_job_s_last_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ended "job 7 succeeded": the figure waited for was in MLflow only."""
    final = {"train_loss": 0.0987, "val_loss": 0.12345, "val_accuracy": 0.96111}
    result = {**RESULT, "final": final}
    assert submitted({"status": "succeeded", "result": result}, tmp_path, monkeypatch, {}) == 0
    assert (
        "job 7 succeeded: val/accuracy 0.9611, val/loss 0.1235, train/loss 0.0987\n"
        in capsys.readouterr().out
    )


def test_a_job_without_metrics_ends_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = {"type": "ValueError", "message": "lr refused"}
    final = {"status": "failed", "result": {**RESULT, "status": "failed"}, "error": error}
    assert submitted(final, tmp_path, monkeypatch, {}) == 1
    assert "job 7 failed\n  ValueError: lr refused\n" in capsys.readouterr().out


def test_the_bar_of_a_tensorflow_job_names_its_style(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It read "lion lr=3e-4" for a tf_legacy job, as a Keras 3 job of lion reads."""
    labels: dict[int, str] = {}
    submitted({"status": "succeeded", "result": RESULT}, tmp_path, monkeypatch, labels)
    assert labels == {7: "lion (tf_legacy) lr=3e-4"}


class OneJob(ApiClient):
    """A wait that sees one job at its last step once."""

    def __init__(self) -> None:
        super().__init__("http://api.test")

    def wait(self, job_ids: list[int], on_update: Any = None, **kwargs: Any) -> dict[int, dict[str, Any]]:
        job = {"id": 7, "status": "running", "progress": {"step": 20000, "total": 20000}, "latest_loss": 0.5}
        on_update(job)
        return {7: job}


def test_the_counter_is_whole_in_an_80_column_terminal() -> None:
    """The other columns squeezed it to "20000/2…"."""
    out = io.StringIO()
    follow_jobs(OneJob(), {7: "lion (tf_legacy) lr=3e-4"}, Console(file=out, width=80))
    last = out.getvalue().splitlines()[-1]
    assert "20000/20000 running" in last and "loss 0.5000" in last, last


def _optimizer_detail(fail: int) -> dict[str, Any]:
    check = {"job_id": 3, "fail": fail, "failed": ["state_roundtrip"] if fail else [], "pass": 17}
    return {
        "name": "lion",
        "implementations": [
            {"framework": "tensorflow", "style": "keras", "latest_check": None},
            {"framework": "tensorflow", "style": "tf_legacy", "latest_check": check},
        ],
    }


@pytest.mark.parametrize("fail", [1, 0], ids=["failed", "passed"])
def test_a_job_of_an_optimizer_that_failed_its_latest_check_is_noted_at_submission(
    fail: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing had said so: the job ran into what the check had found (its style's check only)."""
    spec = tmp_path / "job.json"
    spec.write_text('{"steps": 1}')
    monkeypatch.setattr(ApiClient, "submit", lambda self, body: TF_LEGACY_JOB)
    monkeypatch.setattr(ApiClient, "optimizer", lambda self, name, timeout_s: _optimizer_detail(fail))
    assert cli.main(["submit", str(spec), "--api", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    note = (
        "  note: optimizer 'lion' (tf_legacy) failed its latest conformance check (check job 3: "
        "state_roundtrip): http://127.0.0.1:9/optimizers/lion\n"
    )
    assert (note in out) == bool(fail), out


def test_a_study_notes_each_optimizer_that_failed_its_latest_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "study.json"
    optimizers = [{"name": "lion", "style": "tf_legacy"}, {"name": "lion", "style": "keras", "label": "k"}]
    spec.write_text(json.dumps({"framework": "tensorflow", "optimizers": optimizers}))
    monkeypatch.setattr(
        ApiClient, "submit_study", lambda self, body: {"id": 4, "status": "running", "jobs": []}
    )
    monkeypatch.setattr(ApiClient, "optimizer", lambda self, name, timeout_s: _optimizer_detail(1))
    assert cli.main(["study", str(spec), "--api", "http://127.0.0.1:9"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  note: ")]
    assert notes == [
        "  note: optimizer 'lion' (tf_legacy) failed its latest conformance check (check job 3: "
        "state_roundtrip): http://127.0.0.1:9/optimizers/lion"
    ]  # the keras implementation was never checked


def test_a_wait_the_api_refuses_midway_says_the_job_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The token was revoked while `optlab submit --wait` followed the job: it had said only
    "HTTP 401: ...", as if the job had been refused."""
    from service.client import ApiError

    spec = tmp_path / "job.json"
    spec.write_text('{"steps": 1}')
    monkeypatch.setattr(ApiClient, "submit", lambda self, body: TF_LEGACY_JOB)

    def refused(client: ApiClient, shown: dict[int, str]) -> dict[int, dict[str, Any]]:
        raise ApiError(401, "the bearer token is not one this API knows")

    monkeypatch.setattr("service.progress.follow_jobs", refused)
    assert cli.main(["submit", str(spec), "--wait", "--api", "http://127.0.0.1:9"]) == 2  # the token: usage
    assert capsys.readouterr().err.splitlines() == [
        "optlab submit: HTTP 401: the bearer token is not one this API knows",
        "  job 7 goes on: http://127.0.0.1:9/jobs/7",
    ]
