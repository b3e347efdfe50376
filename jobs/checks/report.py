"""What a conformance check run reports: plain data, no framework imports.

The check ids are stable: users script against them, MLflow logs `checks/<id>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from jobs.result import finite_json

Status = Literal["pass", "fail", "warn", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "fail", "warn", "skip")

# How long one check may run before it is stopped (`--check-timeout`; check jobs use it too): the
# checks' models are tiny and the slowest published classes take seconds, so a check still running
# then is a step that hangs (a lock, a process group that never forms) or as good as one.
CHECK_TIME_LIMIT_S = 600.0
MAX_CHECK_TIME_LIMIT_S = 86400.0  # what a timer takes on every platform, and longer than any check


def check_timeout(text: str) -> float:
    """`--check-timeout`'s value: seconds, positive and at most a day (argparse names the option)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_CHECK_TIME_LIMIT_S:
        raise argparse.ArgumentTypeError(
            f"seconds, a number > 0 and at most {MAX_CHECK_TIME_LIMIT_S:g} (a day); received {text!r}"
        )
    return seconds


def add_check_timeout(parser: argparse.ArgumentParser) -> None:
    """`--check-timeout` (None when not given), shared by `optlab check`, which passes it through."""
    parser.add_argument(
        "--check-timeout",
        type=check_timeout,
        metavar="SECONDS",
        help=f"how long one check may run before it is stopped (default {CHECK_TIME_LIMIT_S:g}): a "
        "class's step still running then fails its check, and the checks after it are not run",
    )


CHECK_IDS: tuple[str, ...] = (
    "construct",
    "dense_step",
    "descends",
    "none_grads",
    "schedule",
    "sparse",
    "config_roundtrip",
    "state_roundtrip",
    "save_load_model",
    "resume_exact",
    "graph_mode",
    "distributed",
    "device_placement",
    "param_groups",
    "closure",
    "mixed_precision",
    "state_untrainable",
    "step_cost",
    "deprecations",
)

# Checks that exist for some styles only; every other check applies to all three.
ONLY_FOR_STYLES: dict[str, tuple[str, ...]] = {
    "save_load_model": ("keras", "tf_legacy"),
    "param_groups": ("torch",),
    "closure": ("torch",),
}


@dataclass(frozen=True)
class Outcome:
    """What one check function observed; the runner adds the id and the time taken."""

    status: Status
    detail: str
    figure: float | None = None
    where: str = ""


def passed(detail: str, figure: float | None = None) -> Outcome:
    return Outcome("pass", detail, figure)


def skipped(reason: str) -> Outcome:
    return Outcome("skip", reason)


def failed(observed: str, *, fix: str, where: str = "", figure: float | None = None) -> Outcome:
    """A fault of the optimizer: what was seen, where (file:line when known), the usual fix."""
    return Outcome("fail", _explain(observed, where, fix), figure, where)


def warned(observed: str, *, fix: str, where: str = "", figure: float | None = None) -> Outcome:
    """Worth knowing, not wrong: same shape as `failed`."""
    return Outcome("warn", _explain(observed, where, fix), figure, where)


def _explain(observed: str, where: str, fix: str) -> str:
    located = f"{observed} (at {where})" if where and where not in observed else observed
    return f"{located.rstrip('. ')}. Fix: {fix}"


@dataclass(frozen=True)
class CheckResult:
    id: str
    status: Status
    detail: str
    figure: float | None = None
    where: str = ""
    duration_s: float = 0.0


@dataclass
class CheckReport:
    optimizer: str
    framework: str
    style: str
    target: str
    cls: str
    params: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0
    # What the checks were told beyond params (stated needs, a param-group recipe, a wrapper's
    # base), as given; reported only when something was.
    setup: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {status: sum(c.status == status for c in self.checks) for status in STATUSES}

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def summary(self) -> dict[str, Any]:
        """The short form the service shows next to an optimizer."""
        return {
            **self.counts(),
            "failed": [c.id for c in self.checks if c.status == "fail"],
            "warned": [c.id for c in self.checks if c.status == "warn"],
            "duration_s": self.duration_s,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "framework": self.framework,
            "style": self.style,
            "target": self.target,
            "class": self.cls,
            "params": self.params,
            **({"setup": self.setup} if self.setup else {}),
            "checks": [finite_json(asdict(check)) for check in self.checks],  # NaN figures as text
            "summary": self.summary(),
            "duration_s": self.duration_s,
        }

    def to_markdown(self) -> str:
        counts = ", ".join(f"{n} {status}" for status, n in self.counts().items())
        lines = [
            f"# Conformance checks: {self.optimizer} ({self.style})",
            "",
            f"Class `{self.cls}`, framework {self.framework}, params `{self.params}`"
            + (f", setup `{self.setup}`" if self.setup else "")
            + f": {counts} in {self.duration_s:.1f} s.",
            "",
            "| check | status | figure | detail |",
            "| --- | --- | --- | --- |",
        ]
        for check in self.checks:
            detail = check.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {check.id} | {check.status} | {format_figure(check.figure)} | {detail} |")
        return "\n".join(lines) + "\n"


STATUS_COLOUR = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


# The exit status when stdout's reader went away (`optlab check ... | head`): a shell's for a process
# SIGPIPE ended; rich's own exit 1 read as a failed check.
CLOSED_PIPE = 141


def report_ending(report: dict[str, Any], json_path: Path | None, *, after_table: str = "") -> int:
    """Show the report (its table, then `after_table`), write its JSON to `json_path`, and the exit
    status: 0 when no check fails, 1 when one does, 2 for a report that cannot be written, CLOSED_PIPE
    when stdout's reader went away (the JSON is written all the same)."""
    shown = True
    try:
        print_report_table(report)
        if after_table:
            print(after_table)
        sys.stdout.flush()
    except (SystemExit, BrokenPipeError):  # rich's Console.on_broken_pipe exits 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        shown = False
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:  # checked before the run; the path may have changed meanwhile
            print(
                f"optlab check: cannot write the report to {json_path}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
    if not shown:
        return CLOSED_PIPE
    return 0 if report["summary"]["fail"] == 0 else 1


def print_report_table(report: dict[str, Any]) -> None:
    """The readable table, from the report's JSON form (local runs and the service's alike)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Text, not markup: an error quoted in a detail may hold brackets ("[/__w/pytorch/...pair.cc:553]"
    # from gloo) that rich would read as tags, and raise on.
    table = Table(title=Text(f"{report['optimizer']} ({report['style']}) — {report['class']}"))
    for column in ("check", "status", "figure", "explanation"):
        table.add_column(column, overflow="fold")
    for check in report["checks"]:
        status = Text(check["status"], style=STATUS_COLOUR[check["status"]])
        table.add_row(Text(check["id"]), status, format_figure(check["figure"]), Text(check["detail"]))
    console = Console(width=max(120, Console().width))
    console.print(table)
    summary = report["summary"]
    counts = ", ".join(f"{summary[status]} {status}" for status in STATUSES)
    console.print(f"{counts} in {report['duration_s']:.1f} s")


def format_figure(figure: float | str | None) -> str:
    """A figure for the table; NaN and infinity arrive from JSON as text."""
    if figure is None or isinstance(figure, str):
        return figure or ""
    if figure == 0 or 1e-3 <= abs(figure) < 1e5:
        return f"{figure:.4g}"
    return f"{figure:.2e}"
