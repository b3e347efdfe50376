"""A check job: the conformance checks (`jobs.checks`) on a registered optimizer, run by `jobs.run`.

Shaped like the trainers (`run()`, `last_checkpoint`) so `jobs.run` drives both kinds of job
through one set of MLflow, cancellation and error paths. Checks that find faults are the
job's answer, not its failure: the job succeeds whenever the checks ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.checks.report import CHECK_TIME_LIMIT_S, CheckReport, CheckResult
from jobs.report import Reporter
from jobs.result import CheckOutcome
from jobs.spec import CheckSpec
from jobs.tracking import Tracker

if TYPE_CHECKING:
    from jobs.checks.context import LoopSetup
    from jobs.checks.target import Target

REPORT_JSON = "report.json"
REPORT_MARKDOWN = "report.md"
# MLflow metric per check: 1 when the optimizer is fine (pass or warn), 0 when it fails.
METRIC_OF_STATUS = {"pass": 1.0, "warn": 1.0, "fail": 0.0}


class CheckJob:
    def __init__(
        self,
        spec: CheckSpec,
        *,
        target: Target,
        workdir: Path,
        tracker: Tracker,
        reporter: Reporter,
    ) -> None:
        self.spec = spec
        self.target = target  # the class the spec names, as `check_target` resolved it
        self.workdir = workdir
        self.tracker = tracker
        self.reporter = reporter
        self.last_checkpoint: Path | None = None  # a check job leaves no checkpoint behind
        self.artifacts: list[Path] = []  # report.json and report.md once the checks have run

    def run(self, *, resume_from: Path | None = None, stop_after: int | None = None) -> CheckOutcome:
        if resume_from is not None or stop_after is not None:
            raise ValueError("--resume and --stop-after are for training jobs; a check job always runs whole")
        from jobs.checks.runner import run_checks

        report = run_checks(
            self.target,
            self.spec.optimizer.params,
            only=self.spec.check_ids(),
            workdir=self.workdir,
            on_result=self._on_result,
            setup=setup_of(self.spec),
            time_limit_s=CHECK_TIME_LIMIT_S,
        )
        self.artifacts = self._write_report(report)
        return CheckOutcome(
            report=report.to_json(), checks_failed=report.counts()["fail"], steps_completed=len(report.checks)
        )

    def _on_result(self, result: CheckResult, done: int, total: int) -> None:
        if result.status in METRIC_OF_STATUS:
            self.tracker.metric(f"checks/{result.id}", METRIC_OF_STATUS[result.status], 0)
        self.reporter.progress(step=done, total=total, check=result.id, force=True)

    def _write_report(self, report: CheckReport) -> list[Path]:
        as_json = self.workdir / REPORT_JSON
        as_json.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
        as_markdown = self.workdir / REPORT_MARKDOWN
        as_markdown.write_text(report.to_markdown())
        return [as_json, as_markdown]


def check_target(spec: CheckSpec, plugin_files: Sequence[str]) -> Target:
    """The class the spec names, found where the catalogue found it (`plugin_files`: jobs.run
    --plugin-file), and the one it was submitted for, or no checks at all."""
    from jobs.checks.target import resolve_target
    from jobs.optimizer_source import held_to_record

    optimizer = spec.optimizer
    target = resolve_target(
        optimizer.name, framework=spec.framework, style=optimizer.style, plugin_files=plugin_files
    )
    held_to_record(optimizer, target.entry)
    return target


def setup_of(spec: CheckSpec) -> LoopSetup:
    """What the spec's optimizer states beyond params (needs, a param-group recipe, a wrapper's base),
    as the checks take it: the same as `python -m jobs.checks --needs --param-groups --base`."""
    from jobs.checks.context import LoopSetup

    optimizer = spec.optimizer
    base = optimizer.base
    return LoopSetup(
        needs=dict(optimizer.needs or {}),
        param_groups=[group.model_dump(exclude_defaults=True) for group in optimizer.param_groups or ()],
        base=None
        if base is None
        else base.model_dump(include={"name", "params", "needs"}, exclude_none=True),
    )
