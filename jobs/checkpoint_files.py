"""Where a job's checkpoints lie on disk and what their names say, in the standard library only: the
worker, which imports no framework, clears what an ended attempt left by the rules the job writes by.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

CHECKPOINT_DIR_ENV = "OPTLAB_CHECKPOINT_DIR"
KEEP_CHECKPOINTS_ENV = "OPTLAB_KEEP_CHECKPOINTS"
WORKDIR_CHECKPOINTS = "checkpoints"  # where they are written in the job's folder, but to a shared one
RESUMED_FROM = "resumed-from"  # where a resumed attempt downloads the checkpoint it starts from
# A checkpoint's name, by style: `step-00000300.pt` (torch, a file), `step-00000300` (Keras, a folder).
CHECKPOINT_NAME = re.compile(r"step-(\d+)(\.pt)?")


def checkpoint_name(reference: str) -> str:
    return reference.rstrip("/").rsplit("/", 1)[-1]


def checkpoint_step(name: str) -> int | None:
    match = CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of any style: one file (torch) or one folder (Keras)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def checkpoint_leftovers(folder: Path, *, keep: Path | None) -> list[Path]:
    """What an ended attempt's checkpoint folder holds that nothing will read: every checkpoint
    (`step-N.pt`, `step-N/`) and write cut short (a process killed mid-save: `.step-N.pt.tmp`) but
    `keep`, the one a retry on this host resumes from where the job's checkpoints lie in its folder.
    The others are copies of what its MLflow run holds, ones no report named (a checkpoint whose
    round trip was under way), or a DDP job's other rank's own."""
    found: list[Path] = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        name = entry.name.removeprefix(".").removesuffix(".tmp")
        if checkpoint_step(name) is not None and (keep is None or entry.resolve() != keep.resolve()):
            found.append(entry)
    return found


def earlier_attempts(job_folder: Path, attempt: int) -> list[Path]:
    """The folders (`attempt-N`) in `job_folder` of the job's attempts before `attempt`."""
    found = []
    for folder in job_folder.glob("attempt-*"):
        number = folder.name.removeprefix("attempt-")
        if number.isdigit() and int(number) < attempt:
            found.append(folder)
    return sorted(found)


def attempt_leftovers(attempt_folder: Path, *, keep: Path | None) -> list[Path]:
    """What an ended attempt's folder holds of checkpoints that nothing will read (`checkpoint_leftovers`
    of its own, and of a DDP job's other ranks, never the job's: rank 0's is), and the download it
    resumed from: all but `keep`."""
    leftovers = checkpoint_leftovers(attempt_folder / WORKDIR_CHECKPOINTS, keep=keep)
    for rank in attempt_folder.glob("rank-*"):
        leftovers += checkpoint_leftovers(rank / WORKDIR_CHECKPOINTS, keep=None)
    return [*leftovers, attempt_folder / RESUMED_FROM]
