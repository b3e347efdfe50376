"""The warm pool's bookkeeping and the warm process's protocol (service/warm_pool.py, jobs/warm.py).

Warm processes running real jobs, through a worker, are in test_durable_worker.py (a warm job
equals a cold one; limits, the reaper and dying with the worker hold for warm processes).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.processes import WarmOrder, style_environment, thread_environment, threads_of
from service.warm_pool import WarmPool, style_of_stored_spec
from service.worker import default_job_threads
from tests.conftest import ROOT
from tests.service.durable_helpers import warm_processes


@pytest.fixture
def stand_in_python(tmp_path: Path) -> str:
    """In place of the job interpreter: waits, as a warm process does, until its stdin closes."""
    path = tmp_path / "warm-python"
    path.write_text("#!/bin/sh\nwhile read -r line; do :; done\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def environment(slot: int) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": str(slot)}


def test_the_pool_never_holds_more_than_one_idle_process_per_slot(stand_in_python: str) -> None:
    pool = WarmPool(stand_in_python)
    try:
        for _ in range(3):  # the claim loop fills on every poll
            pool.fill([0, 1], environment, first_style="torch")
            assert sorted(pool.idle) == [0, 1] and len(warm_processes(os.getpid())) == 2
        # A job of the slot's style and environment takes its process; one of another style does
        # not (it starts cold) and the mismatched process is stopped, not kept beside a new one.
        taken = pool.take(0, "torch", environment(0))
        assert taken is not None and sorted(pool.idle) == [1]
        assert pool.take(1, "keras", environment(1)) is None and not pool.idle
        assert warm_processes(os.getpid()) == [taken.pid]  # the taken one runs its job (here: idles)
        pool.fill([0, 1], environment, first_style="torch")
        assert {slot: warm.style for slot, warm in pool.idle.items()} == {0: "torch", 1: "keras"}
        assert len(warm_processes(os.getpid())) == 3  # two idle, one busy with its job
        # A changed environment (another GPU, thread count, ...) is not the one it was started with.
        assert pool.take(0, "torch", {**environment(0), "OMP_NUM_THREADS": "3"}) is None
        assert taken.stdin is not None
        taken.stdin.close()  # the busy one "finishes"
        assert taken.wait(timeout=10) == 0
    finally:
        pool.close()
    assert not pool.idle and warm_processes(os.getpid()) == []
    pool.fill([0, 1], environment, first_style="torch")  # closed: nothing starts any more
    assert warm_processes(os.getpid()) == []


def test_variables_mlflow_sets_on_itself_leave_a_warm_process_usable(stand_in_python: str) -> None:
    """The worker's first MLflow import sets _MLFLOW_TELEMETRY_SESSION_ID in its environment: the
    first job after every worker start had run cold ("its environment changed")."""
    pool = WarmPool(stand_in_python)
    taken = None
    try:
        pool.fill([0], environment, first_style="torch")
        taken = pool.take(0, "torch", {**environment(0), "_MLFLOW_TELEMETRY_SESSION_ID": "5f3c"})
        assert taken is not None
    finally:
        pool.close()
        if taken is not None and taken.stdin is not None:
            taken.stdin.close()
            taken.wait(timeout=10)


def test_a_warm_process_exits_on_end_of_file_having_run_nothing(tmp_path: Path) -> None:
    """An idle warm process dies with its worker however it died: its stdin ends (the kernel closes
    the worker's end of the pipe), even without the SIGTERM it also gets."""
    # A style with nothing of its own to import (the common part only): the subject is the protocol.
    process = subprocess.Popen(
        [sys.executable, "-m", "jobs.warm", "no_framework"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output, _ = process.communicate(b"", timeout=120)  # end of file at once
    assert process.returncode == 0, output.decode()[-2000:]
    assert list(tmp_path.iterdir()) == []  # no job folder, no file: it ran nothing


def test_a_warm_order_round_trips_and_a_bad_one_names_what_is_expected() -> None:
    order = WarmOrder(argv=["spec.json", "--workdir", "/w", "--tag", "a=b c"], log="/w/log.txt")
    assert WarmOrder.from_line(order.to_line()) == order
    with pytest.raises(ValueError, match="a warm order is"):
        WarmOrder.from_line(b'{"argv": "spec.json"}\n')


@pytest.mark.parametrize(
    ("spec", "style"),
    [
        ({"framework": "torch", "optimizer": {"name": "adam"}}, "torch"),
        ({"framework": "tensorflow", "optimizer": {"name": "adam", "style": "keras"}}, "keras"),
        ({"framework": "tensorflow", "optimizer": {"name": "adam", "style": "tf_legacy"}}, "tf_legacy"),
        ({"framework": "tensorflow", "optimizer": {"name": "adam"}}, "keras"),  # stored before styles
        ({"kind": "check", "optimizer": {"name": "lion"}}, "torch"),
    ],
)
def test_the_style_a_slot_keeps_warm_comes_from_the_stored_spec(spec: dict[str, object], style: str) -> None:
    from jobs.frameworks import LEGACY_KERAS_STYLES

    assert style_of_stored_spec(spec) == style
    legacy = style_environment({}, style).get("TF_USE_LEGACY_KERAS") == "1"
    assert legacy == (style in LEGACY_KERAS_STYLES)


def test_jobs_share_the_cores_at_least_one_thread_each() -> None:
    cores = len(os.sched_getaffinity(0))
    assert default_job_threads(1) == cores
    assert default_job_threads(cores * 2) == 1
    assert threads_of(thread_environment(3)) == 3 and threads_of({}) is None
    assert set(thread_environment(2)) >= {"OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"}
    with pytest.raises(ValueError, match="at least 1 thread"):
        thread_environment(0)


@pytest.mark.parametrize(("style", "other"), [("torch", "tensorflow"), ("keras", "torch")])
def test_a_warm_process_imports_its_own_framework_only(style: str, other: str) -> None:
    """As a cold job does (tests/jobs/test_framework_isolation.py): a Keras job never loads torch."""
    probe = f"import json, sys, jobs.warm; jobs.warm.warm_up({style!r}); print(json.dumps(list(sys.modules)))"
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(json.loads(completed.stdout.strip().splitlines()[-1]))
    own = {"torch": "torch", "keras": "tensorflow"}[style]
    assert own in loaded and "jobs.frameworks" in loaded and other not in loaded
