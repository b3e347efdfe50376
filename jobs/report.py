"""How a job process tells its worker what it is doing: two small JSON files.

`progress.json` is rewritten (atomically) as training advances; `result.json` is
written once at the end. Files, not stdout, because user optimizer code may print.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobs.result import PROGRESS_FILE, RESULT_FILE, JobResult, Progress

# A call that has not returned after this long is shown in progress (`waiting`) until it does, and
# the figure there is refreshed this often: long enough that a healthy server never shows.
WAITING_SHOWN_AFTER_S = 10.0
WAITING_REFRESH_S = 5.0


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False, default=str))
    os.replace(tmp, path)


class Reporter:
    def __init__(self, workdir: Path, *, min_interval_s: float = 0.5) -> None:
        self.workdir = workdir
        self._min_interval_s = min_interval_s
        self._last_write = 0.0
        self._progress: Progress | None = None
        self._unwritten = False  # merged fields the throttle has kept from the file so far
        self._lock = threading.Lock()

    def progress(self, *, force: bool = False, **fields: Any) -> None:
        """Merge `fields` into the progress record (validated as `jobs.result.Progress`, so a
        misnamed field fails here, in the job, not silently in the service); written at most
        every `min_interval_s`. The first call must give `step` and `total`."""
        with self._lock:  # the training thread and a `waiting_on` watch
            current = self._progress
            self._progress = current.merged(**fields) if current else Progress.model_validate(fields)
            now = time.monotonic()
            self._unwritten = True
            if force or now - self._last_write >= self._min_interval_s:
                self._write_progress(now)

    def _write_progress(self, now: float) -> None:
        if self._progress is not None:
            write_json_atomic(self.workdir / PROGRESS_FILE, self._progress.to_json())
        self._last_write, self._unwritten = now, False

    @contextmanager
    def waiting_on(self, what: str) -> Iterator[None]:
        """Run the block; once it has taken WAITING_SHOWN_AFTER_S, progress says `what` the job waits on
        and for how long, until it ends. A tracking server that stops answering holds a job inside
        MLflow's client for minutes (it retries each request); the job then says so instead of
        showing a bare `running`."""
        started = time.monotonic()
        ended = threading.Event()

        def watch() -> None:
            pause = WAITING_SHOWN_AFTER_S
            while not ended.wait(pause):
                waited = round(time.monotonic() - started)
                self.progress(waiting=f"{what}: {waited} s so far", force=True)
                pause = WAITING_REFRESH_S

        watcher = threading.Thread(target=watch, name="optlab-waiting", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            ended.set()
            watcher.join()
            if self._progress is not None and self._progress.waiting is not None:
                self.progress(waiting=None, force=True)

    def result(self, result: JobResult) -> None:
        """The result, after the last progress the throttle held back: a job that failed at its
        step-500 checkpoint had read as at step 243, its last write before the throttle."""
        with self._lock:
            if self._unwritten:
                self._write_progress(time.monotonic())
        write_json_atomic(self.workdir / RESULT_FILE, result.to_json())
