"""How a job process tells its worker what it is doing: two small JSON files.

`progress.json` is rewritten (atomically) as training advances; `result.json` is
written once at the end. Files, not stdout, because user optimizer code may print.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from jobs.result import PROGRESS_FILE, RESULT_FILE, JobResult, Progress


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

    def progress(self, *, force: bool = False, **fields: Any) -> None:
        """Merge `fields` into the progress record (validated as `jobs.result.Progress`, so a
        misnamed field fails here, in the job, not silently in the service); written at most
        every `min_interval_s`. The first call must give `step` and `total`."""
        current = self._progress
        self._progress = current.merged(**fields) if current else Progress.model_validate(fields)
        now = time.monotonic()
        if force or now - self._last_write >= self._min_interval_s:
            write_json_atomic(self.workdir / PROGRESS_FILE, self._progress.to_json())
            self._last_write = now

    def result(self, result: JobResult) -> None:
        write_json_atomic(self.workdir / RESULT_FILE, result.to_json())
