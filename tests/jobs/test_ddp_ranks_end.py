"""How a DDP job ends once its other ranks have: a rank killed from outside (out of memory) is told
apart from one that failed, so the worker can start the job again (tests/service/test_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jobs.distributed import RANK_ENV, STORE_ENV, WORLD_ENV, RankProblem, Ranks, start_ranks
from jobs.processes import is_stopped
from jobs.report import Reporter
from jobs.result import RANK_KILLED, ErrorRecord, JobResult, JobStatus
from jobs.run import with_ranks_end
from jobs.spec import JobSpec


def _rank(tmp_path: Path, rank: int) -> tuple[int, Path, subprocess.Popen[bytes]]:
    workdir = tmp_path / f"rank-{rank}"
    workdir.mkdir()
    return rank, workdir, subprocess.Popen(["sleep", "60"])


def test_a_rank_killed_before_rank_0_stopped_the_others_is_named_as_killed_from_outside(
    tmp_path: Path,
) -> None:
    killed, blocked = _rank(tmp_path, 1), _rank(tmp_path, 2)
    killed[2].send_signal(signal.SIGKILL)  # the out-of-memory killer
    while killed[2].poll() is None:
        time.sleep(0.01)
    problem = Ranks([blocked, killed]).finish(stop=True)  # rank 2, stopped here, is no one's kill
    assert problem == RankProblem(
        "DDP rank 1 of 3 was killed by signal SIGKILL (out of memory, or from outside)",
        killed_from_outside=True,
    )
    assert blocked[2].returncode == -signal.SIGTERM


def test_a_rank_killed_while_rank_0_waits_for_it_is_named_as_killed_from_outside(tmp_path: Path) -> None:
    workdir = tmp_path / "rank-1"
    workdir.mkdir()
    dying = subprocess.Popen(["sh", "-c", "sleep 0.3; kill -KILL $$"])  # killed as rank 0 waits
    problem = Ranks([(1, workdir, dying)]).finish(stop=False)
    assert problem is not None and problem.killed_from_outside, problem


def test_ranks_stopped_by_rank_0_are_a_failure_not_a_kill(tmp_path: Path) -> None:
    problem = Ranks([_rank(tmp_path, 1)]).finish(stop=True)
    assert problem == RankProblem("DDP rank 1 of 2 did not succeed: no result written")


RESULT = JobResult(job_id="1", attempt=1, workdir="/w", status=JobStatus.SUCCEEDED)  # rank 0 sets it after
KILLED = RankProblem("DDP rank 1 of 2 was killed by signal SIGKILL (out of memory, or from outside)", True)


def test_a_killed_rank_fails_the_job_as_rank_killed_with_what_rank_0_met_then() -> None:
    peer_gone = RESULT.with_fields(
        error=ErrorRecord(type="RuntimeError", message="Connection closed by peer")
    )
    status, result = with_ranks_end(KILLED, JobStatus.FAILED, peer_gone)
    assert status is JobStatus.FAILED and result.error is not None and result.error.type == RANK_KILLED
    assert result.error.message == f"{KILLED.message}; rank 0 then: Connection closed by peer"


def test_a_cancel_stays_a_cancel_and_a_failed_rank_fails_a_job_that_succeeded() -> None:
    assert with_ranks_end(KILLED, JobStatus.CANCELLED, RESULT) == (JobStatus.CANCELLED, RESULT)
    status, result = with_ranks_end(
        RankProblem("DDP rank 1 of 2 did not succeed: x"), JobStatus.SUCCEEDED, RESULT
    )
    assert status is JobStatus.FAILED and result.error == ErrorRecord(
        type="RankFailed", message="DDP rank 1 of 2 did not succeed: x"
    )
    assert with_ranks_end(None, JobStatus.SUCCEEDED, RESULT) == (JobStatus.SUCCEEDED, RESULT)


# What rank 0 meets when another rank's process ends mid-collective (torch 2.13, gloo on CPU).
PEER_CLOSED = ErrorRecord(
    type="RuntimeError",
    message="[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:27788. This is typically caused by a remote worker crashing.",
    traceback="RuntimeError: [...] Connection closed by peer",
)
RANK_FAULT = ErrorRecord(
    type="ValueError",
    message="RANK-LOCAL FAULT: scratch file /data/rank1 unreadable",
    traceback='  File "plugin.py", line 22, in step\nValueError: RANK-LOCAL FAULT: scratch file ...',
)


def _ended(tmp_path: Path, rank: int, result: JobResult | None) -> tuple[int, Path, subprocess.Popen[bytes]]:
    """A rank whose process already ended, having written `result` (None: nothing)."""
    workdir = tmp_path / f"rank-{rank}"
    workdir.mkdir(parents=True)
    if result is not None:
        Reporter(workdir).result(result)
    process = subprocess.Popen(["sh", "-c", "exit 1"])
    process.wait()
    return rank, workdir, process


def _failed(error: ErrorRecord) -> JobResult:
    return RESULT.with_fields(status=JobStatus.FAILED, error=error)


def test_a_ranks_own_fault_is_the_jobs_error_where_rank_0_met_only_the_broken_collective() -> None:
    problem = RankProblem(f"DDP rank 1 of 2 did not succeed: {RANK_FAULT.message}", error=RANK_FAULT)
    status, result = with_ranks_end(problem, JobStatus.FAILED, _failed(PEER_CLOSED))
    assert status is JobStatus.FAILED and result.error is not None
    assert result.error.type == "ValueError" and result.error.traceback == RANK_FAULT.traceback
    assert result.error.message == f"{problem.message}; rank 0 then: {PEER_CLOSED.message}"


def test_rank_0s_own_fault_stays_the_jobs_error_beside_a_rank_that_met_the_broken_collective() -> None:
    own = ErrorRecord(type="KeyError", message="'momentum_buffer'", traceback="KeyError: 'momentum_buffer'")
    problem = RankProblem(f"DDP rank 1 of 2 did not succeed: {PEER_CLOSED.message}", error=PEER_CLOSED)
    assert with_ranks_end(problem, JobStatus.FAILED, _failed(own)) == (JobStatus.FAILED, _failed(own))
    # Both faulted on their own: rank 0's is the job's, as before.
    faulted = RankProblem(f"DDP rank 1 of 2 did not succeed: {RANK_FAULT.message}", error=RANK_FAULT)
    assert with_ranks_end(faulted, JobStatus.FAILED, _failed(own)) == (JobStatus.FAILED, _failed(own))


def test_the_rank_at_fault_is_named_before_a_rank_that_met_the_collective_it_broke(tmp_path: Path) -> None:
    broken, faulted = _ended(tmp_path, 1, _failed(PEER_CLOSED)), _ended(tmp_path, 2, _failed(RANK_FAULT))
    problem = Ranks([broken, faulted]).finish(stop=True)
    assert problem == RankProblem(f"DDP rank 2 of 3 did not succeed: {RANK_FAULT.message}", error=RANK_FAULT)


def test_a_rank_stopped_by_sigterm_from_outside_is_a_kill_the_worker_retries(tmp_path: Path) -> None:
    # A rank handles SIGTERM (jobs.run): a cancelled result and exit code 1, not -15.
    cancelled = RESULT.with_fields(
        status=JobStatus.CANCELLED, error=ErrorRecord(type="Cancelled", message="x")
    )
    for stop in (True, False):  # rank 0 failed at the broken collective, or finished its steps
        problem = Ranks([_ended(tmp_path / str(stop), 1, cancelled)]).finish(stop=stop)
        assert problem is not None and problem.killed_from_outside, problem
        assert problem.message.startswith("DDP rank 1 of 2 was stopped by a SIGTERM it was sent from outside")
    status, result = with_ranks_end(problem, JobStatus.FAILED, _failed(PEER_CLOSED))
    assert status is JobStatus.FAILED and result.error is not None and result.error.type == RANK_KILLED


def test_a_rank_that_rank_0_stopped_itself_is_no_kill_from_outside(tmp_path: Path) -> None:
    workdir = tmp_path / "rank-1"
    workdir.mkdir()
    cancelled = RESULT.with_fields(
        status=JobStatus.CANCELLED, error=ErrorRecord(type="Cancelled", message="x")
    )
    (tmp_path / "cancelled.json").write_text(json.dumps(cancelled.to_json()))
    # As jobs.run does: on SIGTERM, a cancelled result, then exit code 1.
    script = (
        f"trap 'cp {tmp_path / 'cancelled.json'} {workdir / 'result.json'}; exit 1' TERM; sleep 60 & wait"
    )
    process = subprocess.Popen(["sh", "-c", script])
    time.sleep(0.3)  # the trap set
    problem = Ranks([(1, workdir, process)]).finish(stop=True)
    assert problem == RankProblem("DDP rank 1 of 2 was stopped by rank 0, which had failed")


def _succeeded(sha: str) -> JobResult:
    return RESULT.with_fields(params_sha256=sha)


def test_ranks_that_end_with_other_weights_than_rank_0_are_a_warning(tmp_path: Path) -> None:
    ranks = Ranks([_ended(tmp_path, 1, _succeeded("aa")), _ended(tmp_path, 2, _succeeded("bb"))])
    assert ranks.finish(stop=False) is None
    warning = ranks.drifted("aa")
    assert warning is not None and warning.startswith("DDP rank 2 of 3 ended with other weights than rank 0")
    assert "`distributed` check" in warning
    assert str(ranks.drifted("bb")).startswith("DDP rank 1 of 3 ended")
    assert str(ranks.drifted("cc")).startswith("DDP ranks 1, 2 of 3 ended")
    same = Ranks([_ended(tmp_path / "same", 1, _succeeded("aa"))])
    assert same.finish(stop=False) is None and same.drifted("aa") is None


def test_a_ranks_log_is_appended_to_so_the_worker_can_cut_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened for writing at its own offset, a rank's log cut by the worker (service/job_log.cap) grew
    back to its old size at once, the cut filled with zeros."""
    for name in (RANK_ENV, WORLD_ENV, STORE_ENV):  # start_ranks sets them for rank 0: put back after
        monkeypatch.setenv(name, "")
    spec = JobSpec.model_validate(
        {**JobSpec.model_json_schema()["examples"][0], "distribution": {"strategy": "ddp", "devices": 2}}
    )
    ranks = start_ranks(spec, [str(tmp_path / "absent.json")], tmp_path, None)
    ((_, _, process),) = ranks.processes
    try:
        flags = int((Path(f"/proc/{process.pid}/fdinfo/1").read_text().split("flags:")[1]).split()[0], 8)
    finally:
        process.kill()
        process.wait()
    assert flags & os.O_APPEND


