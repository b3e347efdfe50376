"""Shared fixtures: the repository root, a published catalogue, PostgreSQL databases."""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import throwaway_database

ROOT = Path(__file__).resolve().parents[1]

# The modules whose single tests take longest (tens of seconds each on the 2-core machine: the
# `--durations` of a full run), longest first. `make test` hands pytest-xdist's workers the
# `xdist_group`s first (the most tests first), then every other test in collection order: these
# go to the front of that queue, so that the run ends on short tests, not with one worker idle
# while the other runs a minute-long test that started last. Each module keeps its tests' order.
RUN_FIRST = (
    "tests/service/test_plugin_reload.py",
    "tests/service/test_fuzz.py",
    "tests/e2e/test_cli.py",
    "tests/deploy/test_gpu_smoke.py",
    "tests/test_suite_grouping.py",
    "tests/service/test_warm_pool.py",
    "tests/service/test_migrations.py",
    "tests/service/test_worker.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {module: rank for rank, module in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(RUN_FIRST)))  # stable


@pytest.fixture(scope="session")
def catalogue_data(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict[str, Any]:
    """The catalogue exactly as a worker publishes it: from `python -m jobs.catalogue`.

    Produced once per test run (seconds of CPU: it imports torch and TensorFlow twice) and shared
    by the xdist workers through a file in the run's temporary folder, under a lock."""
    run_folder = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # each xdist worker has a folder of its own in the run's
        run_folder = run_folder.parent
    path = run_folder / "catalogue.json"
    with open(run_folder / "catalogue.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            completed = subprocess.run(
                [sys.executable, "-m", "jobs.catalogue"], cwd=ROOT, capture_output=True, text=True, check=True
            )
            path.write_text(completed.stdout)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, throwaway PostgreSQL database for this test session."""
    with throwaway_database() as url:
        yield url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
