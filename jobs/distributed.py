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
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jobs.processes import die_with_parent, how_it_ended
from jobs.result import LOG_FILE, JobStatus, read_result
from jobs.resume import CHECKPOINT_DIR_ENV
from jobs.spec import AnySpec, JobSpec

# How a rank learns its place: set by the rank-0 job process for its children (and itself).
RANK_ENV = "OPTLAB_DDP_RANK"
WORLD_ENV = "OPTLAB_DDP_WORLD_SIZE"
STORE_ENV = "OPTLAB_DDP_STORE"
RANK_WAIT_S = 120.0  # after rank 0 finished: the others finish the same steps
STOP_WAIT_S = 5.0  # after rank 0 failed or was cancelled
OUTSIDE_KILLS = (-signal.SIGKILL, -signal.SIGTERM)


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


def is_ddp(spec: AnySpec) -> bool:
    return isinstance(spec, JobSpec) and spec.distribution is not None and spec.distribution.strategy == "ddp"


@dataclass(frozen=True)
class RankProblem:
    """Why a DDP job's ranks did not all succeed: the first rank's problem, in a sentence."""

    message: str
    # The rank was already dead by a SIGKILL or SIGTERM no one here sent (the out-of-memory killer).
    killed_from_outside: bool = False


class Ranks:
    """The ranks 1..N-1 a rank-0 job process started; `finish` waits for them and says how they ended."""

    def __init__(self, processes: list[tuple[int, Path, subprocess.Popen[bytes]]]) -> None:
        self.processes = processes

    def finish(self, *, stop: bool) -> RankProblem | None:
        """Wait for every rank (SIGTERM them first when `stop`: rank 0 failed or was cancelled);
        the first rank killed from outside, else the first rank's problem, or None when all of
        them succeeded."""
        problems: list[RankProblem] = []
        world = len(self.processes) + 1
        for rank, workdir, process in self.processes:
            # Dead by a signal this process did not send (it sends them only when stopping the
            # ranks, or to one past its wait): the out-of-memory killer's, an operator's.
            killed = process.poll() in OUTSIDE_KILLS
            if stop and process.poll() is None:
                process.terminate()  # a rank blocked in a collective may not see it: killed soon after
            try:
                process.wait(timeout=STOP_WAIT_S if stop else RANK_WAIT_S)
                killed = killed or (not stop and process.returncode in OUTSIDE_KILLS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            result = read_result(workdir)
            if killed:
                said = f"{how_it_ended(process.returncode)} (out of memory, or from outside)"
                problems.append(RankProblem(f"DDP rank {rank} of {world} {said}", killed_from_outside=True))
            elif result is None or result.status is not JobStatus.SUCCEEDED:
                error = result.error.message if result is not None and result.error else "no result written"
                problems.append(RankProblem(f"DDP rank {rank} of {world} did not succeed: {error}"))
        return next((p for p in problems if p.killed_from_outside), problems[0] if problems else None)


def start_ranks(spec: JobSpec, argv: list[str], workdir: Path, resume_from: Path | None) -> Ranks:
    """Rank 0 (this process) starts the others with the same spec and arguments, minus what only rank
    0 does (tracking, the run to resume in), with the checkpoint it already fetched."""
    assert spec.distribution is not None
    world = spec.distribution.devices
    store = workdir / "ddp-store"
    store.unlink(missing_ok=True)  # a file store must not exist before the ranks meet
    os.environ.update({RANK_ENV: "0", WORLD_ENV: str(world), STORE_ENV: str(store)})
    processes = []
    for rank in range(1, world):
        rank_dir = workdir / f"rank-{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "jobs.run", *rank_argv(argv, rank_dir, resume_from)]
        # No tracking and no shared checkpoint folder: rank 0 alone logs and publishes checkpoints.
        env = {**os.environ, RANK_ENV: str(rank), "MLFLOW_TRACKING_URI": "", CHECKPOINT_DIR_ENV: ""}
        with open(rank_dir / LOG_FILE, "wb") as log:
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
