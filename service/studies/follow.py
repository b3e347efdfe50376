"""`optlab study --wait`: a progress bar per optimizer and one overall, then the ranking table."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from service.client import ApiClient
from service.studies.summary import RANKING_CAVEAT, Stat, StudySummary, first_line


def follow_study(
    client: ApiClient, study_id: int, console: Console | None = None, poll_s: float = 0.5
) -> dict[str, Any]:
    """Poll the study until it is done (its summary recorded), showing steps done per optimizer."""
    progress = Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        StudyElapsedColumn(),
        console=console,
    )
    tasks: dict[tuple[bool, str], Any] = {}
    shown_error = shown_waiting = None
    with progress:
        while True:
            study = client.patiently(
                lambda: client.study(study_id),
                after=f"The study goes on: GET {client.base_url}/studies/{study_id} once the API is back",
            )
            rows = [
                (True, "all", study["progress"]),
                *((False, o["optimizer"], o) for o in study["progress"]["optimizers"]),
            ]
            for overall, name, row in rows:
                if (overall, name) not in tasks:  # keyed apart: an optimizer may be labelled "all"
                    tasks[overall, name] = progress.add_task(
                        escape(name), total=row["steps_total"], counts="", overall=overall
                    )
                progress.update(
                    tasks[overall, name],
                    completed=row["steps_done"],
                    total=row["steps_total"],
                    counts=_counts(row["counts"]),
                )
            if study["status"] == "done":
                return study
            error = study.get("summary_error")
            if error and error != shown_error:  # a summary that keeps failing must not look like a wait
                progress.console.print(
                    Text(f"the summary could not be made yet (retried): {first_line(error)}")
                )
                shown_error = error
            waiting = study.get("summary_waiting")
            if waiting and waiting != shown_waiting:  # a summary that waits on MLflow, said as it waits
                progress.console.print(Text(waiting))
                shown_waiting = waiting
            time.sleep(poll_s)


class StudyElapsedColumn(TimeElapsedColumn):
    """The time elapsed on the study's own bar only: an optimizer's bar counts from the study's start
    (its jobs queue behind the others'), so per optimizer it read as a speed comparison, and is none."""

    def render(self, task: Task) -> Text:
        return super().render(task) if task.fields.get("overall") else Text("")


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{status} {n}" for status, n in counts.items() if n)


def ranking_table(summary: StudySummary) -> Table:
    """Each optimizer at its best grid point, ranked on the selection metric."""
    table = Table(title=f"ranking on {summary.selection_metric} ({summary.selection_mode}, final value)")
    for column in (
        "rank",
        "optimizer",
        "best grid point",
        "mean",
        "95% CI",
        "seeds",
        "target reached",
        "jobs",
    ):
        table.add_column(column, justify="left" if column in ("optimizer", "best grid point") else "right")
    for row in summary.ranking:
        jobs = row.jobs
        problems = ", ".join(
            f"{n} {k}"
            for k, n in (("failed", jobs.failed), ("diverged", jobs.diverged), ("cancelled", jobs.cancelled))
            if n
        )
        table.add_row(
            str(row.rank) if row.rank is not None else "-",
            Text(row.optimizer),
            Text(row.label or "-"),
            _number(row.selection.mean if row.selection else None),
            _interval(row.selection),
            str(row.selection.n if row.selection else 0),
            "-"
            if row.target_reached is None or row.at_best is None
            else f"{row.target_reached}/{row.at_best.succeeded}",  # the seeds that could reach it
            f"{jobs.succeeded}/{jobs.total} ok" + (f" ({problems})" if problems else ""),
        )
    return table


def comparison_lines(summary: StudySummary) -> list[str]:
    """What to print under the ranking table: the report's caveat on what a ranking says (a reader of
    the terminal sees no report), then each paired comparison."""
    return [
        RANKING_CAVEAT,
        *(
            f"{c.optimizer} vs {c.baseline} on {c.metric} over {c.n} seeds: difference "
            f"{_number(c.mean_difference)} [{_number(c.ci_low)}, {_number(c.ci_high)}], "
            f"p={_number(c.p_value)}: {c.conclusion}"
            for c in summary.comparisons
        ),
    ]


# Problem jobs shown under the ranking, each in a line; the rest are counted (the report lists all).
PROBLEMS_SHOWN = 5
PROBLEM_LINE_CHARS = 200


def problem_lines(summary: StudySummary, shown: int = PROBLEMS_SHOWN) -> list[str]:
    """Why jobs did not succeed, in a line each: the terminal said "0/2 ok (2 failed)" and "no
    succeeded seed" with no word of why, which only the report's table told."""
    problems = summary.problems
    if not problems:
        return []
    lines = [f"failed, diverged and cancelled jobs ({len(problems)}; the report lists every one):"]
    for p in problems[:shown]:
        why = f": {first_line(p.error)}" if p.error else ""
        line = f"  job {p.job_id} ({p.optimizer} {p.label} seed {p.seed}) {p.status}{why}"
        lines.append(line if len(line) <= PROBLEM_LINE_CHARS else line[: PROBLEM_LINE_CHARS - 1] + "…")
    if len(problems) > shown:
        lines.append(f"  ... and {len(problems) - shown} more")
    return lines


def _interval(stat: Stat | None) -> str:
    if stat is None or stat.ci_low is None or stat.ci_high is None:
        return "-"
    return f"[{_number(stat.ci_low)}, {_number(stat.ci_high)}]"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
