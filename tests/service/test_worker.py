"""The worker's process handling, with stand-in job programs (the real one runs in e2e tests).

A stand-in is a shell script in place of the job interpreter: it receives the same
arguments (`-m jobs.run SPEC --workdir DIR ...`) and misbehaves on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import LOG_FILE, JobStatus
from jobs.spec import JobSpec
from service import job_log, store
from service import worker as worker_module
from service.models import Job
from service.schemas import JobRead
from service.settings import Settings
from service.worker import Worker

SPEC = JobSpec.model_validate(
    {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "adam"}, "steps": 10}
)

# Finds DIR after --workdir in the arguments.
WORKDIR = 'while [ $# -gt 0 ] && [ "$1" != "--workdir" ]; do shift; done; W="$2"'


def stand_in(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{WORKDIR}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def make_worker(settings: Settings, sessions: sessionmaker[Session], job_python: str) -> Worker:
    fast = settings.model_copy(
        # A shell stand-in cannot wait warm for a job (jobs.warm): no warm pool.
        update={"job_python": job_python, "poll_interval_s": 0.1, "cancel_grace_s": 2.0, "warm_pool": False}
    )
    return Worker(fast, sessions, worker_id="test-worker")


def submit(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return store.create_job(session=session, spec=SPEC).id


def job_row(sessions: sessionmaker[Session], job_id: int) -> store.Job:
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None
        return job


def test_result_file_decides_the_status(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    body = (
        'echo \'{"step": 10, "total": 10, "loss": 0.5}\' > "$W/progress.json"\n'
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "\'"$W"\'",'
        ' "status": "diverged", "steps_completed": 7, "diverged_at_step": 7,'
        ' "error": {"type": "Diverged", "message": "train/loss became nan at step 7"}}\' > "$W/result.json"'
    )
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    assert worker.run_next() is True
    job = job_row(sessions, job_id)
    assert job.status == "diverged" and job.step == 7
    assert job.error is not None and "step 7" in job.error["message"]
    assert worker.run_next() is False  # queue empty


def test_the_worker_s_checkpoint_retention_reaches_its_jobs_and_no_other_value(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPTLAB_KEEP_CHECKPOINTS as the worker read it at its start (in its settings), or none."""
    monkeypatch.setenv("OPTLAB_KEEP_CHECKPOINTS", "9")  # the shell's, after the settings were read
    seen = tmp_path / "seen.txt"
    body = (
        f'echo "${{OPTLAB_KEEP_CHECKPOINTS-unset}}" >> "{seen}"\n'
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded",'
        ' "steps_completed": 10}\' > "$W/result.json"'
    )
    for keep in (3, None):
        worker = make_worker(
            settings.model_copy(update={"keep_checkpoints": keep}), sessions, stand_in(tmp_path, body)
        )
        submit(sessions)
        assert worker.run_next() is True
    assert seen.read_text().split() == ["3", "unset"]


