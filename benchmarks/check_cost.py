"""Benchmark: the wall time of a whole `optlab check` per built-in optimizer, as a user runs it.

Each check is `python -m service.cli check NAME --style STYLE --json FILE` (the `optlab check`
command, which runs the checks in the job environment) in a fresh process, so interpreter start,
the framework import and the fresh-process checks all count. The built-ins are read from the
catalogue (`python -m jobs.catalogue`); by default the custom ones (`ema_momentum`, `lion`,
`adamw_ref`) in every style, with `--all` every built-in. Prints each one's wall time, the time in
the checks, the verdict counts and the slowest checks; one `BENCH check_cost` line per target.
Run: `python benchmarks/check_cost.py [--all] [--only lion,adam] [--styles torch,keras]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from common import PYTHON, ROOT, bench_line, machine_line

CUSTOM = ("ema_momentum", "lion", "adamw_ref")


def built_ins() -> list[tuple[str, str]]:
    completed = subprocess.run(
        [PYTHON, "-m", "jobs.catalogue"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    entries = json.loads(completed.stdout)["optimizers"]
    return [(e["name"], e["style"]) for e in entries if str(e.get("source", "")).startswith("builtin:")]


def measure(name: str, style: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPTLAB_JOB_PYTHON": PYTHON}
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "report.json"
        command = [PYTHON, "-m", "service.cli", "check", name, "--style", style, "--json", str(report_path)]
        started = time.perf_counter()
        completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if completed.returncode == 2 or not report_path.exists():
            print(f"{name} ({style}): exit {completed.returncode}: {completed.stderr.strip()[-500:]}")
            return
        report = json.loads(report_path.read_text())
    counts = report["summary"]
    slowest = sorted(report["checks"], key=lambda c: -c["duration_s"])[:3]
    slow = ", ".join(f"{c['id']} {c['duration_s']:.1f} s" for c in slowest)
    print(
        f"{name + ' (' + style + ')':<26} {wall:6.1f} s wall ({report['duration_s']:.1f} s in checks); "
        f"{counts['pass']} pass {counts['fail']} fail {counts['warn']} warn {counts['skip']} skip; "
        f"slowest: {slow}",
        flush=True,
    )
    bench_line(
        "check_cost",
        optimizer=name,
        style=style,
        wall_s=wall,
        checks_s=float(report["duration_s"]),
        failed=counts["fail"],
        exit=completed.returncode,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--all", action="store_true", help="every built-in, not only the custom ones")
    parser.add_argument("--only", help="comma-separated optimizer names")
    parser.add_argument("--styles", default="torch,keras,tf_legacy")
    args = parser.parse_args()
    print(machine_line())
    names = set(args.only.split(",")) if args.only else None
    styles = args.styles.split(",")
    for name, style in built_ins():
        if (
            style not in styles
            or (names and name not in names)
            or (not names and not args.all and name not in CUSTOM)
        ):
            continue
        measure(name, style)
    print(machine_line())


if __name__ == "__main__":
    main()
