"""Benchmark: how long `optlab check` takes for one optimizer, as a user runs it.

Runs `python -m jobs.checks TARGET --json FILE` in a fresh process per target (so
interpreter start, framework import and the fresh-process checks all count), and
prints the wall time and the three slowest checks of each. Asserts nothing.
Run: `.venv/bin/python benchmarks/check_duration.py [TARGET ...]`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGETS = (
    ["torch.optim:Adam"],
    ["lion", "--style", "torch"],
    ["keras.optimizers:Adam"],
    ["lion", "--style", "keras"],
    ["tf_keras.optimizers.legacy:Adam"],
    ["lion", "--style", "tf_legacy"],
)


def measure(arguments: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "report.json"
        started = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "jobs.checks", *arguments, "--json", str(report_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        label = " ".join(arguments)
        if completed.returncode == 2 or not report_path.exists():
            print(f"{label:<40} exit {completed.returncode}: {completed.stderr.strip()[-300:]}")
            return
        report = json.loads(report_path.read_text())
    counts = report["summary"]
    slowest = sorted(report["checks"], key=lambda c: -c["duration_s"])[:3]
    slow = ", ".join(f"{c['id']} {c['duration_s']:.1f} s" for c in slowest)
    print(
        f"{label:<40} {wall:6.1f} s wall ({report['duration_s']:.1f} s in checks); "
        f"{counts['pass']} pass {counts['fail']} fail {counts['warn']} warn {counts['skip']} skip; "
        f"slowest: {slow}"
    )


def main() -> None:
    targets = [[t] for t in sys.argv[1:]] or [list(t) for t in DEFAULT_TARGETS]
    for arguments in targets:
        measure(arguments)


if __name__ == "__main__":
    main()
