"""Jobs that survive (issue 12), on real processes: a real MLflow server, real PostgreSQL, real job
processes (`python -m jobs.run` with a slow plugin optimizer), worker processes killed with -9.

Stand-in job programs (shell scripts, as in test_worker.py) only where the job's own behaviour is
not the point: the limits and the 60-job run, whose subject is the worker and the store.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.processes import thread_environment
from jobs.result import JobStatus, MlflowInfo, Progress, read_progress
from jobs.spec import JobSpec
from jobs.tracking import experiment_id_for
from service import store
from service.db import make_engine, migrate, session_factory
from service.models import Job
from service.settings import Settings
from service.worker import Worker
from tests.conftest import ROOT
from tests.service.durable_helpers import (
    group_alive,
    job_process_pid,
    mlflow_server,
    postgres_database,
    set_connections,
    slow_spec,
    start_worker,
    wait_until,
    warm_processes,
    write_plugin,
)

# One MLflow server for the module (`mlflow_url`): its tests on one pytest-xdist worker (ungrouped,
# they went to both, and each worker started a server of its own).
pytestmark = pytest.mark.xdist_group("durable_worker")


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plugin(tmp_path_factory.mktemp("plugins"))


def submit(sessions: sessionmaker[Session], spec: dict[str, Any]) -> int:
    with sessions() as session:
        return store.create_job(session=session, spec=JobSpec.model_validate(spec)).id


def row(sessions: sessionmaker[Session], job_id: int) -> Job:
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None
        return job


def ended(sessions: sessionmaker[Session], job_id: int) -> Job | None:
    job = row(sessions, job_id)
    return job if job.status.terminal else None


def runs_of(mlflow_url: str, experiment: str) -> list[Any]:
    client = MlflowClient(tracking_uri=mlflow_url)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id], max_results=100)


def in_process_worker(settings: Settings, sessions: sessionmaker[Session], **kwargs: Any) -> Worker:
    worker = Worker(settings, sessions, worker_id=kwargs.pop("worker_id", "in-process"), **kwargs)
    worker.frameworks = ("torch",)
    return worker


@pytest.fixture
def serve() -> Iterator[Callable[[Worker], None]]:
    """Runs a worker (`run_forever` in a thread); stopped and joined after the test."""
    workers: list[Worker] = []
    threads: list[threading.Thread] = []

    def start(worker: Worker) -> None:
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        workers.append(worker)
        threads.append(thread)

    yield start
    for worker in workers:
        worker.stopping.set()
    for thread in threads:
        thread.join(timeout=60)


def test_a_job_process_killed_from_outside_resumes_then_fails_its_run_and_a_stubborn_cancelled_one_is_killed(
    tmp_path: Path,
    mlflow_url: str,
    plugins: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Callable[[Worker], None],
) -> None:
    """A job process stopped from outside (SIGTERM, which it handles as a stop; SIGKILL, as the
    out-of-memory killer sends) is queued again and resumes from its checkpoint in its run,
    OPTLAB_JOB_RETRIES times (1 here); killed once more, it fails, saying so."""
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(plugins))
    settings = Settings(
        data_dir=tmp_path,
        mlflow_tracking_uri=mlflow_url,
        poll_interval_s=0.2,
        cancel_grace_s=2.0,
        job_retries=1,
    )
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    experiment = f"final-states-{tmp_path.name}"
    killed = submit(sessions, slow_spec(experiment, steps=5000))
    stubborn = submit(sessions, slow_spec(experiment, steps=5000, params={"ignore_sigterm": True}))
    serve(in_process_worker(settings, sessions, slots=2))
    workdirs = {
        job_id: settings.jobs_dir.resolve() / str(job_id) / "attempt-1" for job_id in (killed, stubborn)
    }
    for job_id in workdirs:  # both training, each in its MLflow run
        wait_until(
            lambda j=job_id: (row(sessions, j).step or 0) > 0 and row(sessions, j).mlflow, 120, "training"
        )

    wait_until(lambda: row(sessions, killed).checkpoint_step, 60, "a checkpoint")
    pid = job_process_pid(workdirs[killed])
    assert pid is not None
    os.kill(pid, signal.SIGTERM)  # it stops in order, as if cancelled: no one here asked it to
    with sessions() as session:
        store.request_cancel(session=session, job_id=stubborn)

    retried = wait_until(
        lambda: (job := row(sessions, killed)).attempt == 2 and job.status is JobStatus.RUNNING and job,
        60,
        "a retry",
    )
    assert retried.retries == 1 and retried.error is not None and retried.error["type"] == "Interrupted"
    assert "stopped by a SIGTERM it was sent from outside" in retried.error["message"]
    assert (
        "retry 1 of 1 (OPTLAB_JOB_RETRIES); it will run again from its checkpoint of step"
        in retried.error["message"]
    )
    second = settings.jobs_dir.resolve() / str(killed) / "attempt-2"
    # Its own progress (the job's row shows attempt 1's last step until attempt 2 passes it).
    wait_until(
        lambda: (read_progress(second) or Progress(step=0, total=1)).step > (retried.checkpoint_step or 0),
        120,
        "resume",
    )
    resumed = row(sessions, killed)
    assert retried.mlflow is not None and resumed.mlflow["run_id"] == retried.mlflow["run_id"]  # in its run
    pid = wait_until(lambda: job_process_pid(second), 30, "the second attempt's process")
    os.kill(pid, signal.SIGKILL)

    died = wait_until(lambda: ended(sessions, killed), 60, "the killed job to end")
    assert died.status is JobStatus.FAILED and died.error is not None and died.attempt == 2
    assert died.error["type"] == "JobProcessDied" and "SIGKILL" in died.error["message"]
    assert "it had been started again once after the same" in died.error["message"]
    cancelled = wait_until(lambda: ended(sessions, stubborn), 60, "the cancelled job to end")
    assert cancelled.status is JobStatus.CANCELLED
    client = MlflowClient(tracking_uri=mlflow_url)
    assert died.mlflow is not None and cancelled.mlflow is not None
    assert client.get_run(died.mlflow["run_id"]).info.status == "FAILED"
    assert client.get_run(cancelled.mlflow["run_id"]).info.status == "KILLED"
    # It was stubborn: the worker's SIGKILL after the grace, not the job, ended it.
    assert not (workdirs[stubborn] / "result.json").exists()


@pytest.mark.parametrize("stopped_itself", [False, True])
def test_an_attempt_that_starts_afresh_ends_the_run_its_predecessor_left_running(
    tmp_path: Path, mlflow_url: str, stopped_itself: bool
) -> None:
    """Attempt 1 died before any checkpoint (kill -9 of everything): attempt 2 trains in a run of its
    own, and attempt 1's had stayed RUNNING beside it for good. Or attempt 1 was stopped by a SIGTERM
    (its worker shutting down) and ended its run itself, tagged `cancelled` as a job stopped is, though
    the job went on: either way the run is tagged `interrupted`."""
    client = MlflowClient(tracking_uri=mlflow_url)
    experiment_id = experiment_id_for(client, f"afresh-{tmp_path.name}")
    orphan = client.create_run(experiment_id).info.run_id
    if stopped_itself:
        client.set_tag(orphan, "outcome", "cancelled")
        client.set_terminated(orphan, "KILLED")
    program, _ = stand_in(tmp_path)
    settings = Settings(
        data_dir=tmp_path,
        mlflow_tracking_uri=mlflow_url,
        poll_interval_s=0.1,
        warm_pool=False,
        job_python=program,
    )
    sessions = session_factory(engine := make_engine(settings.resolved_database_url))
    migrate(engine)
    job_id = submit(sessions, slow_spec("afresh", steps=5))
    info = MlflowInfo(tracking_uri=mlflow_url, experiment_id=experiment_id, run_id=orphan, run_url="-")
    with sessions() as session:  # attempt 1: its run started, then its worker died
        store.claim_next(session=session, worker_id="dead", lease_s=30)
        store.record_progress(
            session=session, job_id=job_id, worker_id="dead", attempt=1, workdir=None, lease_s=30,
            progress=Progress(step=0, total=5, mlflow=info),
        )  # fmt: skip
        store.requeue_job(session=session, job_id=job_id, worker_id="dead", attempt=1, reason="died")
    Worker(settings, sessions, worker_id="alive").run_next()
    assert row(sessions, job_id).status is JobStatus.SUCCEEDED

    def ended_interrupted() -> bool:
        run = client.get_run(orphan)
        return run.info.status == "KILLED" and run.data.tags.get("outcome") == "interrupted"

    wait_until(ended_interrupted, 30, "the orphan run to end, tagged interrupted")


STAND_IN = """#!/bin/sh
SPEC="$3"
while [ $# -gt 0 ] && [ "$1" != "--workdir" ]; do shift; done; W="$2"
echo "$W" >> "{executions}"
case "$(cat "$SPEC")" in
  *'"experiment": "sleeps"'*) exec sleep 300;;
  *'"experiment": "allocates"'*) exec {python} -c "x = b'x' * (400 * 2**20); import time; time.sleep(300)";;
