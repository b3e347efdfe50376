"""Multi-device jobs (`JobSpec.distribution`), as the job process runs them: one job process
(group) whatever the number of devices, so the worker supervises, limits and kills one thing.

- `ddp` (torch): the job process is rank 0; it starts ranks 1..N-1 as `python -m jobs.run` children
  in its own process group (each dies with it), meeting through a file store in the workdir. Rank
  0 alone logs to MLflow and writes progress and the result; the other ranks train, checkpoint
  and verify alike (every checkpoint is verified under the strategy on every rank) into
  `rank-<i>/` and report only their own result, which rank 0 reads before it calls the job done.
- `mirrored` (Keras): one process, `tf.distribute.MirroredStrategy` over N devices (logical CPUs
  here): nothing to launch; the Keras driver builds under the strategy.

No framework imported here: the ranks' torch work lives in the torch driver.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from jobs.checkpoint_files import CHECKPOINT_DIR_ENV
from jobs.processes import die_with_parent, how_it_ended, is_stopped
from jobs.result import LOG_FILE, RESULT_FILE, ErrorRecord, JobResult, JobStatus, read_result
from jobs.spec import AnySpec, JobSpec

# How a rank learns its place: set by the rank-0 job process for its children (and itself).
RANK_ENV = "OPTLAB_DDP_RANK"
WORLD_ENV = "OPTLAB_DDP_WORLD_SIZE"
STORE_ENV = "OPTLAB_DDP_STORE"
RANK_WAIT_S = 120.0  # after rank 0 finished: the others finish the same steps
STOP_WAIT_S = 5.0  # after rank 0 failed or was cancelled
PUBLISHED_POLL_S = 0.01  # how often a rank looks whether rank 0 is through with its publication
OUTSIDE_KILLS = (-signal.SIGKILL, -signal.SIGTERM)
# How a collective (gloo, NCCL) reports that it broke: a peer gone, a timeout waiting for one. Such an
# error on one rank follows another rank's fault; it is not a fault of its own.
COLLECTIVE_ERROR_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})
COLLECTIVE_WORDS = re.compile(
    r"third_party/gloo|ProcessGroupGloo|ProcessGroupNCCL|NCCL (?:error|communicator)|"
    r"Connection (?:closed|reset) by peer|Timed out waiting \d+ms for (?:send|recv)"
)


def is_collective_break(error: ErrorRecord | None) -> bool:
    """Whether `error` is a collective breaking (a peer gone or not answering), not a rank's own fault."""
    if error is None:
        return False
    return error.type in COLLECTIVE_ERROR_TYPES or COLLECTIVE_WORDS.search(error.message) is not None


@dataclass(frozen=True)
class Rank:
    """This process's place in a DDP job: rank, world size, and where the ranks meet."""

    rank: int
    world: int
    store: Path


def current_rank() -> Rank | None:
    """The DDP rank this process is, or None outside a DDP job."""
    if WORLD_ENV not in os.environ:
        return None
    return Rank(int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV]), Path(os.environ[STORE_ENV]))


def published_mark(rank: Rank, step: int) -> Path:
    """The file rank 0 writes once it is through waiting for the publication before step's checkpoint."""
    return rank.store.with_name(f"ddp-published-{step}")


def rank_0_waited(rank: Rank, step: int) -> None:
    """Where rank 0 may wait on something outside the job (its last checkpoint's publication, to an
    MLflow server that may not answer for minutes), the other ranks wait for it here, with no
    collective pending: in the next step's collective they had timed out (gloo's DDP_TIMEOUT_S) and
    failed the job for good. Rank 0 says it is through; the others look for that. A rank 0 that
    fails stops them (SIGTERM, which a Python loop sees at once, unlike a collective); one that dies
    takes them with it (die_with_parent); one that waits on still says so in its progress; a rank hung
    anywhere else is still caught by the next collective's timeout."""
    mark = published_mark(rank, step)
    if rank.rank == 0:
        mark.touch()
        return
    while not mark.exists():
        time.sleep(PUBLISHED_POLL_S)


