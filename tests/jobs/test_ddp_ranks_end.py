"""How a DDP job ends once its other ranks have: a rank killed from outside (out of memory) is told
apart from one that failed, so the worker can start the job again (tests/service/test_worker.py)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from jobs.distributed import RankProblem, Ranks
from jobs.result import RANK_KILLED, ErrorRecord, JobResult, JobStatus
from jobs.run import with_ranks_end


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