esac
sleep {seconds}
echo '{{"step": 1, "total": 1}}' > "$W/progress.json"
R='{{"job_id": "1", "attempt": 1, "workdir": "/w",'
echo "$R"' "status": "succeeded", "steps_completed": 1}}' > "$W/result.json"
"""


def stand_in(folder: Path, seconds: float = 0.0) -> tuple[str, Path]:
    executions = folder / "executions.txt"
    path = folder / "stand-in-python"
    path.write_text(STAND_IN.format(executions=executions, python=sys.executable, seconds=seconds))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path), executions


def test_time_and_memory_limits_fail_the_job_with_the_limit_and_the_worker_serves_the_next(
    tmp_path: Path,
) -> None:
    job_python, _ = stand_in(tmp_path)
    settings = Settings(
        data_dir=tmp_path, job_python=job_python, poll_interval_s=0.1, cancel_grace_s=1.0, job_memory_mb=200
    )
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    base = {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 10}
    sleeps = submit(sessions, {**base, "experiment": "sleeps", "timeout_s": 1.5})
    allocates = submit(sessions, {**base, "experiment": "allocates"})
    fine = submit(sessions, base)
    worker = in_process_worker(settings, sessions)
    started = time.monotonic()
    for _ in range(3):
        assert worker.run_next()
    assert time.monotonic() - started < 60  # neither the sleeper nor the allocator ran on
    slow = row(sessions, sleeps)
    assert slow.status is JobStatus.FAILED and slow.error is not None
    assert slow.error["type"] == "TimeLimitExceeded" and "time limit of 1.5 s" in slow.error["message"]
    big = row(sessions, allocates)
    assert big.status is JobStatus.FAILED and big.error is not None
    assert big.error["type"] == "MemoryLimitExceeded" and "limit of 200 MiB" in big.error["message"]
    assert row(sessions, fine).status is JobStatus.SUCCEEDED


def test_a_store_outage_mid_job_ends_with_the_job_run_once_its_result_recorded(
    tmp_path: Path,
    mlflow_url: str,
    plugins: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Callable[[Worker], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(plugins))
    caplog.set_level(logging.INFO, logger="optlab.worker")
    with postgres_database() as (url, name):
        # The default lease and heartbeat (15 s, 5 s): the job is paused before its lease could
        # run out, and goes on when the store is back and says it is still this attempt's.
        settings = Settings(
            data_dir=tmp_path, database_url=url, mlflow_tracking_uri=mlflow_url, poll_interval_s=0.2
        )
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        experiment = f"outage-{tmp_path.name}"
        # 16 s of steps: it is still training when the worker pauses it (8-13 s into the outage).
        steps = {"steps": 160, "checkpoint_every": 80, "eval_every": 80}
        job_id = submit(sessions, slow_spec(experiment, **steps, params={"delay_s": 0.1}))
        serve(in_process_worker(settings, sessions))
        wait_until(lambda: row(sessions, job_id).step > 0, 120, "the job to train")
        set_connections(name, allowed=False)
        time.sleep(15)
        set_connections(name, allowed=True)
        job = wait_until(lambda: ended(sessions, job_id), 120, "the job to end")
        engine.dispose()
    assert job.status is JobStatus.SUCCEEDED and job.attempt == 1
    assert job.result is not None and job.result["steps_completed"] == 160
    messages = [r.getMessage() for r in caplog.records]
    assert any("store is unreachable" in m for m in messages)
    assert any("job paused" in m for m in messages) and any("job resumed" in m for m in messages)
    runs = runs_of(mlflow_url, experiment)
    assert [r.info.status for r in runs] == ["FINISHED"]


def takeover_environment(
    env: dict[str, str], url: str, tmp_path: Path, mlflow_url: str, **settings: str
) -> dict[str, str]:
    """Two worker processes' environment: one store, one data folder, one MLflow server."""
    return {
        **env,
        "OPTLAB_DATABASE_URL": url,
        "OPTLAB_DATA_DIR": str(tmp_path / "data"),
        "OPTLAB_MLFLOW_TRACKING_URI": mlflow_url,
        "OPTLAB_POLL_INTERVAL_S": "0.2",
        **settings,
    }


