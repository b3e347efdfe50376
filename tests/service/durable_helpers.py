"""Shared pieces of the durable-worker tests: a real MLflow server, throwaway PostgreSQL databases,
worker processes, a slow plugin optimizer, and reading MLflow back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from jobs.processes import start_in_own_group, terminate_group
from tests.conftest import ROOT, free_port
from tests.postgres import POSTGRES_ADMIN_URL, throwaway_database

# A plugin optimizer for real jobs that take their time: plain SGD (deterministic on CPU, so an
# interrupted and resumed job can be compared with an uninterrupted one) that sleeps in each step,
# and, asked to, ignores SIGTERM (a plugin that will not be stopped politely).
SLOW_PLUGIN = '''
import signal
import time

import torch


class SlowSgd(torch.optim.SGD):
    """SGD that sleeps `delay_s` in each step."""

    def __init__(self, params, lr=0.05, delay_s=0.05, ignore_sigterm=False):
        if ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        super().__init__(params, lr=lr)
        self.delay_s = delay_s

    def step(self, closure=None):
        time.sleep(self.delay_s)
        return super().step(closure)
'''

# A worker process as `optlab worker` runs it, minus producing the catalogue (a child that imports
# torch and TensorFlow: seconds per worker); it registers as a torch worker instead.
WORKER_PROGRAM = """
import logging, sys
from service.db import make_engine, migrate, session_factory
from service.settings import Settings
from service.worker import Worker, install_stop_handlers
from service import store
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
settings = Settings()
engine = make_engine(settings.resolved_database_url)
migrate(engine)
worker = Worker(settings, session_factory(engine), worker_id=sys.argv[1], slots=int(sys.argv[2]))
worker.frameworks = ("torch",)
with worker.sessions() as session:
    store.register_worker(session=session, worker_id=worker.worker_id, frameworks=["torch"],
                          devices=["cpu"], gpus=0, slots=len(worker.slots), catalogue_sha256="0" * 64)
install_stop_handlers(worker.stopping.set)
worker.run_forever()
"""


def slow_spec(experiment: str, **overrides: Any) -> dict[str, Any]:
    params = {"lr": 0.05, "delay_s": 0.05, **overrides.pop("params", {})}
    return {
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": "slow_sgd", "params": params},
        "steps": 200,
        "batch_size": 16,
        "checkpoint_every": 20,
        "eval_every": 100,
        "device": "cpu",
        "experiment": experiment,
        **overrides,
    }


def write_plugin(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slow_sgd.py").write_text(SLOW_PLUGIN)
    return folder


@contextmanager
def mlflow_server(data: Path) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{data / 'mlflow.db'}",
        "--artifacts-destination", str(data / "mlartifacts"),
        "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    with open(data / "mlflow.log", "ab") as log:
        process = start_in_own_group(
            command, die_with_parent=True, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{url}/health"), 120, "the MLflow server to answer")
        yield url
    finally:
        terminate_group(process, 10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def postgres_database(prefix: str = "optlab_durable") -> Iterator[tuple[str, str]]:
    """A throwaway database: (its SQLAlchemy URL, its name)."""
    with throwaway_database(prefix) as url:
        yield url, url.rsplit("/", 1)[1]


def set_connections(name: str, *, allowed: bool) -> None:
    """A store outage on demand: refuse new connections to `name` and end the open ones (or allow)."""
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}'))
        if not allowed:
            connection.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name"),
                {"name": name},
            )
    admin.dispose()


def start_worker(worker_id: str, slots: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        process: subprocess.Popen[bytes] = start_in_own_group(
            [sys.executable, "-c", WORKER_PROGRAM, worker_id, str(slots)],
            die_with_parent=True, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )  # fmt: skip
    return process


def job_process_pid(workdir: Path) -> int | None:
    """The pid of the job process running in `workdir`, found in /proc: the session leader whose
    output goes to the job's log (a cold `python -m jobs.run`, or a warm process that took the job:
    its command line does not name the job)."""
    log = str(workdir / "log.txt")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                leader = (entry / "stat").read_text().rsplit(")", 1)[1].split()[3] == entry.name
                if leader and os.readlink(entry / "fd" / "1") == log:
                    return int(entry.name)
            except OSError:
                continue
    return None


def warm_processes(parent: int) -> list[int]:
    """The pids of the idle or busy warm job processes (`python -m jobs.warm`) `parent` started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if (
                int(fields[1]) == parent
                and fields[0] != "Z"
                and b"jobs.warm" in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def group_alive(group: int) -> bool:
    """Whether any live (not zombie) process is in process group `group`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[2] == str(group) and fields[0] != "Z":
            return True
    return False
