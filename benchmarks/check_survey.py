"""Survey: how `optlab check` judges any optimizer classes you name, with totals, and what changed
between two surveys (the same classes before and after a change to the checks).

Each target is `module:Class` (or `path/to/file.py:Class`), optionally followed by `@` and a JSON
object with `params` (hyperparameters, as `--params`) and `base` (the optimizer a wrapper wraps, as
`--base`): `timm.optim.lookahead:Lookahead@{"base": {"name": "adamw", "params": {"lr": 0.001}}}`.
Every check runs in-process, one class after another, as `optlab check` runs them. Writes one JSON
line per class to `--out` and prints the totals; asserts nothing.

Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/check_survey.py --out after.jsonl TARGET...`
(the packages surveyed on PYTHONPATH too), then `benchmarks/check_survey.py --compare before.jsonl
after.jsonl` for the flags that changed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `jobs`, when run as a script


def survey(text: str) -> dict[str, Any]:
    """Every check on one target: {target, params, base, checks: {id: [status, detail]}} or an error."""
    from jobs.checks.context import LoopSetup
    from jobs.checks.runner import run_checks
    from jobs.checks.target import UsageError, resolve_target

    name, _, extra = text.partition("@")
    options = json.loads(extra) if extra else {}
    row: dict[str, Any] = {"target": name, "params": options.get("params", {}), "base": options.get("base")}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="check-survey-") as scratch:
            setup = LoopSetup(base=row["base"]) if row["base"] else None
            report = run_checks(resolve_target(name), row["params"], workdir=Path(scratch), setup=setup)
        row["checks"] = {c.id: [c.status, c.detail] for c in report.checks}
    except UsageError as exc:
        row["usage"] = str(exc)
    except Exception as exc:  # the survey goes on: a crash of the checker is a finding too
        row["crash"] = f"{type(exc).__name__}: {exc}"
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def totals(rows: list[dict[str, Any]]) -> Counter[str]:
    counted: Counter[str] = Counter()
    for row in rows:
        if "checks" not in row:
            counted["usage error" if "usage" in row else "checker crash"] += 1
            continue
        counted.update(status for status, _ in row["checks"].values())
    return counted


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Each (class, check) whose status changed, or whose fail or warn now says something else."""
    earlier = {_key(row): row for row in before}
    for row in after:
        old = earlier.get(_key(row), {})
        given = f" {json.dumps(row['params'])}" if row.get("params") else ""
        for check_id, (status, detail) in row.get("checks", {}).items():
            old_status, old_detail = old.get("checks", {}).get(check_id, ["absent", ""])
            reworded = status in ("fail", "warn") and old_detail[:60] != detail[:60]
            if status != old_status or reworded:
                print(f"{row['target']}{given} {check_id}: {old_status} -> {status}")
                print(f"    before: {old_detail[:240]}")
                print(f"    after:  {detail[:240]}")


def _key(row: dict[str, Any]) -> str:
    """A class with the values it was given: one class may be surveyed with several."""
    return json.dumps([row["target"], row.get("params") or {}, row.get("base")], sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("targets", nargs="*", help="module:Class[@{json}]")
    parser.add_argument("--out", type=Path, help="where to write one JSON line per class")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (read(path) for path in args.compare)
        compare(before, after)
        print(f"before: {dict(totals(before))}\nafter:  {dict(totals(after))}")
        return
    rows = []
    for text in args.targets:
        row = survey(text)
        rows.append(row)
        flags = [f"{cid} {s}" for cid, (s, _) in row.get("checks", {}).items() if s in ("fail", "warn")]
        print(f"{row['target']}: {', '.join(flags) or row.get('usage') or row.get('crash') or 'no flag'}")
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
    print(f"{len(rows)} classes: {dict(totals(rows))}")
    counted = " ".join(f"{k.replace(' ', '_')}={v}" for k, v in sorted(totals(rows).items()))
    print(f"BENCH check_survey classes={len(rows)} {counted}")


if __name__ == "__main__":
    main()
