"""`python -m jobs.run` as the worker runs it: a fresh process per job that always writes result.json.

Each process pays ~8 s of imports, so the independent ones start together in one module fixture
and the tests only wait for (or signal) their own process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 180  # a safety net against hangs on a loaded machine

# The module fixture's job processes start once: on one pytest-xdist worker (ungrouped, its tests
# went to both, and each worker started all seven processes, the endless one included).
pytestmark = pytest.mark.xdist_group("run_entrypoint")
CANCEL_WITHIN_S = 15

ADAM_40: dict[str, Any] = {
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "adam", "params": {"lr": 0.003}},
    "schedule": {"name": "cosine", "params": {"warmup_steps": 5}},
    "steps": 40,
    "batch_size": 32,
    "checkpoint_every": 10,
    "eval_every": 10,
    "device": "cpu",
}

RAISING_PLUGIN = """
import torch


class ExplodingMomentum(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        raise RuntimeError("exploding_momentum: the user's own error message")
"""

# Ends its process in the middle of a step, as code written for a script does where it gives up.
EXITING_PLUGIN = """
import sys

import torch


class ExitingSgd(torch.optim.SGD):
    def step(self, closure=None):
        sys.exit(3)
"""

# Writes a marker, then imports for a long time: SIGTERM arrives inside the registry's plugin loader.
SLOW_IMPORT_PLUGIN = """
import os
import pathlib
import time

import torch

pathlib.Path(os.environ["OPTLAB_TEST_MARKER"]).write_text("importing")
time.sleep(120)


class SlowToImport(torch.optim.SGD):
    pass
"""


@dataclass
class Job:
    workdir: Path
    log: Path
    process: subprocess.Popen[bytes]

    def result(self) -> tuple[int, dict[str, Any]]:
        """Wait for the exit; return the exit status and result.json."""
        returncode = self.process.wait(JOB_TIMEOUT_S)
        return returncode, json.loads((self.workdir / "result.json").read_text())

    def progress(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.workdir / "progress.json").read_text()))
        except (OSError, ValueError):
            return {}


def start_job(
    root: Path, name: str, spec: dict[str, Any], *args: str, env: dict[str, str] | None = None
) -> Job:
    spec_path = root / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    workdir = root / name
    environment = {
        k: v for k, v in os.environ.items() if k not in {"MLFLOW_TRACKING_URI", "OPTLAB_PLUGIN_DIRS"}
    }
    environment["OMP_NUM_THREADS"] = "1"  # several jobs share a small machine here
    environment.update(env or {})
    log = root / f"{name}.log"  # the job's stdout and stderr, for a failing test
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "jobs.run", str(spec_path), "--workdir", str(workdir), *args],
            cwd=REPO_ROOT,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return Job(workdir, log, process)


def plugin_dir(root: Path, name: str, source: str) -> Path:
    directory = root / f"plugins-{name}"
    directory.mkdir()
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return directory


def wait_until(job: Job, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not condition():
        assert job.process.poll() is None, f"the job exited before {what}; see {job.log}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("run")
    raising = plugin_dir(root, "exploding_momentum", RAISING_PLUGIN)
    slow = plugin_dir(root, "slow_to_import", SLOW_IMPORT_PLUGIN)
    started = {
        # Python lists every module it imports in the log.
        "invalid": start_job(root, "invalid", {**ADAM_40, "steps": 0}, env={"PYTHONPROFILEIMPORTTIME": "1"}),
        "long": start_job(root, "long", {**ADAM_40, "steps": 10_000_000, "checkpoint_every": 10_000_000}),
        "straight": start_job(root, "straight", ADAM_40),
        "first_leg": start_job(root, "first_leg", ADAM_40, "--stop-after", "17"),
        "plugin_raises": start_job(
            root,
            "plugin_raises",
            {**ADAM_40, "optimizer": {"name": "exploding_momentum"}},
            env={"OPTLAB_PLUGIN_DIRS": str(raising)},
        ),
        "plugin_exits": start_job(
            root,
            "plugin_exits",
            {**ADAM_40, "optimizer": {"name": "exiting_sgd", "params": {"lr": 0.1}}},
            env={"OPTLAB_PLUGIN_DIRS": str(plugin_dir(root, "exiting_sgd", EXITING_PLUGIN))},
        ),
        "slow_import": start_job(
            root,
            "slow_import",
            # The plugin's own optimizer: a job of a built-in one reads no plugin file.
            {**ADAM_40, "steps": 3, "optimizer": {"name": "slow_to_import", "params": {"lr": 0.1}}},
            env={"OPTLAB_PLUGIN_DIRS": str(slow), "OPTLAB_TEST_MARKER": str(root / "importing")},
        ),
    }
    yield started
    for job in started.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


def test_an_invalid_spec_fails_naming_the_field(jobs: dict[str, Job]) -> None:
    returncode, result = jobs["invalid"].result()
    assert returncode == 1
    assert result["status"] == "failed"
    assert "steps: Input should be greater than 0" in result["error"]["message"]


def test_an_invalid_spec_fails_without_importing_torch(jobs: dict[str, Job]) -> None:
    jobs["invalid"].result()
    imported = [line.rsplit("|", 1)[-1].strip() for line in jobs["invalid"].log.read_text().splitlines()]
    assert "jobs.spec" in imported  # PYTHONPROFILEIMPORTTIME did list the imports
    assert "torch" not in imported


def test_sigterm_cancels_a_running_job(jobs: dict[str, Job]) -> None:
    job = jobs["long"]
    wait_until(job, lambda: job.progress().get("step", 0) > 0, "the first training step")
    job.process.send_signal(signal.SIGTERM)
    job.process.wait(CANCEL_WITHIN_S)
    returncode, result = job.result()
    assert returncode == 1
    assert result["status"] == "cancelled"
    assert result["error"]["type"] == "Cancelled"


def test_resuming_in_a_fresh_process_equals_the_straight_run(jobs: dict[str, Job]) -> None:
    """The test of record: N steps straight == k steps, stop, resume in a new process, N-k steps."""
    returncode, first_leg = jobs["first_leg"].result()
    assert returncode == 0, first_leg.get("error")
    assert first_leg["steps_completed"] == 17
    assert [c["step"] for c in first_leg["checkpoints"]] == [10, 17]
    checkpoint = Path(first_leg["checkpoints"][-1]["path"])
    assert checkpoint.name == "step-00000017.pt"

    root = jobs["first_leg"].workdir.parent
    resumed_job = start_job(root, "resumed", ADAM_40, "--resume", str(checkpoint))
    returncode, straight = jobs["straight"].result()
    assert returncode == 0, straight.get("error")
    returncode, resumed = resumed_job.result()
    assert returncode == 0, resumed.get("error")

    assert resumed["resumed_from_step"] == 17
    assert resumed["steps_completed"] == straight["steps_completed"] == 40
    assert [c["step"] for c in resumed["checkpoints"]] == [20, 30, 40]
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["final"] == straight["final"]


def test_sigterm_while_plugins_load_cancels_the_job(jobs: dict[str, Job]) -> None:
    job = jobs["slow_import"]
    marker = job.workdir.parent / "importing"
    wait_until(job, marker.exists, "the plugin import")
    job.process.send_signal(signal.SIGTERM)
    job.process.wait(CANCEL_WITHIN_S)
    _, result = job.result()
    assert result["status"] == "cancelled"


def test_an_exception_in_a_plugin_optimizer_is_reported(jobs: dict[str, Job]) -> None:
    returncode, result = jobs["plugin_raises"].result()
    assert returncode == 1
    assert result["status"] == "failed"
    assert result["error"]["type"] == "RuntimeError"
    assert result["error"]["message"] == "exploding_momentum: the user's own error message"
    assert "exploding_momentum.py" in result["error"]["traceback"]
    assert "in step" in result["error"]["traceback"]


def test_sys_exit_in_a_plugin_optimizer_fails_the_job_with_a_result_and_its_line(
    jobs: dict[str, Job],
) -> None:
    """SystemExit is no Exception: it had ended the process with no result (the worker saw "exited with
    code 3"), and the log said nothing."""
    returncode, result = jobs["plugin_exits"].result()
    assert returncode == 1 and result["status"] == "failed"
    assert result["error"]["type"] == "SystemExit"
    message = result["error"]["message"]
    assert message.startswith("raised SystemExit(3) (sys.exit() or exit()), which would end the whole")
    assert "exiting_sgd.py:9: sys.exit(3)" in message and "Fix: raise an exception" in message
    assert "SystemExit: 3" in jobs["plugin_exits"].log.read_text()  # the traceback, in the job's log


def test_a_tracking_uri_of_none_means_no_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow would take the word for a folder of runs, and refuse it as a file store.
    from jobs import run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    assert run.parse_args(["spec.json"]).tracking_uri is None
    assert run.parse_args(["spec.json", "--tracking-uri", "None"]).tracking_uri is None
    given = run.parse_args(["spec.json", "--tracking-uri", "http://mlflow:5000"])
    assert given.tracking_uri == "http://mlflow:5000"


class EndedRun:
    """A job's MLflow run as `finish_mlflow_run` uses it, recording how it was ended."""

    def __init__(self, *, upload_fails: bool = False) -> None:
        self.upload_fails = upload_fails
        self.ended: tuple[str, str | None] | None = None

    def log_artifact(self, path: Any, folder: str | None = None) -> None:
        pass

    def log_json(self, name: str, data: Any) -> None:
        if self.upload_fails:
            raise OSError("artifact store full")

    def end(self, status: str, *, outcome: str | None = None) -> None:
        self.ended = (status, outcome)


@pytest.mark.parametrize(
    ("status", "ended"),
    [
        ("succeeded", ("FINISHED", "succeeded")),
        ("diverged", ("FAILED", "diverged")),  # MLflow's FAILED alone read as a failure
        ("failed", ("FAILED", "failed")),
        ("cancelled", ("KILLED", "cancelled")),
    ],
)
def test_a_jobs_run_ends_tagged_with_the_jobs_outcome(status: str, ended: tuple[str, str]) -> None:
    from jobs.result import JobResult
    from jobs.run import finish_mlflow_run

    run = EndedRun()
    result = JobResult(job_id="1", attempt=1, workdir="/tmp/w", status=status)
    assert finish_mlflow_run(run, result, None, None).status == status
    assert run.ended == ended


def test_a_run_whose_artifacts_were_lost_ends_failed_and_says_so() -> None:
    from jobs.result import JobResult
    from jobs.run import finish_mlflow_run

    run = EndedRun(upload_fails=True)
    result = JobResult(job_id="1", attempt=1, workdir="/tmp/w", status="succeeded")
    assert finish_mlflow_run(run, result, None, None).status == "failed"
    assert run.ended == ("FAILED", "failed")


def test_a_failed_jobs_own_error_stays_when_its_last_files_cannot_be_stored_either() -> None:
    """An unwritable artifact store failed the step-500 checkpoint's publication, and then the run's
    spec.json: the second error had replaced the first, its cause, as the job's error."""
    from jobs.result import ErrorRecord, JobResult
    from jobs.run import finish_mlflow_run

    run = EndedRun(upload_fails=True)
    cause = ErrorRecord(type="PermissionError", message="could not store step-00000500.pt ...")
    result = JobResult(job_id="1", attempt=1, workdir="/tmp/w", status="failed", error=cause)
    finished = finish_mlflow_run(run, result, None, None)
    assert finished.status == "failed" and finished.error == cause
    assert finished.warnings == ["its run's last files were not stored either: OSError: artifact store full"]
    assert run.ended == ("FAILED", "failed")


def test_a_jobs_result_says_which_class_trained_and_where_it_came_from(jobs: dict[str, Job]) -> None:
    """Nothing had shown which file or class a job ran (a second plugin file had swapped the class
    under a queued job's name unseen)."""
    _, raised = jobs["plugin_raises"].result()  # the class was loaded and built, then its step raised
    source = raised["optimizer_source"]
    assert source["source"].startswith("plugin ") and source["source"].endswith("exploding_momentum.py")
    assert source["class_name"] == "ExplodingMomentum" and len(source["sha256"]) == 64
    _, straight = jobs["straight"].result()
    assert straight["optimizer_source"]["source"] == "builtin:optimizers.torch.adam"
    assert straight["optimizer_source"].get("sha256") is None