def is_ddp(spec: AnySpec) -> bool:
    return isinstance(spec, JobSpec) and spec.distribution is not None and spec.distribution.strategy == "ddp"


@dataclass(frozen=True)
class RankProblem:
    """Why a DDP job's ranks did not all succeed: the first rank's problem, in a sentence."""

    message: str
    # The rank was already dead by a SIGKILL or SIGTERM no one here sent (the out-of-memory killer).
    killed_from_outside: bool = False
    # The rank's own error (its type and traceback), where it wrote one.
    error: ErrorRecord | None = None
    # The rank was found stopped (SIGSTOP, a debugger) while rank 0 ended.
    frozen: bool = False

    @property
    def own_fault(self) -> bool:
        """The rank failed by its own error or was stopped, not failed by a collective another rank broke."""
        return self.frozen or (self.error is not None and not is_collective_break(self.error))


class Ranks:
    """The ranks 1..N-1 a rank-0 job process started; `finish` waits for them and says how they ended."""

    def __init__(self, processes: list[tuple[int, Path, subprocess.Popen[bytes]]]) -> None:
        self.processes = processes
        self.results: dict[int, JobResult | None] = {}  # each rank's, once `finish` read them

    def finish(self, *, stop: bool) -> RankProblem | None:
        """Wait for every rank (SIGTERM them first when `stop`: rank 0 failed or was cancelled);
        the first rank killed or stopped from outside, else the first rank at fault (its own error,
        or stopped by SIGSTOP), else the first rank's problem, or None when all of them succeeded."""
        world = len(self.processes) + 1
        problems = []
        for rank, workdir, process in self.processes:
            problem = self._end_of(rank, workdir, process, stop=stop)
            if problem is not None:
                problems.append(replace(problem, message=f"DDP rank {rank} of {world} {problem.message}"))
        return (
            next((p for p in problems if p.killed_from_outside), None)
            or next((p for p in problems if p.own_fault), None)
            or (problems[0] if problems else None)
        )

    def _end_of(
        self, rank: int, workdir: Path, process: subprocess.Popen[bytes], *, stop: bool
    ) -> RankProblem | None:
        """How one rank ended, its problem's message to follow the rank's name; None: it succeeded."""
        # A rank handles SIGTERM (jobs.run): it writes a cancelled result, then exits 1. Written
        # before this process stopped the ranks, the SIGTERM came from outside, as a -15 does.
        stopped = _cancelled(read_result(workdir))
        # Dead by a signal this process did not send (it sends them only when stopping the
        # ranks, or to one past its wait): the out-of-memory killer's, an operator's.
        killed = process.poll() in OUTSIDE_KILLS
        # Stopped (SIGSTOP, a debugger) while rank 0 runs: by no one of the job (the worker's pause
        # and a job's own freeze stop rank 0 too). The others' collectives waited for it until they
        # timed out: it is the rank at fault.
        frozen = process.poll() is None and is_stopped(process.pid)
        if stop and process.poll() is None:
            process.terminate()  # a rank blocked in a collective may not see it: killed soon after
        try:
            process.wait(timeout=STOP_WAIT_S if stop else RANK_WAIT_S)
            killed = killed or (not stop and process.returncode in OUTSIDE_KILLS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        result = self.results[rank] = read_result(workdir)
        if killed:
            said = f"{how_it_ended(process.returncode)} (out of memory, or from outside)"
            return RankProblem(said, killed_from_outside=True)
        if stopped or (not stop and _cancelled(result)):
            said = "was stopped by a SIGTERM it was sent from outside (an operator, a container runtime)"
            return RankProblem(said, killed_from_outside=True)
        if frozen:
            said = (
                "was stopped (SIGSTOP, or a debugger) and made no progress, so the other ranks' "
                "collectives waited for it until they timed out; it was killed as the job ended"
            )
            return RankProblem(said, frozen=True)
        if result is not None and result.status is JobStatus.SUCCEEDED:
            return None
        if stop and _cancelled(result):  # rank 0's SIGTERM: its words are the worker's, not true here
            return RankProblem("was stopped by rank 0, which had failed")
        error = result.error if result is not None else None
        return RankProblem(f"did not succeed: {error.message if error else 'no result written'}", error=error)

    def drifted(self, params_sha256: str | None) -> str | None:
        """After `finish`, with every rank succeeded: a warning naming the ranks whose final weights
        differ from rank 0's (`params_sha256`), else None. DDP keeps replicas bitwise equal; ranks
        part where the class's step differs between processes (unseeded random draws, a per-process
        value)."""
        if params_sha256 is None:
            return None
        apart = [rank for rank, result in self.results.items() if _sha(result) not in (None, params_sha256)]
        if not apart:
            return None
        world = len(self.processes) + 1
        ranks = f"rank{'s' if len(apart) > 1 else ''} {', '.join(map(str, apart))}"
        return (
            f"DDP {ranks} of {world} ended with other weights than rank 0 "
            "(params_sha256 differs): the replicas drifted apart, so the job's metrics and checkpoint are "
            "rank 0's alone. DDP keeps replicas equal unless the optimizer's step differs between "
            "processes (random draws not from torch's seeded generator, a value per process); if the class "
            "does not draw random numbers by design, run the `distributed` check on it (optlab check) to "
            "find where its ranks part"
        )


def _cancelled(result: JobResult | None) -> bool:
    return result is not None and result.status is JobStatus.CANCELLED


def _sha(result: JobResult | None) -> str | None:
    return result.params_sha256 if result is not None and result.status is JobStatus.SUCCEEDED else None


def start_ranks(spec: JobSpec, argv: list[str], workdir: Path, resume_from: Path | None) -> Ranks:
    """Rank 0 (this process) starts the others with the same spec and arguments, minus what only rank
    0 does (tracking, the run to resume in), with the checkpoint it already fetched."""
    assert spec.distribution is not None
    world = spec.distribution.devices
    store = workdir / "ddp-store"
    store.unlink(missing_ok=True)  # a file store must not exist before the ranks meet
    for mark in workdir.glob("ddp-published-*"):  # an earlier run's, in a reused folder
        mark.unlink()
    os.environ.update({RANK_ENV: "0", WORLD_ENV: str(world), STORE_ENV: str(store)})
    processes = []
    for rank in range(1, world):
        rank_dir = workdir / f"rank-{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        # An earlier run's result in a reused folder would be read as this rank's (finish).
        (rank_dir / RESULT_FILE).unlink(missing_ok=True)
        command = [sys.executable, "-m", "jobs.run", *rank_argv(argv, rank_dir, resume_from)]
        # No tracking and no shared checkpoint folder: rank 0 alone logs and publishes checkpoints.
        env = {**os.environ, RANK_ENV: str(rank), "MLFLOW_TRACKING_URI": "", CHECKPOINT_DIR_ENV: ""}
        # Appended to, as rank 0's log: the worker cuts an overlong log (service/job_log.cap), and a
        # writer at its own offset had filled the cut back with zeros to the old size.
        with open(rank_dir / LOG_FILE, "ab") as log:
            process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
        processes.append((rank, rank_dir, process))
    return Ranks(processes)


# Options a rank other than 0 must not get (value-taking ones), and those it gets anew.
RANK_0_ONLY = frozenset({"--tracking-uri", "--resume-run-id", "--resume", "--workdir"})


def rank_argv(argv: list[str], rank_dir: Path, resume_from: Path | None) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in RANK_0_ONLY:
            skip = "=" not in arg
            continue
        kept.append(arg)
    kept += ["--workdir", str(rank_dir)]
    if resume_from is not None:
        kept += ["--resume", str(resume_from)]
    return kept
