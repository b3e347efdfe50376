"""Benchmark: how `optlab check` judges the published optimizers of pytorch-optimizer.

For every name in `pytorch_optimizer.get_supported_optimizers()` (lowercase names; the
class is `pytorch_optimizer.optimizer.OPTIMIZERS[name]`), resolves the target
`module:Class` at the module that defines the class, exactly as `optlab check` would,
and runs every check in-process with default hyperparameters (`run_checks(target, {})`).
Classes run one after another in a worker process; a class that takes longer than
`--timeout` seconds is recorded as timed out, the worker is killed (its whole process
group) and a new one carries on with the next class. Writes the raw results as JSON and
prints figures. Asserts nothing: tests/checks/test_pytorch_optimizer_catalogue.py holds the
verdicts; this prints the figures (before and after in pytorch_optimizer_survey.md).

Needs pytorch-optimizer==4.1.0, which the `test` extra installs (`make test` does).
Run: `.venv/bin/python benchmarks/pytorch_optimizer_survey.py [--only Adan,Lion]
[--timeout 240] [--json /tmp/po-survey.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `jobs`, when run as a script

from jobs.checks.runner import UNBUILDABLE  # noqa: E402
from jobs.processes import start_in_own_group, terminate_group  # noqa: E402

RESULT_PREFIX = "SURVEY-RESULT "


def catalogue() -> list[tuple[str, str]]:
    """(class name, target text) for every supported optimizer, in the package's order."""
    from pytorch_optimizer import get_supported_optimizers
    from pytorch_optimizer.optimizer import OPTIMIZERS

    rows = []
    for entry in get_supported_optimizers():
        cls = OPTIMIZERS[entry] if isinstance(entry, str) else entry
        rows.append((cls.__name__, f"{cls.__module__}:{cls.__name__}"))
    return rows


def check_one(name: str, text: str) -> dict[str, Any]:
    """One class through `run_checks`, as a plain dict (never raises)."""
    from jobs.checks.runner import run_checks
    from jobs.checks.target import resolve_target

    row: dict[str, Any] = {"class": name, "target": text, "resolved": False, "built": False}
    started = time.perf_counter()
    try:
        target = resolve_target(text)
    except Exception as exc:
        row["why_not"] = f"resolve_target: {type(exc).__name__}: {exc}"
        return row
    row["resolved"] = True
    try:
        report = run_checks(target, {})
    except Exception as exc:
        row["why_not"] = f"run_checks raised {type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-2000:]
        return row
    checks = report.to_json()["checks"]
    unbuildable = any(c["status"] == "skip" and c["detail"].startswith(UNBUILDABLE) for c in checks)
    row["built"] = not unbuildable
    if unbuildable:
        construct = next((c for c in checks if c["id"] == "construct"), None)
        row["why_not"] = construct["detail"] if construct else "construct did not run"
    row["checks"] = {c["id"]: c["status"] for c in checks}
    row["flags"] = [
        {"id": c["id"], "status": c["status"], "detail": c["detail"], "where": c["where"]}
        for c in checks
        if c["status"] in ("fail", "warn")
    ]
    row["durations"] = {c["id"]: c["duration_s"] for c in checks}
    row["check_time_s"] = report.duration_s
    row["wall_s"] = round(time.perf_counter() - started, 2)
    return row


