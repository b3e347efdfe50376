"""A job held up by its tracking server says so in its progress (`waiting`), and only while it is:
MLflow's client retries each request for minutes, and the job had shown a bare `running` meanwhile."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jobs import report, tracking
from jobs.report import Reporter
from jobs.result import PROGRESS_FILE, TRACKING_UNREACHABLE, JobStatus
from jobs.run import parse_args, run_job
from jobs.tracking import NullTracker
from jobs.training.loop import TrainingJob
from optimizers.registry import Registry

from .helpers import digits_spec


@pytest.fixture(autouse=True)
def shown_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait is shown after a tenth of a second here, not ten."""
    monkeypatch.setattr(report, "WAITING_SHOWN_AFTER_S", 0.1)
    monkeypatch.setattr(report, "WAITING_REFRESH_S", 0.1)


def waiting_in(workdir: Path) -> str | None:
    progress: dict[str, Any] = json.loads((workdir / PROGRESS_FILE).read_text())
    return progress.get("waiting")


def shown_within(workdir: Path, seconds: float = 10.0) -> str | None:
    """The first `waiting` progress shows within `seconds`; None if none does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (shown := waiting_in(workdir)) is not None:
            return shown
        time.sleep(0.02)
    return None


def test_a_wait_is_shown_once_it_lasts_and_cleared_when_it_ends(tmp_path: Path) -> None:
    reporter = Reporter(tmp_path)
    reporter.progress(step=3, total=10, force=True)
    with reporter.waiting_on("waiting for the server"):
        pass  # quick: never shown
    assert waiting_in(tmp_path) is None
    with reporter.waiting_on("waiting for the server"):
        shown = shown_within(tmp_path)
    assert shown is not None and shown.startswith("waiting for the server: ") and shown.endswith(" s so far")
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert progress["step"] == 3 and progress.get("waiting") is None


def test_a_job_whose_tracking_server_does_not_answer_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real MLflow client against a server that takes the connection and never answers until the
    job's progress has said what it waits on; then the server hangs up."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # Tried again for a second, not ten minutes, once the server has hung up (and refuses).
    monkeypatch.setattr(tracking, "METRIC_RETRY_FOR_S", 1.0)
    monkeypatch.setattr(tracking, "START_RETRY_EVERY_S", 0.1)
    workdir = tmp_path / "job"
    seen: list[str | None] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def stall() -> None:
        connection, _ = listener.accept()
        connection.recv(65536)
        seen.append(shown_within(workdir))
        connection.close()
        listener.close()  # then refused at once: a try again would wait out MLflow's request timeout

    server = threading.Thread(target=stall, daemon=True)
    server.start()
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(digits_spec(steps=2).model_dump_json())
    port = listener.getsockname()[1]
    args = parse_args(
        [str(spec_file), "--workdir", str(workdir), "--tracking-uri", f"http://user:secret@127.0.0.1:{port}"]
    )
    result = run_job(args)
    server.join(timeout=30)
    listener.close()
    assert result.status is JobStatus.FAILED and result.error is not None  # the server never answered
    assert result.error.type == TRACKING_UNREACHABLE  # which the worker retries
    [shown] = seen
    assert shown is not None
    assert shown.startswith(
        f"waiting for the MLflow server at http://127.0.0.1:{port} to start the job's run: "
    )
    assert "secret" not in shown
    assert waiting_in(workdir) is None  # the job has ended: it waits on nothing


class SlowStore:
    """Checkpoints that take until the job's progress says it waits on them to publish."""

    folder = None
    in_run = False
    warnings = ()
    server = "http://mlflow.test:5000"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.seen: list[str | None] = []

    def publish(self, path: Path) -> str:
        self.seen.append(shown_within(self.workdir))
        return str(path)

    def retire(self, path: Path) -> None:
        pass


@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_publication_that_holds_training_up_is_shown(tmp_path: Path, registry: Registry) -> None:
    store = SlowStore(tmp_path)
    job = TrainingJob(
        digits_spec(steps=4, checkpoint_every=2, eval_every=4),
        registry=registry,
        workdir=tmp_path,
        tracker=NullTracker(),
        reporter=Reporter(tmp_path),
        checkpoints=store,
    )
    outcome = job.run()
    assert [record.step for record in outcome.checkpoints] == [2, 4]
    # The loop waits on each publication (before the next checkpoint, at the end): shown each time.
    assert len(store.seen) == 2
    for shown, step in zip(store.seen, [2, 4], strict=True):
        assert shown is not None and shown.startswith(
            f"waiting to publish the checkpoint of step {step} (its metrics, then the file) to the MLflow "
            "server at http://mlflow.test:5000: "
        )
    assert waiting_in(tmp_path) is None