@pytest.mark.parametrize(
    ("reported", "left"),
    [
        # Its checkpoints are in its MLflow run: what lies in its folder is a copy, and goes.
        ("runs:/r1/checkpoints/step-00000010.pt", []),
        # In its folder only (no tracking server): the one a retry on this host resumes from stays.
        ("'\"$W\"'/checkpoints/step-00000010.pt", ["step-00000010.pt"]),
    ],
)
def test_a_killed_attempt_leaves_no_checkpoint_nothing_will_read(
    reported: str, left: list[str], tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Killed mid-save (out of memory, kill -9): a write cut short, the local copy of the last
    checkpoint published, a DDP job's other rank's own, the checkpoint it had downloaded to resume
    from, a whole model each, had stayed on the worker's disk for good."""
    body = (
        'C="$W/checkpoints"; R="$W/rank-1/checkpoints"; mkdir -p "$C" "$R"\n'
        'echo x > "$C/step-00000010.pt"; echo x > "$C/.step-00000020.pt.tmp"\n'
        'echo x > "$R/step-00000010.pt"\n'
        'mkdir "$W/resumed-from"; echo x > "$W/resumed-from/step-00000005.pt"\n'
        'echo \'{"step": 15, "total": 40, "checkpoint": {"step": 10, "ok": true, "path": "'
        + reported
        + '"}}\' > "$W/progress.json"\nkill -9 $$'
    )
    worker = make_worker(settings.model_copy(update={"job_retries": 0}), sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    assert worker.run_next() is True
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.error is not None and job.error["type"] == "JobProcessDied"
    folder = settings.jobs_dir / str(job_id) / "attempt-1" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == left
    assert list((folder.parent / "rank-1" / "checkpoints").iterdir()) == []  # never the job's
    assert not (folder.parent / "resumed-from").exists()  # a download of what its run holds


@pytest.mark.parametrize("in_run", [True, False])
def test_an_attempt_killed_with_its_worker_leaves_no_checkpoint_for_good(
    in_run: bool, tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Its worker was killed with it (kill -9), so no supervisor removed what it left: the next
    attempt's worker does, keeping only the checkpoint it resumes from where that lies in the folder,
    and that one too once the job has succeeded. A write cut short had stayed for good."""
    job_id = submit(sessions)
    earlier = settings.jobs_dir / str(job_id) / "attempt-1" / "checkpoints"
    earlier.mkdir(parents=True)
    for name in ("step-00000020.pt", ".step-00000040.pt.tmp"):
        (earlier / name).write_text("x")
    ref = "runs:/r1/checkpoints/step-00000020.pt" if in_run else str(earlier / "step-00000020.pt")
    with sessions() as session:  # attempt 1 ran on a worker that died with it
        store.claim_next(session=session, worker_id="dead", lease_s=30)
        store.requeue_job(session=session, job_id=job_id, worker_id="dead", attempt=1, reason="died")
        session.execute(update(Job).where(Job.id == job_id).values(checkpoint_ref=ref))
        session.commit()
    body = (
        'ls -A "$W/../attempt-1/checkpoints" > "$W/seen"\n'
        'echo \'{"job_id": "1", "attempt": 2, "workdir": "/w", "status": "succeeded"}\' > "$W/result.json"'
    )
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    assert worker.run_next() is True
    assert job_row(sessions, job_id).status == "succeeded"
    seen = (earlier.parent.parent / "attempt-2" / "seen").read_text().split()
    assert seen == ([] if in_run else ["step-00000020.pt"])
    assert list(earlier.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "invalid OPTLAB_KEEP_CHECKPOINTS: Input should be greater than or equal to 1"),
        ("all", "invalid OPTLAB_KEEP_CHECKPOINTS: Input should be a valid integer"),
    ],
)
def test_a_number_of_checkpoints_to_keep_a_job_could_not_is_refused_at_the_start(
    value: str, words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    monkeypatch.setenv("OPTLAB_KEEP_CHECKPOINTS", value)
    assert main(["db", "upgrade"]) == 2  # as every command: the settings are read first
    assert capsys.readouterr().err.startswith(f"optlab: {words}")


def test_an_empty_number_of_checkpoints_to_keep_keeps_every_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTLAB_KEEP_CHECKPOINTS", "")  # compose's `${VAR:-}`
    assert Settings().keep_checkpoints is None


def test_a_result_with_a_renamed_key_fails_the_job_naming_the_key(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    body = (
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded",'
        ' "steps_done": 10}\' > "$W/result.json"'
    )
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status is JobStatus.FAILED and job.result is None and job.error is not None
    assert job.error["type"] == "InvalidResult"
    assert "steps_done" in job.error["message"] and "Extra inputs are not permitted" in job.error["message"]


def test_progress_with_a_renamed_key_fails_the_job_and_stops_its_process(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    body = 'echo \'{"step": 3, "total": 10, "train_loss": 0.5}\' > "$W/progress.json"\nexec sleep 300'
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    started = time.monotonic()
    worker.run_next()
    assert time.monotonic() - started < 30  # the process was stopped, not waited for
    job = job_row(sessions, job_id)
    assert job.status is JobStatus.FAILED and job.error is not None
    assert job.error["type"] == "WorkerError" and "train_loss" in job.error["message"]


@pytest.mark.parametrize("signal_name", ["KILL", "TERM"])
def test_a_job_process_killed_from_outside_is_retried_as_often_as_allowed(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], signal_name: str
) -> None:
    """SIGKILL (the kernel's out-of-memory killer) or SIGTERM from outside: queued again, twice here;
    the third time it fails, saying it was retried."""
    worker = make_worker(
        settings.model_copy(update={"job_retries": 2}),
        sessions,
        stand_in(tmp_path, f'echo "allocating" >&2; kill -{signal_name} $$'),
    )
    job_id = submit(sessions)
    for retry in (1, 2):
        worker.run_next()
        job = job_row(sessions, job_id)
        assert job.status == "queued" and job.retries == retry and job.error is not None
        assert job.error["type"] == "Interrupted"
        assert f"killed by signal SIG{signal_name} (out of memory, or from outside)" in job.error["message"]
        assert (
            f"retry {retry} of 2 (OPTLAB_JOB_RETRIES); it will run again from the start"
            in job.error["message"]
        )
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.attempt == 3 and job.error is not None
    assert job.error["type"] == "JobProcessDied" and f"signal SIG{signal_name}" in job.error["message"]
    assert (
        "it had been started again 2 times after the same, as many times as OPTLAB_JOB_RETRIES allows"
        in (job.error["message"])
    )
    assert "allocating" in job.error["traceback"]
    # Each attempt that ended, in the job's history: where, when, and how.
    history = JobRead.from_row(job).attempt_history
    assert [(a.attempt, a.ended, a.worker_id) for a in history] == [
        (1, "interrupted", "test-worker"),
        (2, "interrupted", "test-worker"),
        (3, "failed", "test-worker"),
    ]
    assert history[0].reason is not None and "retry 1 of 2" in history[0].reason
    assert history[2].reason == job.error["message"]
    assert all(a.started_at is not None and a.started_at <= a.ended_at for a in history)


def test_a_job_cancelled_as_its_killed_process_is_requeued_ends_with_its_mlflow_run(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands between the kill and the requeue: the job ends cancelled, and its MLflow run,
    which no attempt will resume now, is ended KILLED (it had stayed RUNNING)."""
    worker = make_worker(settings, sessions, stand_in(tmp_path, "kill -KILL $$"))
    job_id = submit(sessions)
    requeue = store.requeue_job

    def cancelled_first(**kwargs: Any) -> bool:
        store.request_cancel(session=kwargs["session"], job_id=job_id)
        return requeue(**kwargs)

    ended: list[tuple[str, bool]] = []
    monkeypatch.setattr(store, "requeue_job", cancelled_first)
    monkeypatch.setattr(
        worker_module.Supervision, "_end_mlflow_run", lambda _, status, force: ended.append((status, force))
    )
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "cancelled" and job.retries == 0 and ended == [("KILLED", True)]
    assert [a["ended"] for a in job.attempt_history] == ["cancelled"]


def test_a_job_cancelled_while_queued_to_run_again_gets_the_run_its_last_attempt_left_open_ended(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its killed attempt left its MLflow run open for the next; the cancel means there is none, so
    the worker ends it KILLED, once; a job cancelled before it ever ran has no run to end."""
    worker = make_worker(settings, sessions, stand_in(tmp_path, "kill -KILL $$"))
    ran, never = submit(sessions), submit(sessions)
    worker.run_next()  # killed: queued to run again
    with sessions() as session:
        session.execute(update(Job).where(Job.id == ran).values(mlflow={"run_id": "r-1"}))
        session.commit()
        for job_id in (ran, never):
            store.request_cancel(session=session, job_id=job_id)
    ended: list[tuple[int, str, str, bool]] = []
    monkeypatch.setattr(
        worker_module,
        "end_mlflow_run",
        lambda uri, job_id, run_id, status, force: ended.append((job_id, run_id, status, force)) or True,
    )
    worker.close_runs_left_open()
    worker.close_runs_left_open()  # a heartbeat later: nothing left to end
    assert ended == [(ran, "r-1", "KILLED", False)]
    assert job_row(sessions, ran).status == "cancelled" and not job_row(sessions, ran).cancel_requested


@pytest.mark.parametrize(
    ("error_type", "said"),
    [
        # Rank 0 writes the result of a DDP job: RankKilled where another rank was killed (out of memory).
        ("RankKilled", "DDP rank 1 of 2 was killed by signal SIGKILL (out of memory, or from outside)"),
        # The MLflow server gave no answer while the job's run was started: it had failed for good.
        (
            "TrackingUnreachable",
            "the MLflow server at http://m:5000 gave no answer for 600 s",  # no quote: the stand-in echoes it
        ),
    ],
)
def test_a_job_stopped_by_a_cause_outside_it_is_retried(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], error_type: str, said: str
) -> None:
    """Started again as a job whose own process was killed is."""
    body = (
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "\'"$W"\'", "status": "failed",'
        f' "error": {{"type": "{error_type}", "message": "{said}"}}}}\' > "$W/result.json"'
    )
    worker = make_worker(settings.model_copy(update={"job_retries": 1}), sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "queued" and job.retries == 1 and job.error is not None
    assert (
        job.error["message"]
        == f"{said} before it ended; retry 1 of 1 (OPTLAB_JOB_RETRIES); it will run again from the start"
    )
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.error is not None and job.error["message"].startswith(said)
    assert "started again once after the same" in job.error["message"]
    # Memory is the advice for a killed rank only: a server that gave no answer is the server's.
    memory = "if it runs out of memory, give it a smaller batch or model"
    assert (memory in job.error["message"]) == (error_type == "RankKilled"), job.error["message"]
    assert ("the MLflow server must answer" in job.error["message"]) == (error_type == "TrackingUnreachable")


# Signal 40 is a real-time signal: `signal.Signals` has no name for it, and naming it had crashed
# the worker's loop.
@pytest.mark.parametrize(("signal_sent", "said"), [("SEGV", "signal SIGSEGV"), ("40", "signal 40")])
def test_a_job_process_that_crashes_by_a_signal_is_not_retried(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], signal_sent: str, said: str
) -> None:
    worker = make_worker(settings, sessions, stand_in(tmp_path, f"kill -{signal_sent} $$"))
    job_id = submit(sessions)
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.retries == 0 and job.error is not None
    assert f"the job process was killed by {said} before writing a result" in job.error["message"]
    assert "started again" not in job.error["message"]


def test_a_job_process_that_dies_fails_with_its_log_tail(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    worker = make_worker(
        settings, sessions, stand_in(tmp_path, 'echo "Segmentation fault in user code" >&2; exit 139')
    )
    job_id = submit(sessions)
    next_id = submit(sessions)
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.error is not None
    assert job.error["type"] == "JobProcessDied"
    assert "exited with code 139" in job.error["message"]
    assert "Segmentation fault in user code" in job.error["traceback"]
    worker.run_next()  # the worker carries on with the next job
    assert job_row(sessions, next_id).status == "failed"


def test_a_job_that_prints_without_end_keeps_a_bounded_log_with_its_start_and_its_end(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # 40 lines of 50 KB over about two seconds (an optimizer printing every step), then a crash.
    body = (
        "for i in $(seq 1 40); do head -c 51200 /dev/zero | tr '\\0' x; echo \" line $i\"; sleep 0.05; done\n"
        'echo "the crash at the end" >&2; exit 139'
    )
    worker = make_worker(settings.model_copy(update={"job_log_mb": 0.25}), sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    worker.run_next()
    job = job_row(sessions, job_id)
    assert job.status is JobStatus.FAILED and job.error is not None and job.error["type"] == "JobProcessDied"
    assert job.error["traceback"].rstrip().endswith("the crash at the end")  # the tail is still the end
    log = (settings.jobs_dir / str(job_id) / "attempt-1" / LOG_FILE).read_text()
    assert len(log) < 40 * 51200 // 2  # bounded: 256 KB, and what a poll's interval brings after it
    assert " line 1\n" in log and " line 40\n" in log  # its start, and its latest output
    assert log.count("[optlab: output cut here") == 1 and "OPTLAB_JOB_LOG_MB=0.25]" in log
    assert " line 20\n" not in log  # the middle is what was cut


def test_a_job_that_died_on_a_full_disk_says_so(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk leaves no result and no log: the exit code alone had been all a user was told."""
    worker = make_worker(settings, sessions, stand_in(tmp_path, "exit 1"))
    job_id = submit(sessions)
    full = SimpleNamespace(total=10**9, used=10**9, free=4096)  # what shutil.disk_usage gives
    monkeypatch.setattr(worker_module.shutil, "disk_usage", lambda path: full)
    monkeypatch.setattr(worker, "_disk_is_full", lambda: False)  # it filled after the claim
    worker.run_next()
    error = job_row(sessions, job_id).error
    assert error is not None and error["type"] == "JobProcessDied"
    assert "exited with code 1 before writing a result; the file system of its folder" in error["message"]
    assert "has 4096 bytes free: a full disk keeps a job from writing" in error["message"]


def test_cancelling_a_running_job_ends_its_whole_process_group(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # The job starts a grandchild, as a data loader would; cancellation must end it too.
    body = 'sleep 300 & echo $! > "$W/child.pid"\necho started > "$W/started"\nwait'
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    thread = threading.Thread(target=worker.run_next)
    thread.start()
    workdir = settings.jobs_dir / str(job_id) / "attempt-1"
    _wait_for(lambda: (workdir / "started").exists())
    with sessions() as session:
        store.request_cancel(session=session, job_id=job_id)
    asked = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - asked < 10
    job = job_row(sessions, job_id)
    assert job.status == "cancelled" and job.error is not None
    # Said by the worker, which knows it was a cancel; a stop asked for has no traceback to show.
    assert job.error["message"].startswith("cancelled while running") and not job.error.get("traceback")
    child = int((workdir / "child.pid").read_text())
    _wait_for(lambda: not _alive(child))


def test_a_cancelled_jobs_progress_and_history_end_at_the_step_its_error_names(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Progress is written at most every PROGRESS_WRITE_S: the step the job reached just before the
    cancel is not written yet when the worker records the end, and had been left behind."""
    body = (
        'echo \'{"step": 3, "total": 100}\' > "$W/progress.json"\n'
        'while [ ! -e "$W/go" ]; do sleep 0.05; done\n'
        'echo \'{"step": 7, "total": 100}\' > "$W/progress.json"\necho > "$W/at-7"\nexec sleep 300'
    )
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    thread = threading.Thread(target=worker.run_next)
    thread.start()
    workdir = settings.jobs_dir / str(job_id) / "attempt-1"
    _wait_for(lambda: job_row(sessions, job_id).step == 3)
    (workdir / "go").write_text("")
    _wait_for(lambda: (workdir / "at-7").exists())
    with sessions() as session:
        store.request_cancel(session=session, job_id=job_id)
    thread.join(timeout=30)
    job = job_row(sessions, job_id)
    assert job.status == "cancelled" and job.error is not None
    assert job.error["message"] == "cancelled while running at step 7 of 100"
    assert job.step == 7 and job.attempt_history[-1]["step"] == 7


def test_a_resumed_attempt_cancelled_before_it_reports_is_cancelled_at_its_checkpoints_step(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Its process reports step 0 until it has loaded the checkpoint: the error had said "at step 0"
    while the job's progress and history said 40."""
    body = 'echo \'{"step": 0, "total": 100}\' > "$W/progress.json"; echo > "$W/started"; exec sleep 300'
    # An MLflow store that answers at once (its run r1 unknown) for the worker's look at the run resumed.
    tracked = settings.model_copy(update={"mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    worker = make_worker(tracked, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    with sessions() as session:  # as a first attempt killed after its checkpoint at step 40 left it
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                attempt=1,
                checkpoint_step=40,
                checkpoint_ref=str(tmp_path / "step-40.pt"),
                mlflow={"run_id": "r1"},
            )
        )
        session.commit()
    thread = threading.Thread(target=worker.run_next)
    thread.start()
    _wait_for(lambda: (settings.jobs_dir / str(job_id) / "attempt-2" / "started").exists())
    with sessions() as session:
        store.request_cancel(session=session, job_id=job_id)
    thread.join(timeout=30)
    job = job_row(sessions, job_id)
    assert job.status == "cancelled" and job.error is not None
    assert job.error["message"] == "cancelled while running at step 40 of 100"
    assert job.step == 40


@pytest.mark.parametrize(
    ("meanwhile", "why"),
    [
        ("cancelled", "and the job was cancelled meanwhile"),
        ("taken over", "and attempt 2 took over"),
    ],
)
def test_an_outcome_the_store_refuses_says_why_as_the_job_s_row_does(
    settings: Settings,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
    meanwhile: str,
    why: str,
) -> None:
    """A worker frozen past its lease, whose job was cancelled meanwhile, logged "another attempt took
    over" where no other attempt ever ran."""
    worker = make_worker(settings, sessions, "python")
    job_id = submit(sessions)
    with sessions() as session:
        job = store.claim_next(session=session, worker_id=worker.worker_id, lease_s=0.01)
        assert job is not None and job.id == job_id
    supervision = worker_module.Supervision(worker, job, [], time.monotonic())
    time.sleep(0.05)  # the lease expired: a cancel ends the job at once, another worker may take it
    with sessions() as session:
        if meanwhile == "cancelled":
            store.request_cancel(session=session, job_id=job_id)
        else:
            assert store.claim_next(session=session, worker_id="another-worker", lease_s=60) is not None
    with caplog.at_level("WARNING", logger="optlab.worker"):
        assert not supervision.record(JobStatus.SUCCEEDED, None, None)
    assert (
        f"job {job_id}: attempt 1 is no longer this worker's (its lease expired while this worker did not "
        f"answer, {why}); its succeeded outcome was discarded"
    ) in caplog.text


def test_a_stopping_worker_hands_its_job_back_to_the_queue(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    worker = make_worker(
        settings, sessions, stand_in(tmp_path, 'echo started > "$W/started"; exec sleep 300')
    )
    job_id = submit(sessions)
    with sessions() as session:
        store.register_worker(
            session=session,
            worker_id=worker.worker_id,
            frameworks=["torch"],
            devices=["cpu"],
            gpus=0,
            slots=1,
            catalogue_sha256="0" * 64,
        )
    thread = threading.Thread(target=worker.run_forever)
    thread.start()
    _wait_for(lambda: (settings.jobs_dir / str(job_id) / "attempt-1" / "started").exists())
    worker.stopping.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    job = job_row(sessions, job_id)
    assert job.status == "queued" and job.attempt == 1
    assert job.error is not None and "worker stopped" in job.error["message"]
    with sessions() as session:  # gone at once, not a lease later: its handed-back job says it waits for one
        assert store.live_workers(session=session, within_s=settings.lease_s) == []


def test_a_study_summary_waiting_on_mlflow_holds_up_no_claim_nor_heartbeat(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Summaries were made in the polling loop: one waiting on a stopped MLflow server (its client
    waits for many minutes) held up every claim and heartbeat, and the worker read as gone."""
    answered = threading.Event()
    summarizing = threading.Event()

    def waits_on_mlflow(**_: Any) -> bool:
        summarizing.set()
        answered.wait(30)
        return False

    monkeypatch.setattr(worker_module, "finalize_next_study", waits_on_mlflow)
    fast = settings.model_copy(update={"heartbeat_s": 0.05})
    succeeds = (
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}\' > "$W/result.json"'
    )
    worker = make_worker(fast, sessions, stand_in(tmp_path, succeeds))
    thread = threading.Thread(target=worker.run_forever)
    thread.start()
    try:
        _wait_for(summarizing.is_set)
        job_id = submit(sessions)
        _wait_for(lambda: job_row(sessions, job_id).status == "succeeded")
        seen = worker.seen_at
        _wait_for(lambda: worker.seen_at > seen)  # still heartbeating
    finally:
        answered.set()
        worker.stopping.set()
        thread.join(timeout=30)


def test_a_worker_that_stops_mid_summary_gives_its_study_back_at_once(
    tmp_path: Path,
    settings: Settings,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    catalogue_data: dict[str, Any],
) -> None:
    """Stopped (SIGTERM) while its summary waited on MLflow, the worker exited and the study read
    "summarizing" with no reason until the claim expired, ten minutes; now it is free for the next
    worker at once, and the claim itself is shorter and renewed while the summary is being made."""
    from sqlalchemy import select

    from jobs.spec import Catalogue, StudySpec, study_errors
    from service.models import Study
    from service.studies import finalize as finalize_module
    from service.studies import store as study_store

    spec = StudySpec.model_validate(
        {
            "name": "stopped",
            "workload": {"name": "digits_mlp"},
            "optimizers": [{"name": "sgd", "params": {"lr": [0.1]}}],
            "seeds": [0],
            "steps": 10,
        }
    )
    errors, members = study_errors(spec, Catalogue.model_validate(catalogue_data), max_steps=100, max_jobs=10)
    assert not errors
    with sessions() as session:
        study = study_store.create_study(session=session, spec=spec, jobs=members, submitted_by="alice")
        session.execute(update(Job).where(Job.study_id == study.id).values(status=JobStatus.SUCCEEDED))
        session.commit()
    answered, summarizing = threading.Event(), threading.Event()

    def waits_on_mlflow(**_: Any) -> Any:
        summarizing.set()
        answered.wait(60)
        raise ConnectionError("MLflow gave up")

    monkeypatch.setattr(finalize_module, "finalize", waits_on_mlflow)
    monkeypatch.setattr(worker_module, "FINISH_SUMMARY_S", 0.1)
    worker = make_worker(settings, sessions, stand_in(tmp_path, "exit 0"))
    thread = threading.Thread(target=worker.run_forever)
    thread.start()
    try:
        _wait_for(summarizing.is_set)
        with sessions() as session:
            held = session.scalars(select(Study.finalizing_until).where(Study.id == study.id)).one()
        assert held is not None
        assert finalize_module.FINALIZE_LEASE_S <= 120
        worker.stopping.set()
        thread.join(timeout=30)
        assert not thread.is_alive()
        with sessions() as session:
            claimed = study_store.claim_study_to_finalize(session=session, lease_s=60)
        assert claimed is not None and claimed.id == study.id
    finally:
        answered.set()
        worker.stopping.set()
        thread.join(timeout=30)


def test_catalogue_failure_is_reported(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    from service.worker import CatalogueError

    worker = make_worker(settings, sessions, stand_in(tmp_path, 'echo "ImportError: no torch" >&2; exit 1'))
    with pytest.raises(CatalogueError, match="no torch"):
        worker.publish_catalogue()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(condition: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


class RecordingMlflow:
    """MlflowClient as `end_mlflow_run` uses it, recording its calls in order."""

    calls: list[tuple[str, ...]] = []

    def __init__(self, tracking_uri: str) -> None:
        pass

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(info=SimpleNamespace(status="RUNNING", lifecycle_stage="active"))

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.calls.append(("set_tag", run_id, key, value))

    def set_terminated(self, run_id: str, status: str) -> None:
        self.calls.append(("set_terminated", run_id, status))


@pytest.mark.parametrize(("status", "outcome"), [("FAILED", "failed"), ("KILLED", "cancelled")])
def test_a_run_the_worker_ends_is_tagged_with_the_jobs_outcome_first(
    monkeypatch: pytest.MonkeyPatch, status: str, outcome: str
) -> None:
    """A job killed at its memory limit, or cancelled, had its run ended with no `outcome` tag."""
    import mlflow.tracking

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", RecordingMlflow)
    RecordingMlflow.calls = []
    assert worker_module.end_mlflow_run("http://mlflow.test", 7, "r-7", status, force=True)
    assert RecordingMlflow.calls == [
        ("set_tag", "r-7", "outcome", outcome),
        ("set_terminated", "r-7", status),
    ]


def test_a_data_parallel_attempts_rank_logs_are_copied_to_its_run_beside_rank_0s(tmp_path: Path) -> None:
    """Ranks 1..N-1 print to `rank-R/log.txt` (their own faults, their stacks when stalled): only rank
    0's log had reached the run."""
    from mlflow.tracking import MlflowClient

    workdir = tmp_path / "attempt-2"
    for folder, text in [
        (".", "rank 0"),
        ("rank-1", "rank 1 fault"),
        ("rank-10", "rank 10"),
        ("rank-2", "two"),
    ]:
        (workdir / folder).mkdir(parents=True, exist_ok=True)
        (workdir / folder / LOG_FILE).write_text(text)
    (workdir / "rank-x").mkdir()  # not a rank's folder
    (workdir / "rank-3").mkdir()  # a rank that printed nothing yet
    logs = worker_module.attempt_logs(workdir, 2)
    assert [name for _, name in logs] == [
        "attempt-2.txt",
        "attempt-2-rank-1.txt",
        "attempt-2-rank-2.txt",
        "attempt-2-rank-10.txt",
    ]
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment("logs", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    assert all(worker_module.copy_log(tracking_uri, 7, run_id, path, name) for path, name in logs)
    copied = {Path(a.path).name for a in client.list_artifacts(run_id, "logs")}
    assert copied == {name for _, name in logs}
    assert Path(client.download_artifacts(run_id, "logs/attempt-2-rank-1.txt")).read_text() == "rank 1 fault"


class RefusingArtifacts:
    """A client whose server refuses the log's upload; `deleted`: because the run was deleted."""

    def __init__(self, deleted: bool) -> None:
        self.deleted = deleted

    def log_artifact(self, run_id: str, path: str, folder: str) -> None:
        raise RuntimeError("the server refused the upload")

    def get_run(self, run_id: str) -> Any:
        stage = "deleted" if self.deleted else "active"
        return SimpleNamespace(info=SimpleNamespace(lifecycle_stage=stage))


@pytest.mark.parametrize("deleted", [True, False])
def test_a_log_copy_refused_for_a_deleted_run_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, deleted: bool
) -> None:
    """A user deleted the job's run in MLflow's UI while it ran: a server that refuses the log's copy
    to it had put a traceback in the worker's log for what is no fault; any other refusal keeps it."""
    monkeypatch.setattr(worker_module, "mlflow_client", lambda uri: RefusingArtifacts(deleted))
    log_file = tmp_path / "log.txt"
    log_file.write_text("the job's log\n")
    with caplog.at_level("INFO", logger="optlab.worker"):
        assert not worker_module.copy_log("http://m.test", 7, "r-7", log_file, "attempt-1.txt")
    (said,) = [r for r in caplog.records if r.name == "optlab.worker"]
    if deleted:
        assert (
            said.getMessage() == "job 7: MLflow run r-7 was deleted: its log attempt-1.txt not copied there"
        )
        assert said.exc_info is None
    else:
        assert said.getMessage() == "job 7: could not copy its log to MLflow run r-7"
        assert said.exc_info is not None


def test_a_store_outage_is_logged_once_not_every_heartbeat(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """A 35 s outage wrote a 114-line traceback every 5 s (800 lines) where one said it all."""
    worker = make_worker(settings.model_copy(update={"heartbeat_s": 0.01}), sessions, "python")
    outcomes = [RuntimeError("connection refused")] * 4 + [None, RuntimeError("connection refused")]

    def look() -> None:
        outcome = outcomes.pop(0)
        if not outcomes:
            worker.stopping.set()
        if outcome is not None:
            raise outcome

    worker.close_runs_left_open = look  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="optlab.worker"):
        worker.close_runs_forever()
    said = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("ERROR", "worker test-worker: could not look for MLflow runs left open", True),
        ("INFO", "worker test-worker: can look for MLflow runs left open again", False),
        ("ERROR", "worker test-worker: could not look for MLflow runs left open", True),  # a new outage
    ]


def assert_told_stopped_until_continued(
    worker: Worker, sessions: sessionmaker[Session], job_id: int, jobs_dir: Path
) -> None:
    """Runs the job, whose stopped process wrote its pid to a `pid` file: its waiting reason must say
    it is stopped from outside; then it is continued (whatever was seen: a process left stopped would
    hold the worker's thread) and must succeed."""
    running = threading.Thread(target=worker.run_next)
    running.start()

    def waiting() -> str | None:
        with sessions() as session:
            job = store.get_job(session=session, job_id=job_id)
            return None if job is None else job.waiting

    try:
        _wait_for(lambda: waiting() == worker_module.STOPPED_FROM_OUTSIDE, timeout_s=20)
    finally:
        _wait_for(lambda: any(jobs_dir.rglob("pid")), timeout_s=10)
        os.kill(int(next(jobs_dir.rglob("pid")).read_text()), signal.SIGCONT)
        running.join(20)
    assert job_row(sessions, job_id).status == "succeeded"


def test_a_job_process_stopped_from_outside_says_so_until_it_is_continued(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """SIGSTOPped, it had read as running well (the same step, nothing waiting) as long as it stayed so."""
    body = (
        'echo \'{"step": 3, "total": 10}\' > "$W/progress.json"; echo $$ > "$W/pid"; kill -STOP $$; '
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}\' > "$W/result.json"'
    )
    worker = make_worker(settings.model_copy(update={"heartbeat_s": 0.2}), sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    assert_told_stopped_until_continued(worker, sessions, job_id, tmp_path / "jobs")


def test_is_stopped_reads_the_process_state() -> None:
    from jobs.processes import is_stopped

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_stopped(sleeper.pid)
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(sleeper.pid)
        os.kill(sleeper.pid, signal.SIGCONT)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not is_stopped(sleeper.pid)  # gone: nothing to read


def test_the_log_s_copy_for_mlflow_keeps_its_start_and_latest_output_past_the_limit(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_bytes(b"set-up\n" + b"x" * 5000 + b"\nthe traceback\n")
    assert job_log.excerpt(log, limit_bytes=10_000) == log.read_bytes()  # under the limit: whole
    cut = job_log.excerpt(log, limit_bytes=1000)
    assert cut.startswith(b"set-up\n") and cut.endswith(b"\nthe traceback\n")
    left_out = log.stat().st_size - 250 - 750
    assert f"\n[optlab: {left_out} bytes of the job's log left out here]\n".encode() in cut
    assert len(cut) < 1100
    assert job_log.excerpt(tmp_path / "gone.txt") == b""


def test_a_store_outage_is_told_in_a_line_without_a_traceback(
    settings: Settings, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """Each outage had written its 120-line SQLAlchemy traceback (ten in a probe's worker log): an
    outage is expected, its line says it; a traceback is for errors no one expects."""
    from sqlalchemy.exc import OperationalError

    worker = make_worker(settings.model_copy(update={"heartbeat_s": 0.01}), sessions, "python")
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    outcomes: list[Exception | None] = [down, down, None, down]

    def look() -> None:
        outcome = outcomes.pop(0)
        if not outcomes:
            worker.stopping.set()
        if outcome is not None:
            raise outcome

    worker.close_runs_left_open = look  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="optlab.worker"):
        worker.close_runs_forever()
    said = [(r.levelname, r.getMessage().split(":")[0], r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("WARNING", "worker test-worker", False),
        ("INFO", "worker test-worker", False),
        ("WARNING", "worker test-worker", False),
    ]
    assert "cannot look for MLflow runs left open: OperationalError" in caplog.records[0].getMessage()


def test_a_worker_whose_disk_is_full_claims_nothing_and_says_so_once(
    tmp_path: Path,
    settings: Settings,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk had failed every queued job within a second each ("No space left on device"),
    where another worker could have run them."""
    import shutil

    body = 'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}\' > "$W/result.json"'
    worker = make_worker(settings, sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    with caplog.at_level("INFO", logger="optlab.worker"):
        assert worker.run_next() is False and worker.run_next() is False
        assert job_row(sessions, job_id).status == "queued"  # left for this or another worker
        monkeypatch.setattr(shutil, "disk_usage", real)
        assert worker.run_next() is True
    assert job_row(sessions, job_id).status == "succeeded"
    said = [
        r.getMessage() for r in caplog.records if "space" in r.getMessage() or "bytes free" in r.getMessage()
    ]
    assert len(said) == 2, said  # once when full, once when it has space again
    assert "has 4096 bytes free: it claims no job until space is freed" in said[0]
    assert "has space again: it claims jobs again" in said[1]


def test_a_job_queued_while_the_only_live_workers_disk_is_full_says_so(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its `waiting_reason` had read null, as if it only waited its turn."""
    import shutil

    worker = make_worker(settings, sessions, stand_in(tmp_path, "true"))
    with sessions() as session:  # a live worker, as its start registers it
        store.register_worker(
            session=session,
            worker_id=worker.worker_id,
            frameworks=["torch"],
            devices=["cpu"],
            gpus=0,
            slots=1,
            catalogue_sha256="0" * 64,
        )
    job_id = submit(sessions)

    def reason() -> str | None:
        with sessions() as session:
            job = store.get_job(session=session, job_id=job_id)
            assert job is not None
            return store.waiting_reason(session=session, job=job, within_s=settings.lease_s)

    assert reason() is None  # it waits its turn
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    assert worker.run_next() is False
    worker._stay_registered()  # its heartbeat, at once after the disk filled
    said = reason()
    assert said is not None and said.startswith("no live worker that could run it claims jobs now")
    assert f"worker {worker.worker_id}: the file system of " in said and "is full (4096 bytes free)" in said
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert worker.claim() is not None  # space again: it claims, and says so with the heartbeat
    worker._stay_registered()
    with sessions() as session:
        (row,) = store.live_workers(session=session, within_s=settings.lease_s)
        assert row.not_claiming is None


def test_a_job_that_meets_a_full_disk_as_its_worker_starts_it_goes_back_to_the_queue(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    worker = make_worker(settings, sessions, stand_in(tmp_path, "true"))
    job_id = submit(sessions)

    def no_space(self: worker_module.Supervision) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(worker_module.Supervision, "run", no_space)
    assert worker.run_next() is True
    job = job_row(sessions, job_id)
    assert job.status == "queued", job.error  # not failed: another worker, or this one with space
    assert job.error is not None and "its worker's disk is full" in job.error["message"]


def test_a_ddp_jobs_other_ranks_logs_are_bounded_too(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Only rank 0's log was capped: a rank printing every step filled the disk under rank-N/."""
    body = (
        'mkdir -p "$W/rank-1"; '
        "for i in $(seq 1 40); do head -c 51200 /dev/zero | tr '\\0' x; echo \" line $i\"; sleep 0.05; "
        'done >> "$W/rank-1/log.txt"; exit 1'  # as jobs.distributed opens it: appended to
    )
    worker = make_worker(settings.model_copy(update={"job_log_mb": 0.25}), sessions, stand_in(tmp_path, body))
    job_id = submit(sessions)
    worker.run_next()
    log = (settings.jobs_dir / str(job_id) / "attempt-1" / "rank-1" / LOG_FILE).read_text()
    assert len(log) < 40 * 51200 // 2
    assert " line 1\n" in log and " line 40\n" in log
    assert log.count("[optlab: output cut here") == 1


def test_a_ddp_job_whose_other_rank_is_stopped_from_outside_says_so(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Only the top process (rank 0) was looked at: a rank SIGSTOPped read as a stall, whose stacks it
    could not write, and then as a collective's timeout."""
    body = (
        'echo \'{"step": 3, "total": 10}\' > "$W/progress.json"; '
        'sh -c \'echo $$ > "$1/pid"; kill -STOP $$\' rank "$W" & wait; '  # rank 1, stopped; rank 0 waits
        'echo \'{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}\' > "$W/result.json"'
    )
    fast = make_worker(settings.model_copy(update={"heartbeat_s": 0.2}), sessions, stand_in(tmp_path, body))
    worker = Worker(fast.settings, sessions, worker_id="test-worker", slots=2)  # a DDP job's two slots
    ddp = SPEC.model_copy(update={"batch_size": 64, "distribution": {"strategy": "ddp", "devices": 2}})
    with sessions() as session:
        job_id = store.create_job(session=session, spec=JobSpec.model_validate(ddp.model_dump())).id
    assert_told_stopped_until_continued(worker, sessions, job_id, tmp_path / "jobs")


FIRST_IMPORTS_AT_ONCE = """
import json, logging, sys, threading
from service import worker
from service.studies import runs
seen = []
class Seen(logging.Handler):
    def emit(self, record):
        seen.append(f"{record.getMessage()} {record.exc_info[1] if record.exc_info else ''}")
logging.getLogger("optlab.worker").addHandler(Seen())
go = threading.Barrier(2)
def ending_a_run():  # a job's thread ending the run an earlier attempt left open
    go.wait()
    worker.end_mlflow_run("http://127.0.0.1:9", 1, "r-1", "KILLED", force=False)
def finalizing():  # the study finalizer's thread
    go.wait()
    try:
        runs.mlflow_client("http://127.0.0.1:9")
    except Exception as exc:
        seen.append(f"mlflow_client: {type(exc).__name__}: {exc}")
threads = [threading.Thread(target=ending_a_run), threading.Thread(target=finalizing)]
[t.start() for t in threads]; [t.join() for t in threads]
import mlflow
runs.mlflow_client("http://127.0.0.1:9")
print(json.dumps({"seen": seen, "version": mlflow.version.VERSION}))
"""


def test_two_threads_first_importing_mlflow_at_once_leave_it_whole(tmp_path: Path) -> None:
    """A job's thread and the study finalizer imported MLflow for the first time at once: MLflow's
    circular imports met half done (ImportError), and the half-made module broke every later use in
    that worker. In a fresh process, with real threads, as the worker runs them."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # the closed port answers at once: no retries
    }
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS_AT_ONCE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["version"]
    broken = [line for line in outcome["seen"] if "partially initialized" in line or "ImportError" in line]
    assert not broken, broken
