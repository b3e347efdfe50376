"""Outcomes a job reports as its own status rather than as a crash. No heavy imports."""

from __future__ import annotations

import shutil
from pathlib import Path


class Diverged(Exception):
    """The loss became NaN or infinite.

    `step` counts the updates applied to the parameters the loss was measured on.
    """

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"{what} became {value} at step {step}")
        self.step = step


class Cancelled(BaseException):
    """SIGTERM from the worker: cancelled, or the worker is shutting down.

    A BaseException, like KeyboardInterrupt, so user code's `except Exception` cannot
    swallow it and carry on training.
    """


# A class that calls sys.exit() (or exit()) where it cannot go on: SystemExit is no Exception, so it
# had ended the job process with no result (the worker saw only "exited with code 3") and `optlab
# check` between two checks, without a word.
EXIT_FIX = (
    "raise an exception (ValueError, RuntimeError) where the optimizer cannot go on; never exit the process"
)


def exit_message(exc: SystemExit) -> str:
    """What a SystemExit raised by the user's code is told as."""
    return (
        f"raised SystemExit({exc.code!r}) (sys.exit() or exit()), which would end the whole process that "
        "runs the optimizer, with no result"
    )


# Under this much free space, a write that failed is said to have met a full disk: torch's own words
# for it name neither the disk nor ENOSPC ("unexpected pos 56384 vs 56272").
NEARLY_FULL_BYTES = 64 * 1024 * 1024


def free_space_note(folder: Path) -> str:
    """'; the file system holding FOLDER has N bytes free: ...' where it is (nearly) full, else ''."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    if free >= NEARLY_FULL_BYTES:
        return ""
    return f"; the file system holding {folder} has {free:,} bytes free: the disk is full, or nearly"
