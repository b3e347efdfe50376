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

PROGRESS_FILE = "progress.json"
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's object, or None when absent or unreadable (a writer may have crashed)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Reporter:
    def __init__(self, workdir: Path, *, min_interval_s: float = 0.5) -> None:
        self.workdir = workdir
        self._min_interval_s = min_interval_s
        self._last_write = 0.0
        self._progress: dict[str, Any] = {}

    def progress(self, *, force: bool = False, **fields: Any) -> None:
        """Merge `fields` into the progress record; written at most every `min_interval_s`."""
        self._progress.update(fields)
        now = time.monotonic()
        if force or now - self._last_write >= self._min_interval_s:
            write_json_atomic(self.workdir / PROGRESS_FILE, finite_json(self._progress))
            self._last_write = now

    def result(self, result: dict[str, Any]) -> None:
        write_json_atomic(self.workdir / RESULT_FILE, finite_json(result))


def finite_json(data: Any) -> Any:
    """JSON has no NaN or infinity: report them as strings rather than fail to write."""
    if isinstance(data, float) and (data != data or data in (float("inf"), float("-inf"))):
        return str(data)
    if isinstance(data, dict):
        return {key: finite_json(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite_json(value) for value in data]
    return data