def worker(names: list[str]) -> None:
    """Child side: check each class, one result line each, flushed at once."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    wanted = dict(catalogue())
    for name in names:
        row = check_one(name, wanted[name])
        print(RESULT_PREFIX + json.dumps(row), flush=True)


def survey(names: list[str], timeout: float, log: Path) -> list[dict[str, Any]]:
    """Parent side: run the worker, restart it past a class that hangs or kills it."""
    results: list[dict[str, Any]] = []
    remaining = list(names)
    with log.open("a") as stderr:
        while remaining:
            # Its own process group: killed with its grandchildren.
            child = start_in_own_group(
                [sys.executable, __file__, "--worker", ",".join(remaining)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
            lines: queue.Queue[str] = queue.Queue()
            threading.Thread(target=_pump, args=(child, lines), daemon=True).start()
            deadline = time.monotonic() + timeout + 60  # the first class also pays the imports
            while remaining:
                current = remaining[0]
                try:
                    line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    terminate_group(child, grace_s=0)
                    results.append(
                        {
                            "class": current,
                            "resolved": True,
                            "built": None,
                            "why_not": f"timed out after {timeout:.0f} s",
                        }
                    )
                    print(f"  {current:<22} TIMEOUT", flush=True)
                    remaining.pop(0)
                    break
                if line == "":  # the worker died
                    child.wait()
                    results.append(
                        {
                            "class": current,
                            "resolved": None,
                            "built": None,
                            "why_not": f"worker died (exit {child.returncode}) checking it",
                        }
                    )
                    print(f"  {current:<22} DIED exit {child.returncode}", flush=True)
                    remaining.pop(0)
                    terminate_group(child, grace_s=0)
                    break
                if not line.startswith(RESULT_PREFIX):
                    continue  # the optimizer's own prints
                row = json.loads(line[len(RESULT_PREFIX) :])
                results.append(row)
                _print_row(row)
                remaining.pop(0)
                deadline = time.monotonic() + timeout
            else:
                child.wait()
    return results


def _pump(child: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """The worker's stdout, line by line, then "" at its end."""
    assert child.stdout is not None
    for line in child.stdout:
        lines.put(line)
    lines.put("")


def _print_row(row: dict[str, Any]) -> None:
    if not row.get("built"):
        print(f"  {row['class']:<22} NOT CHECKED: {str(row.get('why_not'))[:150]}", flush=True)
        return
    counts = Counter(row["checks"].values())
    flagged = ", ".join(f"{f['id']}={f['status']}" for f in row["flags"])
    print(
        f"  {row['class']:<22} {row['check_time_s']:6.1f} s  {counts['fail']} fail {counts['warn']} warn"
        f"  {flagged}",
        flush=True,
    )


def summarize(results: list[dict[str, Any]]) -> None:
    checked = [r for r in results if r.get("built")]
    unchecked = [r for r in results if not r.get("built")]
    fails: Counter[str] = Counter()
    warns: Counter[str] = Counter()
    for row in checked:
        for flag in row["flags"]:
            (fails if flag["status"] == "fail" else warns)[flag["id"]] += 1
    print(f"\nclasses: {len(results)}; checked: {len(checked)}; could not be checked: {len(unchecked)}")
    for row in unchecked:
        print(f"  {row['class']:<22} {str(row.get('why_not'))[:200]}")
    print("\nflags per check (fail / warn):")
    for check_id in sorted(set(fails) | set(warns), key=lambda i: (-fails[i], -warns[i], i)):
        print(f"  {check_id:<18} {fails[check_id]:4d} fail {warns[check_id]:4d} warn")
    print("\nslowest classes by check time:")
    for row in sorted(checked, key=lambda r: -r["check_time_s"])[:10]:
        slow = sorted(row["durations"].items(), key=lambda kv: -kv[1])[:3]
        where = ", ".join(f"{k} {v:.1f} s" for k, v in slow)
        print(f"  {row['class']:<22} {row['check_time_s']:6.1f} s  ({where})")
    print(
        f"\nBENCH pytorch_optimizer_survey classes={len(results)} checked={len(checked)} "
        f"fails={sum(fails.values())} warns={sum(warns.values())} unbuildable={len(unchecked)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated class names (default: the whole catalogue)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per class (default 240)")
    parser.add_argument("--json", type=Path, default=Path("/tmp/po-survey.json"), dest="json_path")
    parser.add_argument("--log", type=Path, default=None, help="workers' stderr (default: JSON + .log)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker.split(","))
        return
    names = [name for name, _ in catalogue()]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",")]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"not in get_supported_optimizers(): {', '.join(unknown)}")
        names = [n for n in names if n in wanted]
    log = args.log or args.json_path.with_name(args.json_path.name + ".log")
    log.write_text("")
    started = time.perf_counter()
    print(f"checking {len(names)} classes (timeout {args.timeout:.0f} s each; worker stderr in {log})")
    results = survey(names, args.timeout, log)
    args.json_path.write_text(
        json.dumps(
            {
                "package": "pytorch-optimizer",
                "version": _version(),
                "timeout_s": args.timeout,
                "wall_s": round(time.perf_counter() - started, 1),
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    summarize(results)
    print(f"raw results: {args.json_path}")


def _version() -> str:
    from importlib.metadata import version

    return version("pytorch-optimizer")


if __name__ == "__main__":
    main()