def test_a_worker_killed_with_sigkill_is_taken_over_and_the_job_resumes_in_its_run(
    tmp_path: Path, mlflow_url: str, plugins: Path
) -> None:
    experiment = f"takeover-{tmp_path.name}"
    spec = slow_spec(experiment, steps=60)
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "spec.json").write_text(json.dumps({**spec, "experiment": f"{experiment}-reference"}))
    env = {"OPTLAB_PLUGIN_DIRS": str(plugins), "PYTHONPATH": str(ROOT)}
    # The uninterrupted run, meanwhile, for the comparison.
    uninterrupted = subprocess.Popen(
        [sys.executable, "-m", "jobs.run", str(reference / "spec.json"), "--workdir", str(reference),
         "--tracking-uri", mlflow_url],
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    workers: dict[str, subprocess.Popen[bytes]] = {}
    with postgres_database() as (url, _):
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        job_id = submit(sessions, spec)
        worker_env = takeover_environment(env, url, tmp_path, mlflow_url)
        try:
            for name in ("first", "second"):
                workers[name] = start_worker(name, 1, worker_env, tmp_path / f"{name}.log")
            wait_until(
                lambda: (row(sessions, job_id).checkpoint_step or 0) >= 20, 180, "a verified checkpoint"
            )
            holder = row(sessions, job_id).worker_id
            assert holder in workers
            os.kill(workers[holder].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            taken = wait_until(
                lambda: (
                    (job := row(sessions, job_id)).attempt == 2 and job.status is JobStatus.RUNNING and job
                ),
                60,
                "another worker to take the job over",
                every_s=0.05,
            )
            takeover_s = time.monotonic() - killed_at
            print(f"takeover after kill -9 of the worker: {takeover_s:.1f} s")
            assert taken.worker_id != holder
            assert takeover_s < 20
            job = wait_until(lambda: ended(sessions, job_id), 180, "the resumed job to end")
        finally:
            for process in workers.values():
                process.kill()
                process.wait()
            engine.dispose()
    assert uninterrupted.wait(timeout=180) == 0
    assert job.status is JobStatus.SUCCEEDED, job.error
    expected = json.loads((reference / "result.json").read_text())
    assert job.result is not None and job.result["params_sha256"] == expected["params_sha256"]
    runs = runs_of(mlflow_url, experiment)
    assert len(runs) == 1 and job.mlflow is not None and runs[0].info.run_id == job.mlflow["run_id"]
    client = MlflowClient(tracking_uri=mlflow_url)
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    reference_steps = [m.step for m in client.get_metric_history(expected["mlflow"]["run_id"], "train/loss")]
    assert sorted(steps) == sorted(set(steps)) == sorted(reference_steps)  # every step exactly once


def test_three_workers_with_two_slots_run_sixty_jobs_each_exactly_once(tmp_path: Path) -> None:
    job_python, executions = stand_in(tmp_path, seconds=0.1)
    with postgres_database() as (url, _):
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        base = {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 1}
        jobs = [submit(sessions, {**base, "seed": seed}) for seed in range(60)]
        env = {
            "OPTLAB_DATABASE_URL": url,
            "OPTLAB_DATA_DIR": str(tmp_path / "data"),
            "OPTLAB_JOB_PYTHON": job_python,
            "OPTLAB_POLL_INTERVAL_S": "0.1",
            "OPTLAB_WARM_POOL": "false",  # a shell stand-in cannot wait warm for a job
        }
        workers = [start_worker(f"w{i}", 2, env, tmp_path / f"w{i}.log") for i in range(3)]
        started = time.monotonic()
        try:
            wait_until(lambda: all(ended(sessions, j) for j in jobs), 120, "60 jobs to end", every_s=0.5)
            print(f"60 stand-in jobs, 3 workers x 2 slots: {time.monotonic() - started:.1f} s")
            rows = [row(sessions, j) for j in jobs]
        finally:
            for process in workers:
                process.send_signal(signal.SIGTERM)
            for process in workers:
                process.wait(timeout=60)
            engine.dispose()
    assert [r.status for r in rows] == [JobStatus.SUCCEEDED] * 60
    assert [r.attempt for r in rows] == [1] * 60
    ran = executions.read_text().split()
    folders = [str((tmp_path / "data" / "jobs" / str(j) / "attempt-1").resolve()) for j in jobs]
    assert sorted(ran) == sorted(folders)  # each job's process ran exactly once
    assert len({r.worker_id for r in rows}) == 3  # all three took part


def test_a_job_that_ignores_sigterm_does_not_outlive_its_killed_worker(tmp_path: Path) -> None:
    program = tmp_path / "stubborn-python"
    program.write_text(
        '#!/bin/sh\ntrap "" TERM\necho $$ > "%s"\nwhile :; do sleep 0.2; done\n' % (tmp_path / "pid")
    )
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    env = {
        "OPTLAB_DATA_DIR": str(tmp_path),
        "OPTLAB_JOB_PYTHON": str(program),
        "OPTLAB_POLL_INTERVAL_S": "0.1",
        "OPTLAB_CANCEL_GRACE_S": "2",
        "OPTLAB_WARM_POOL": "false",  # a shell stand-in cannot wait warm: see the warm twin below
    }
    engine = make_engine(f"sqlite:///{tmp_path / 'optlab.db'}")
    migrate(engine)
    submit(
        session_factory(engine),
        {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 1},
    )
    worker = start_worker("doomed", 1, env, tmp_path / "worker.log")
    try:
        job_group = int(
            wait_until(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), 60, "the job")
        )
        # The reaper starts just after the job (a real job gets its SIGTERM before it could load a
        # plugin that ignores it, were the worker killed in between; this stand-in ignores it at once).
        wait_until(lambda: reaper_of(job_group), 30, "the job's reaper")
        worker.kill()
        killed_at = time.monotonic()
        wait_until(lambda: not group_alive(job_group), 30, "the job's process group to end")
        # SIGTERM (ignored) on the worker's death, SIGKILL after the grace: gone well within a lease.
        assert time.monotonic() - killed_at < 10
    finally:
        worker.kill()
        worker.wait()
        engine.dispose()


def reaper_of(job_group: int) -> bool:
    """Whether the job's reaper is ready: started, and its shell has installed the SIGTERM trap (until
    then a SIGTERM ends it as any other process; a real job gets its own SIGTERM in that window and
    ends too, but this stand-in ignores it from its first line)."""
    needle = f"optlab-reaper\0{job_group}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                return _catches(entry, signal.SIGTERM)
        except OSError:
            continue
    return False


def _catches(process: Path, signum: int) -> bool:
    """Whether the process has a handler for `signum` (its SigCgt mask in /proc/PID/status)."""
    for line in (process / "status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


# -- the warm pool: real jobs in pre-started processes --------------------------------------------


def wait_for_warm_process(parent: int) -> int:
    found = wait_until(lambda: warm_processes(parent), 60, "a warm process")
    return int(found[0])


def waits_for_its_order(pid: int) -> bool:
    """Whether warm process `pid` has warmed up: blocked in read(2) of its stdin (fd 0), where
    jobs.warm waits for its order (/proc/PID/syscall: the call's number, then its arguments)."""
    try:
        number, fd = Path(f"/proc/{pid}/syscall").read_text().split()[:2]
    except ValueError:  # running ("running" alone)
        return False
    except OSError:  # gone; or a kernel that keeps syscall from us (gVisor): then its age alone says
        return Path(f"/proc/{pid}").exists()
    return fd == "0x0" and number == READ_SYSCALL.get(platform.machine(), "0")


READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}


def process_age_s(pid: int) -> float:
    """Seconds since process `pid` started (its start time in /proc, in clock ticks since boot)."""
    started_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")


def test_a_warm_job_runs_as_a_cold_one_and_gets_the_worker_s_thread_count(
    tmp_path: Path,
    mlflow_url: str,
    plugins: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Callable[[Worker], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same spec in a worker's warm process and through `python -m jobs.run`: the same result,
    files and MLflow run; the worker's thread count in the result and the run. Then a warm job's
    time limit counts from its claim, not from when its process started."""
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(plugins))
    caplog.set_level(logging.INFO, logger="optlab.worker")
    experiment = f"warm-{tmp_path.name}"
    spec = slow_spec(experiment, steps=40, checkpoint_every=20, eval_every=20, params={"delay_s": 0.0})
    reference = tmp_path / "cold"
    reference.mkdir()
    (reference / "spec.json").write_text(json.dumps({**spec, "experiment": f"{experiment}-cold"}))
    with open(reference / "log.txt", "wb") as log:  # as the worker writes a job's log
        cold = subprocess.run(
            [sys.executable, "-m", "jobs.run", str(reference / "spec.json"), "--workdir", str(reference),
             "--tracking-uri", mlflow_url],
            # The worker's thread count: on CPU it decides how a matmul is split, so the last bits too.
            env={**os.environ, **thread_environment(1), "PYTHONPATH": str(ROOT)},
            stdout=log, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    assert cold.returncode == 0, (reference / "log.txt").read_text()[-2000:]
    settings = Settings(
        data_dir=tmp_path / "data", mlflow_tracking_uri=mlflow_url, poll_interval_s=0.2, job_threads=1
    )
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    serve(in_process_worker(settings, sessions))
    first = wait_for_warm_process(os.getpid())
    job_id = submit(sessions, spec)
    job = wait_until(lambda: ended(sessions, job_id), 120, "the warm job to end")
    assert any(
        f"job {job_id}: runs in a warm process (pid {first})" in r.getMessage() for r in caplog.records
    )

    expected = json.loads((reference / "result.json").read_text())
    assert job.status is JobStatus.SUCCEEDED and job.result is not None, job.error
    same = ("status", "steps_completed", "params_sha256", "final", "checkpoints_verified", "device")
    assert {k: job.result[k] for k in same} == {k: expected[k] for k in same}
    assert job.result["threads"] == expected["threads"] == 1
    workdir = settings.jobs_dir.resolve() / str(job_id) / "attempt-1"
    assert sorted(p.name for p in workdir.iterdir()) == sorted(p.name for p in reference.iterdir())
    client = MlflowClient(tracking_uri=mlflow_url)
    warm_run, cold_run = (client.get_run(r["mlflow"]["run_id"]) for r in (job.result, expected))
    assert warm_run.info.status == cold_run.info.status == "FINISHED"
    assert warm_run.data.metrics.keys() == cold_run.data.metrics.keys()
    assert warm_run.data.tags["threads"] == cold_run.data.tags["threads"] == "1"
    assert (workdir / "log.txt").stat().st_size > 0  # its output went to the job's log

    # The next job's process was started while this one ran, long before its claim: a time limit
    # counted from the process's start would stop it before its first step. Waited for until it is
    # 6 s old and has warmed up (a fixed 6 s had let a process still importing torch on a loaded
    # machine take the job, which then made no step within its 5 s).
    replacement = wait_for_warm_process(os.getpid())
    wait_until(
        lambda: process_age_s(replacement) >= 6 and waits_for_its_order(replacement),
        120,
        "the next warm process, 6 s old, to wait for its job",
    )
    limited = submit(sessions, slow_spec(experiment, steps=5000, timeout_s=5))
    job = wait_until(lambda: ended(sessions, limited), 60, "the time-limited job to end")
    assert any(f"runs in a warm process (pid {replacement})" in r.getMessage() for r in caplog.records)
    assert job.status is JobStatus.FAILED and job.error is not None
    assert job.error["type"] == "TimeLimitExceeded" and "time limit of 5 s" in job.error["message"]
    progress = json.loads((settings.jobs_dir / str(limited) / "attempt-1" / "progress.json").read_text())
    assert progress["step"] > 0  # it trained: its 5 s began at the claim
    engine.dispose()


def test_a_warm_job_over_the_memory_limit_is_killed(
    tmp_path: Path, mlflow_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The limit counts the job's session: the warm process and whatever it starts."""
    caplog.set_level(logging.INFO, logger="optlab.worker")
    settings = Settings(
        data_dir=tmp_path, mlflow_tracking_uri=mlflow_url, poll_interval_s=0.1, job_memory_mb=100
    )
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    job_id = submit(sessions, {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 10})
    worker = in_process_worker(settings, sessions)
    worker.fill_pool()
    assert worker.pool is not None
    try:
        wait_for_warm_process(os.getpid())
        assert worker.run_next()
    finally:
        worker.pool.close()
    assert any(f"job {job_id}: runs in a warm process" in r.getMessage() for r in caplog.records)
    job = row(sessions, job_id)
    assert job.status is JobStatus.FAILED and job.error is not None
    assert job.error["type"] == "MemoryLimitExceeded" and "limit of 100 MiB" in job.error["message"]
    assert warm_processes(os.getpid()) == []
    engine.dispose()


def test_a_warm_job_that_ignores_sigterm_and_an_idle_warm_process_die_with_their_killed_worker(
    tmp_path: Path, mlflow_url: str, plugins: Path
) -> None:
    env = {
        "OPTLAB_DATA_DIR": str(tmp_path),
        "OPTLAB_MLFLOW_TRACKING_URI": mlflow_url,
        "OPTLAB_PLUGIN_DIRS": str(plugins),
        "OPTLAB_POLL_INTERVAL_S": "0.1",
        "OPTLAB_CANCEL_GRACE_S": "2",
    }
    engine = make_engine(f"sqlite:///{tmp_path / 'optlab.db'}")
    migrate(engine)
    sessions = session_factory(engine)
    worker = start_worker("doomed", 1, env, tmp_path / "worker.log")
    try:
        wait_for_warm_process(worker.pid)
        job_id = submit(
            sessions, slow_spec(f"doomed-{tmp_path.name}", steps=5000, params={"ignore_sigterm": True})
        )
        # Training: the plugin that ignores SIGTERM is loaded; the reaper watches the job's session.
        wait_until(lambda: row(sessions, job_id).step > 0, 120, "the job to train")
        job_group = job_process_pid(tmp_path / "jobs" / str(job_id) / "attempt-1")
        assert job_group is not None
        wait_until(lambda: reaper_of(job_group), 30, "the job's reaper")
        idle = wait_until(lambda: [p for p in warm_processes(worker.pid) if p != job_group], 60, "a new one")
        worker.kill()
        killed_at = time.monotonic()
        wait_until(lambda: not group_alive(job_group), 30, "the job's process group to end")
        wait_until(lambda: not group_alive(idle[0]), 30, "the idle warm process to end")
        assert time.monotonic() - killed_at < 10
    finally:
        worker.kill()
        worker.wait()
        engine.dispose()


def test_a_job_whose_progress_stops_moving_says_so_and_its_stacks_go_to_its_log(
    tmp_path: Path,
    mlflow_url: str,
    plugins: Path,
    monkeypatch: pytest.MonkeyPatch,
    serve: Callable[[Worker], None],
) -> None:
    """A step that does not return had read as running until the job's time limit (a day by default).
    The real job process (`python -m jobs.run`) writes its threads' stacks when the worker asks."""
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(plugins))
    settings = Settings(
        data_dir=tmp_path / "data", mlflow_tracking_uri=mlflow_url, poll_interval_s=0.2, warm_pool=False,
        stall_notice_s=3, job_threads=1,
    )  # fmt: skip
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    serve(in_process_worker(settings, sessions))
    job_id = submit(sessions, slow_spec(f"stall-{tmp_path.name}", steps=3, params={"delay_s": 600}))
    notice = wait_until(lambda: row(sessions, job_id).waiting, 90, "the stall notice")
    log = settings.jobs_dir.resolve() / str(job_id) / "attempt-1" / "log.txt"
    assert notice.startswith(("it has reported no progress for", "its progress has not moved for"))
    assert f"the stacks of its threads went to its log ({log}) at" in notice
    # The user's step, where it waits, in the stack the job process wrote (a line of slow_sgd.py).
    wait_until(lambda: "slow_sgd.py" in log.read_text(), 30, "the job's stacks in its log")
    stacks = log.read_text().split("[optlab worker, ", 1)[1]
    assert re.search(r'File ".*slow_sgd\.py", line \d+ in step', stacks), stacks[-3000:]
    assert row(sessions, job_id).status is JobStatus.RUNNING  # a notice: the job goes on
    # The log, with the stacks, copied to the job's run: readable without the worker's disk.
    wait_until(
        lambda: "(copied to logs/attempt-1.txt in its MLflow run)" in (row(sessions, job_id).waiting or ""),
        60,
        "the notice to say the log was copied to MLflow",
    )
    run_id = row(sessions, job_id).mlflow["run_id"]  # type: ignore[index]
    client = MlflowClient(tracking_uri=mlflow_url)

    def copied() -> bool:  # a copy made while the job was still starting holds no step yet
        text = Path(client.download_artifacts(run_id, "logs/attempt-1.txt")).read_text()
        return bool(re.search(r'File ".*slow_sgd\.py", line \d+ in step', text))

    wait_until(copied, 60, "the stacks of the user's step in the log's copy")
    with sessions() as session:
        store.request_cancel(session=session, job_id=job_id)
    job = wait_until(lambda: ended(sessions, job_id), 60, "the cancelled job to end")
    assert job.status is JobStatus.CANCELLED
    engine.dispose()


def test_a_job_freezes_itself_when_its_worker_is_stopped_so_the_attempt_that_takes_over_trains_alone(
    tmp_path: Path, mlflow_url: str, plugins: Path
) -> None:
    """A worker SIGSTOPped (not killed) renews no lease: another worker took the job over, while the
    stopped worker's job process, which no one stopped, trained on beside it into the same MLflow
    run (it ended the run FINISHED under the new attempt; 600 steps logged twice in a probe)."""
    from jobs.processes import is_stopped
    from jobs.result import FROZEN_FILE

    experiment = f"frozen-{tmp_path.name}"
    spec = slow_spec(experiment, steps=300)
    env = {"OPTLAB_PLUGIN_DIRS": str(plugins), "PYTHONPATH": str(ROOT)}
    workers: dict[str, subprocess.Popen[bytes]] = {}
    with postgres_database() as (url, _):
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        job_id = submit(sessions, spec)
        worker_env = takeover_environment(
            env, url, tmp_path, mlflow_url,
            OPTLAB_LEASE_S="6",  # a job freezes after 4 s of its worker's silence
            OPTLAB_HEARTBEAT_S="1",
            OPTLAB_WARM_POOL="false",
        )  # fmt: skip
        try:
            for name in ("first", "second"):
                workers[name] = start_worker(name, 1, worker_env, tmp_path / f"{name}.log")
            wait_until(
                lambda: (row(sessions, job_id).checkpoint_step or 0) >= 20, 180, "a verified checkpoint"
            )
            holder = row(sessions, job_id).worker_id
            assert holder in workers
            first_workdir = tmp_path / "data" / "jobs" / str(job_id) / "attempt-1"
            first_process = job_process_pid(first_workdir)
            assert first_process is not None
            os.kill(workers[holder].pid, signal.SIGSTOP)
            wait_until(lambda: is_stopped(first_process), 30, "the job to freeze itself")
            assert (first_workdir / FROZEN_FILE).exists()
            wait_until(
                lambda: (
                    row(sessions, job_id).attempt == 2 and row(sessions, job_id).status is JobStatus.RUNNING
                ),
                60,
                "another worker to take the job over",
            )
            time.sleep(2)
            assert is_stopped(first_process)  # still frozen while the new attempt trains
            os.kill(workers[holder].pid, signal.SIGCONT)  # its worker answers again: the lease is lost
            wait_until(lambda: not group_alive(first_process), 60, "the frozen attempt to be killed")
            job = wait_until(lambda: ended(sessions, job_id), 240, "the resumed job to end")
        finally:
            for process in workers.values():
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()
            engine.dispose()
    assert job.status is JobStatus.SUCCEEDED and job.attempt == 2, job.error
    assert job.mlflow is not None
    history = MlflowClient(tracking_uri=mlflow_url).get_metric_history(job.mlflow["run_id"], "train/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(300))  # every step exactly once: the frozen attempt logged no more
    assert "lost its lease" in (tmp_path / f"{holder}.log").read_text()
