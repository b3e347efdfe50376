"""A job's `log.txt` (its stdout and stderr): kept under a size, and read from its end.

An optimizer that prints every step writes gigabytes over a long job, and the log had no bound:
the worker cuts it back once it is over `OPTLAB_JOB_LOG_MB`, keeping its start (the job's set-up,
the first warnings) and its latest output (where a failure's traceback follows). The job's output
is opened for appending, cold and warm (service.worker, jobs.warm), so its writes go on at the new
end.
"""

from __future__ import annotations

import os
from pathlib import Path

MB = 1024 * 1024


def cut_line(limit_bytes: int) -> str:
    return (
        f"\n[optlab: output cut here: a job's log keeps its first {limit_bytes // 2} bytes and its "
        f"latest output, under OPTLAB_JOB_LOG_MB={limit_bytes / MB:g}]\n"
    )


def cap(path: Path, limit_bytes: int) -> bool:
    """Once `path` is over `limit_bytes`: cut it back to its first half, a line saying so and its
    last quarter (the latest output, which a failure's traceback follows). True if it cut. What the
    job writes between reading that quarter and the cut is lost: a few lines at most."""
    head, kept = limit_bytes // 2, limit_bytes // 4
    try:
        if path.stat().st_size <= limit_bytes:  # every poll: a stat, no more
            return False
        with open(path, "rb") as log:
            log.seek(-kept, os.SEEK_END)
            latest = log.read(kept)
        os.truncate(path, head)
        with open(path, "ab") as log:
            log.write(cut_line(limit_bytes).encode() + latest)
    except OSError:  # gone, or not ours to cut: the job's outcome matters more than its log's size
        return False
    return True


def tail(path: Path, chars: int) -> str:
    """About the last `chars` characters of `path`, reading only its end ("" if it cannot be read)."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - 4 * chars))  # UTF-8: at most 4 bytes a character
            return log.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""


# What of a job's log is copied to its MLflow run: all of it up to this size; past it, its first
# quarter, a line saying so and its last three quarters of this.
COPY_LIMIT_BYTES = 4 * MB


def excerpt(path: Path, limit_bytes: int = COPY_LIMIT_BYTES) -> bytes:
    """`path`'s bytes when they are at most `limit_bytes`; else its start and latest output, with a
    line saying what was left out between them. b"" when it cannot be read."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(0)
            if size <= limit_bytes:
                return log.read()
            head = log.read(limit_bytes // 4)
            log.seek(size - limit_bytes * 3 // 4)
            latest = log.read()
    except OSError:
        return b""
    left_out = size - len(head) - len(latest)
    return head + f"\n[optlab: {left_out} bytes of the job's log left out here]\n".encode() + latest