def test_a_rank_stopped_by_sigstop_is_named_as_the_rank_the_collective_timed_out_on(tmp_path: Path) -> None:
    stopped = _rank(tmp_path, 1)
    stopped[2].send_signal(signal.SIGSTOP)  # an operator, a debugger
    while not is_stopped(stopped[2].pid):
        time.sleep(0.01)
    problem = Ranks([stopped]).finish(stop=True)
    assert problem is not None and problem.frozen and problem.own_fault and not problem.killed_from_outside
    assert problem.message.startswith("DDP rank 1 of 2 was stopped (SIGSTOP, or a debugger)")
    timed_out = ErrorRecord(
        type="RuntimeError",
        message="[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 120000ms "
        "for recv operation to complete",
    )
    status, result = with_ranks_end(problem, JobStatus.FAILED, _failed(timed_out))
    assert status is JobStatus.FAILED and result.error is not None and result.error.type == "RankStopped"
    assert result.error.message == f"{problem.message}; rank 0 then: {timed_out.message}"


def test_a_rank_that_failed_beside_a_rank_0_that_succeeded_gives_the_job_its_traceback() -> None:
    problem = RankProblem(f"DDP rank 1 of 2 did not succeed: {RANK_FAULT.message}", error=RANK_FAULT)
    status, result = with_ranks_end(problem, JobStatus.SUCCEEDED, RESULT)
    assert status is JobStatus.FAILED and result.error == ErrorRecord(
        type="RankFailed", message=problem.message, traceback=RANK_FAULT.traceback
    )
