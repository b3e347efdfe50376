"""`make test` keeps the tests of one `xdist_group` on one worker (they share a running service or a
set of job processes started once). A pytest and pytest-xdist pair that cannot do it (pytest 9.2 with
xdist 3.8) falls back to plain load balancing without a word, and every such module then starts its
expensive fixtures once per worker: this test runs a tiny grouped suite the way the Makefile does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("case", range(6))
def test_grouped(case):
    with open(os.environ["WORKERS_FILE"], "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""

UNGROUPED = """
import time

import pytest


@pytest.mark.parametrize("case", range(6))
def test_other(case):
    time.sleep(0.05)
"""


def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_other.py").write_text(UNGROUPED)
    workers = tmp_path / "workers.txt"
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        env={"WORKERS_FILE": str(workers), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    seen = workers.read_text().split()
    assert len(seen) == 6 and len(set(seen)) == 1, f"one group ran on {sorted(set(seen))}"
