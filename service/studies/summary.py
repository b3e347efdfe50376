"""A study's statistics, computed from its jobs' metric histories (pure functions, no I/O).

`summarize` turns the study's `StudyRun`s (read back from the store and MLflow by the
studies core) into a `StudySummary`: per optimizer and grid point the mean, sample std and
95% Student's t interval over seeds of each `val/*` metric's final and best value, the best
grid point per optimizer, time to target per seed, the time split per optimizer, a ranking
and paired comparisons against the baseline.

Rules that decide the figures (kept here, in one place):
- Statistics stand on the *succeeded* seeds only; every other job is counted by status and
  listed in `problems` (failed, diverged, cancelled) or counted as unfinished (queued,
  running). Each figure carries the number of seeds it stands on.
- A metric's final value is its last logged point (by step); its best value is the minimum
  or maximum over its finite points, by the selection mode for the selection metric and
  by `METRIC_DIRECTIONS` (default: lower is better) for every other metric.
- The best grid point is chosen among those where no job failed or diverged (among all where
  every point had such a job, with a note): a rate at which most seeds diverge is not the best
  because the seed that survived scored well. A note names a point passed over so.
- Time to target looks at the logged points of every job that did not fail or diverge (a job
  that met the target and diverged later is not an optimizer that reaches it; it is counted
  as not reached, its status shown).
- JSON holds no NaN or infinity: an undefined figure is None (and the models refuse
  non-finite floats).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

Mode = Literal["min", "max"]
# None: null, for a hyperparameter that takes it; a list: one value of a list hyperparameter (a
# grid of `betas` is a list of pairs, and a grid of one pair is how a study fixes it).
GridValue = float | int | str | bool | None | list[Any]

# Which way a metric improves, by the last part of its key ("val/bits_per_char" ->
# "bits_per_char"). Anything not listed is treated as a loss (lower is better): most
# metrics a workload logs are losses or errors, and the selection metric's mode is
# always given explicitly anyway.
METRIC_DIRECTIONS: dict[str, Mode] = {
    "loss": "min",
    "rmse": "min",
    "mse": "min",
    "mae": "min",
    "bits_per_char": "min",
    "perplexity": "min",
    "error": "min",
    "accuracy": "max",
    "auc": "max",
    "f1": "max",
}
DEFAULT_DIRECTION: Mode = "min"

CONFIDENCE = 0.95
MIN_SEEDS_TO_CONCLUDE = 3
SIGNIFICANCE = 0.05
ENDED = frozenset({"succeeded", "failed", "diverged", "cancelled"})
PROBLEM_STATUSES = ("failed", "diverged", "cancelled")
# A job that ended so did not stand the optimizer's test: it weakens a grid point, and it has not
# reached the target whatever it logged before.
UNSTABLE_STATUSES = ("failed", "diverged")


@dataclass(frozen=True)
class MetricPoint:
    step: int
    seconds: float  # wall seconds since the job's run started (MLflow timestamp - run start_time)
    value: float


@dataclass(frozen=True)
class StudyRun:
    """One job of the study, read back from the store and MLflow by the `studies` core."""

    job_id: int
    optimizer: str  # the study's optimizer entry name (label), e.g. "lion"
    grid: dict[str, GridValue]  # this job's values of the grid hyperparameters, e.g. {"lr": 3e-4}
    seed: int
    status: str  # queued | running | succeeded | failed | diverged | cancelled
    # every MLflow metric key -> its points by step (train/loss, val/loss, val/accuracy,
    # perf/step_time_ms, perf/optimizer_step_ms, optim/state_bytes, traj/x, traj/y, ...)
    history: dict[str, list[MetricPoint]]
    run_id: str | None = None
    error: str | None = None  # failed/diverged: the reason, shown in the report


@dataclass(frozen=True)
class TargetRule:
    metric: str  # e.g. "val/loss" or "val/accuracy"
    mode: Mode  # min: reached when value <= target; max: when value >= target
    value: float


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Stat(_Model):
    """Mean, sample std (ddof=1) and the 95% Student's t interval of the mean over `n` seeds.

    None where undefined: every field with n == 0, std and the interval with n == 1.
    """

    n: int
    mean: float | None
    std: float | None
    ci_low: float | None
    ci_high: float | None


class MetricStats(_Model):
    """One metric at one grid point: its final (last logged) and its best value, over seeds."""

    metric: str
    direction: Mode  # which way is better, from METRIC_DIRECTIONS
    final: Stat
    best: Stat


class JobCounts(_Model):
    """Every job counted by status; `unfinished` is queued + running."""

    total: int
    succeeded: int
    failed: int
    diverged: int
    cancelled: int
    unfinished: int


class Target(_Model):
    metric: str
    mode: Mode
    value: float


class SeedTime(_Model):
    """When one job first met the target, or `reached=False` ("not reached")."""

    job_id: int
    seed: int
    status: str
    reached: bool
    step: int | None
    seconds: float | None


class TimeToTarget(_Model):
    """Time to target at one grid point: per seed, and over the seeds that reached it."""

    target: Target
    seeds: list[SeedTime]  # every job of the grid point, whatever its status
    reached: int
    not_reached: int  # ended jobs that never met the target
    pending: int  # queued or running jobs that have not met it yet
    steps: Stat  # over the seeds that reached it
    seconds: Stat


class GridPointSummary(_Model):
    optimizer: str
    grid: dict[str, GridValue]
    label: str  # e.g. "lr=0.0003"
    counts: JobCounts
    seeds: list[int]  # the succeeded seeds the statistics stand on
    metrics: list[MetricStats]  # every val/* metric (and the selection metric), sorted by name
    time_to_target: TimeToTarget | None  # None without a target

    def metric(self, name: str) -> MetricStats | None:
        return next((m for m in self.metrics if m.metric == name), None)


class TimeSplit(_Model):
    """Where an optimizer's step time goes (medians over its succeeded jobs' logged points)."""

    optimizer: str
    jobs: int  # the jobs these figures stand on
    # medians of the jobs' flush-window means (perf/* are logged once a flush):
    forward_backward_ms: float | None  # median of perf/step_time_ms - perf/optimizer_step_ms
    optimizer_step_ms: float | None  # median of perf/optimizer_step_ms
    state_bytes: float | None  # median over jobs of the last optim/state_bytes


class RankingRow(_Model):
    """One optimizer at its best grid point; rank None when no grid point has a result."""

    rank: int | None
    optimizer: str
    grid: dict[str, GridValue] | None
    label: str | None
    selection: Stat | None  # the selection metric's final value at the best grid point
    at_best: JobCounts | None  # the jobs of the best grid point
    jobs: JobCounts  # every job of this optimizer, all grid points
    target_reached: int | None  # seeds at the best grid point that reached the target


class PairedComparison(_Model):
    """Optimizer minus baseline, each at its best grid point, over the seeds both succeeded on."""

    optimizer: str
    baseline: str
    metric: str
    seeds: list[int]
    n: int
    mean_difference: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None  # paired t-test (scipy.stats.ttest_rel); None when undefined
    conclusion: str  # a plain sentence, e.g. "too few seeds to conclude"


class ProblemJob(_Model):
    """A failed, diverged or cancelled job: listed, counted, never dropped."""

    job_id: int
    optimizer: str
    label: str
    seed: int
    status: str
    error: str | None
    run_id: str | None


class StudySummary(_Model):
    selection_metric: str
    selection_mode: Mode
    target: Target | None
    baseline: str | None
    optimizers: list[str]  # in the order they first appear in the runs
    counts: JobCounts  # the whole study
    grid_points: list[GridPointSummary]
    ranking: list[RankingRow]
    comparisons: list[PairedComparison]
    time_split: list[TimeSplit]
    problems: list[ProblemJob]
    notes: list[str]  # plain sentences about anything the figures above cannot show

    def best_grid_point(self, optimizer: str) -> GridPointSummary | None:
        row = next((r for r in self.ranking if r.optimizer == optimizer), None)
        if row is None or row.label is None:
            return None
        return next(p for p in self.grid_points if p.optimizer == optimizer and p.label == row.label)

    def flat_metrics(self) -> dict[str, float]:
        """Finite figures for the parent MLflow run, keys with MLflow-safe characters only.

        `summary/study/...` for the job counts; per optimizer at its best grid point
        `summary/<optimizer>/<metric>_final_mean` (and `_std`, `_ci_low`, `_ci_high`, `_n`,
        `_best_mean`), `rank`, `target_*`, the time split and `vs_<baseline>/*`; every grid
        point's final means under `summary/<optimizer>/grid/<label>/`. None is left out.
        """
        out: dict[str, float] = {}

        def put(key: str, value: float | int | None) -> None:
            if value is not None and math.isfinite(value):
                out[key] = float(value)

        for status, count in self.counts.model_dump().items():
            put(f"summary/study/jobs_{status}", count)
        names = mlflow_segments(self.optimizers)
        for row in self.ranking:
            base = f"summary/{names[row.optimizer]}"
            put(f"{base}/rank", row.rank)
            put(f"{base}/jobs_failed", row.jobs.failed)
            put(f"{base}/jobs_diverged", row.jobs.diverged)
            best = self.best_grid_point(row.optimizer)
            if best is None:
                continue
            for m in best.metrics:
                key = f"{base}/{mlflow_key(m.metric)}"
                for part, stat in (("final", m.final), ("best", m.best)):
                    put(f"{key}_{part}_mean", stat.mean)
                    put(f"{key}_{part}_std", stat.std)
                    put(f"{key}_{part}_ci_low", stat.ci_low)
                    put(f"{key}_{part}_ci_high", stat.ci_high)
                    put(f"{key}_{part}_n", stat.n)
            ttt = best.time_to_target
            if ttt is not None:
                put(f"{base}/target_reached", ttt.reached)
                put(f"{base}/target_not_reached", ttt.not_reached)
                put(f"{base}/target_steps_mean", ttt.steps.mean)
                put(f"{base}/target_seconds_mean", ttt.seconds.mean)
        for split in self.time_split:
            base = f"summary/{names[split.optimizer]}"
            put(f"{base}/forward_backward_ms", split.forward_backward_ms)
            put(f"{base}/optimizer_step_ms", split.optimizer_step_ms)
            put(f"{base}/state_bytes", split.state_bytes)
        for c in self.comparisons:
            base = f"summary/{names[c.optimizer]}/vs_{names.get(c.baseline, mlflow_key(c.baseline))}"
            put(f"{base}/mean_difference", c.mean_difference)
            put(f"{base}/ci_low", c.ci_low)
            put(f"{base}/ci_high", c.ci_high)
            put(f"{base}/p_value", c.p_value)
            put(f"{base}/n", c.n)
        for point in self.grid_points:
            label = mlflow_key(point.label.replace("/", "_")[:MAX_SEGMENT])
            base = f"summary/{names[point.optimizer]}/grid/{label}"
            for m in point.metrics:
                put(f"{base}/{mlflow_key(m.metric)}_final_mean", m.final.mean)
                put(f"{base}/{mlflow_key(m.metric)}_final_n", m.final.n)
        return out


# ---------------------------------------------------------------------------------------
# summarize


def summarize(
    runs: Sequence[StudyRun],
    *,
    target: TargetRule | None,
    baseline: str | None,
    selection_metric: str,
    selection_mode: Mode,
) -> StudySummary:
    """The study's statistics from its runs (any status; see the module docstring for the rules)."""
    target_model = (
        None if target is None else Target(metric=target.metric, mode=target.mode, value=target.value)
    )
    optimizers = list(dict.fromkeys(run.optimizer for run in runs))
    points = [
        summarize_grid_point(
            group, target=target, selection_metric=selection_metric, selection_mode=selection_mode
        )
        for group in group_by_grid_point(runs, optimizers)
    ]
    ranking = rank(points, runs, optimizers, selection_metric, selection_mode)
    notes = notes_on(points, ranking, runs, baseline, selection_metric) + instability_notes(
        points, optimizers, selection_metric, selection_mode
    )
    summary = StudySummary(
        selection_metric=selection_metric,
        selection_mode=selection_mode,
        target=target_model,
        baseline=baseline,
        optimizers=optimizers,
        counts=count_jobs(runs),
        grid_points=points,
        ranking=ranking,
        comparisons=[],
        time_split=[time_split(opt, [r for r in runs if r.optimizer == opt]) for opt in optimizers],
        problems=problem_jobs(runs, optimizers),
        notes=notes,
    )
    comparisons = compare_to_baseline(summary, runs) if baseline in optimizers else []
    return summary.model_copy(update={"comparisons": comparisons})


def direction_of(metric: str) -> Mode:
    """Which way `metric` improves, from METRIC_DIRECTIONS by the key's last part; min by default."""
    return METRIC_DIRECTIONS.get(metric.rsplit("/", 1)[-1], DEFAULT_DIRECTION)


def describe(stat_values: Iterable[float], *, at_least: float | None = None) -> Stat:
    """Mean, sample std (ddof=1) and the 95% Student's t interval of the mean of finite values.

    `at_least`: a quantity that cannot be lower (steps, seconds): the interval is cut there. With
    few seeds and a wide spread it reached below 0 ("-38 to 89 steps"); the cut part cannot hold
    the true mean, so the interval still covers it as often."""
    values = [float(v) for v in stat_values if math.isfinite(v)]
    n = len(values)
    if n == 0:
        return Stat(n=0, mean=None, std=None, ci_low=None, ci_high=None)
    mean = math.fsum(values) / n
    if n == 1:
        return Stat(n=1, mean=finite(mean), std=None, ci_low=None, ci_high=None)
    std = float(np.std(values, ddof=1))
    half = t_quantile(n - 1) * std / math.sqrt(n)
    low = mean - half if at_least is None else max(mean - half, at_least)
    return Stat(n=n, mean=finite(mean), std=finite(std), ci_low=finite(low), ci_high=finite(mean + half))


def scipy_stats() -> Any:
    """scipy.stats, imported on first use: it costs over a second, and the API and the CLI import
    this module at start-up while only a summary needs it."""
    from scipy import stats  # type: ignore[import-untyped]

    return stats


def t_quantile(dof: int) -> float:
    """The two-sided 95% Student's t quantile (4.303 for 2 degrees of freedom)."""
    return float(scipy_stats().t.ppf(0.5 + CONFIDENCE / 2, dof))


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def grid_label(grid: dict[str, GridValue]) -> str:
    """`lr=0.0003 beta=0.9` (keys sorted), or `default` for an empty grid."""
    if not grid:
        return "default"
    return " ".join(f"{key}={format_value(grid[key])}" for key in sorted(grid))


def format_value(value: GridValue) -> str:
    """The shortest text that reads back as the same value (so labels never merge two grid
    points): 0.0003, 3e-5, 64, True, null, lion; a string that would read as another value (or as
    two grid values) in quotes: "True", "0.5", "a b"."""
    if value is None:
        return "null"
    if isinstance(value, list):  # as JSON, which has no spaces here and reads back the same
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, str):
        return value if _reads_as_itself(value) else json.dumps(value)
    if isinstance(value, float):
        text = repr(value).removesuffix(".0")  # 1.0 -> 1: equal to the int 1 anyway
        if "e" in text:
            mantissa, exponent = text.split("e")
            text = f"{mantissa.removesuffix('.0')}e{int(exponent)}"
        return text
    return str(value)


def _reads_as_itself(text: str) -> bool:
    if not text or " " in text or "=" in text or text in ("null", "True", "False"):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def grid_sort_key(grid: dict[str, GridValue]) -> tuple[tuple[str, int, float, str], ...]:
    """Numbers in numeric order, then text; the same key for the same grid whatever the input order."""
    key = []
    for name in sorted(grid):
        value = grid[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            key.append((name, 1, 0.0, format_value(value)))
        else:
            key.append((name, 0, float(value), ""))
    return tuple(key)


def group_by_grid_point(runs: Sequence[StudyRun], optimizers: list[str]) -> list[list[StudyRun]]:
    """Runs grouped by (optimizer, grid point): optimizers in first-seen order, grid points sorted."""
    groups: dict[tuple[str, str], list[StudyRun]] = {}
    for run in runs:
        groups.setdefault((run.optimizer, grid_label(run.grid)), []).append(run)
    ordered = sorted(
        groups.values(), key=lambda g: (optimizers.index(g[0].optimizer), grid_sort_key(g[0].grid))
    )
    return [sorted(g, key=lambda r: (r.seed, r.job_id)) for g in ordered]


def count_jobs(runs: Iterable[StudyRun]) -> JobCounts:
    statuses = [run.status for run in runs]
    return JobCounts(
        total=len(statuses),
        succeeded=statuses.count("succeeded"),
        failed=statuses.count("failed"),
        diverged=statuses.count("diverged"),
        cancelled=statuses.count("cancelled"),
        unfinished=sum(1 for s in statuses if s not in ENDED),
    )


def ordered_points(points: Sequence[MetricPoint]) -> list[MetricPoint]:
    return sorted(points, key=lambda p: p.step)


def final_value(points: Sequence[MetricPoint]) -> float | None:
    """The last logged point's value (by step); None when missing or not finite."""
    if not points:
        return None
    return finite(float(ordered_points(points)[-1].value))


def best_value(points: Sequence[MetricPoint], mode: Mode) -> float | None:
    values = [float(p.value) for p in points if math.isfinite(p.value)]
    if not values:
        return None
    return min(values) if mode == "min" else max(values)


def summarize_grid_point(
    runs: list[StudyRun], *, target: TargetRule | None, selection_metric: str, selection_mode: Mode
) -> GridPointSummary:
    succeeded = [run for run in runs if run.status == "succeeded"]
    names = {key for run in succeeded for key in run.history if key.startswith("val/")}
    names.add(selection_metric)
    metrics = []
    for name in sorted(names):
        # the study says which way its selection metric improves; the table decides the rest
        mode = selection_mode if name == selection_metric else direction_of(name)
        histories = [run.history.get(name, []) for run in succeeded]
        finals = [v for v in (final_value(h) for h in histories) if v is not None]
        bests = [v for v in (best_value(h, mode) for h in histories) if v is not None]
        metrics.append(MetricStats(metric=name, direction=mode, final=describe(finals), best=describe(bests)))
    first = runs[0]
    return GridPointSummary(
        optimizer=first.optimizer,
        grid=dict(sorted(first.grid.items())),
        label=grid_label(first.grid),
        counts=count_jobs(runs),
        seeds=sorted(run.seed for run in succeeded),
        metrics=metrics,
        time_to_target=None if target is None else time_to_target(runs, target),
    )


def meets(value: float, target: TargetRule) -> bool:
    if not math.isfinite(value):
        return False
    return value <= target.value if target.mode == "min" else value >= target.value


def time_to_target(runs: list[StudyRun], target: TargetRule) -> TimeToTarget:
    """Per job, the first logged point (by step) that meets the target; counted over every status,
    but a job that failed or diverged has not reached it, whatever it logged before."""
    seeds = []
    for run in runs:
        points = [] if run.status in UNSTABLE_STATUSES else run.history.get(target.metric, [])
        hit = next((p for p in ordered_points(points) if meets(p.value, target)), None)
        seeds.append(
            SeedTime(
                job_id=run.job_id,
                seed=run.seed,
                status=run.status,
                reached=hit is not None,
                step=None if hit is None else hit.step,
                seconds=None if hit is None else finite(float(hit.seconds)),
            )
        )
    reached = [s for s in seeds if s.reached]
    return TimeToTarget(
        target=Target(metric=target.metric, mode=target.mode, value=target.value),
        seeds=seeds,
        reached=len(reached),
        not_reached=sum(1 for s in seeds if not s.reached and s.status in ENDED),
        pending=sum(1 for s in seeds if not s.reached and s.status not in ENDED),
        steps=describe((float(s.step) for s in reached if s.step is not None), at_least=0.0),
        seconds=describe((s.seconds for s in reached if s.seconds is not None), at_least=0.0),
    )


def selection_stat(point: GridPointSummary, selection_metric: str) -> Stat | None:
    metric = point.metric(selection_metric)
    return None if metric is None else metric.final


def pick_best(points: list[GridPointSummary], selection_metric: str, mode: Mode) -> GridPointSummary | None:
    """The grid point with the best mean final selection metric among those where no job failed or
    diverged (among all where every point had such a job); the first in grid order on a tie. A rate
    at which most seeds diverge is not the best because its one lucky seed scored well."""
    stable = [p for p in points if not unstable(p)]
    return best_mean(stable, selection_metric, mode) or best_mean(points, selection_metric, mode)


def best_mean(points: list[GridPointSummary], selection_metric: str, mode: Mode) -> GridPointSummary | None:
    """The grid point with the best mean final selection metric over its succeeded seeds."""
    scored = [
        (p, s.mean) for p in points if (s := selection_stat(p, selection_metric)) and s.mean is not None
    ]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda ps: ps[1])[0]


def unstable_jobs(point: GridPointSummary) -> int:
    """How many of its jobs failed or diverged: its statistics stand on the seeds that survived."""
    return point.counts.failed + point.counts.diverged


def unstable(point: GridPointSummary) -> bool:
    return unstable_jobs(point) > 0


def rank(
    points: list[GridPointSummary],
    runs: Sequence[StudyRun],
    optimizers: list[str],
    selection_metric: str,
    mode: Mode,
) -> list[RankingRow]:
    """Optimizers at their best grid point, best first; those with no result last, unranked."""
    rows = []
    for opt in optimizers:
        best = pick_best([p for p in points if p.optimizer == opt], selection_metric, mode)
        jobs = count_jobs(r for r in runs if r.optimizer == opt)
        if best is None:
            rows.append(
                RankingRow(
                    rank=None,
                    optimizer=opt,
                    grid=None,
                    label=None,
                    selection=None,
                    at_best=None,
                    jobs=jobs,
                    target_reached=None,
                )
            )
            continue
        rows.append(
            RankingRow(
                rank=None,
                optimizer=opt,
                grid=best.grid,
                label=best.label,
                selection=selection_stat(best, selection_metric),
                at_best=best.counts,
                jobs=jobs,
                target_reached=None if best.time_to_target is None else best.time_to_target.reached,
            )
        )
    sign = 1.0 if mode == "min" else -1.0
    ranked = sorted(
        (r for r in rows if r.selection is not None and r.selection.mean is not None),
        key=lambda r: sign * r.selection.mean,  # type: ignore[union-attr,operator]
    )
    unranked = [r for r in rows if r not in ranked]
    return [r.model_copy(update={"rank": i + 1}) for i, r in enumerate(ranked)] + unranked


def final_by_seed(runs: Sequence[StudyRun], optimizer: str, label: str, metric: str) -> dict[int, float]:
    """Succeeded runs' final values of `metric` by seed (the lowest job id for a repeated seed)."""
    out: dict[int, float] = {}
    for run in sorted(runs, key=lambda r: r.job_id):
        if run.optimizer != optimizer or grid_label(run.grid) != label or run.status != "succeeded":
            continue
        value = final_value(run.history.get(metric, []))
        if value is not None and run.seed not in out:
            out[run.seed] = value
    return out


def compare_to_baseline(summary: StudySummary, runs: Sequence[StudyRun]) -> list[PairedComparison]:
    baseline = summary.baseline
    assert baseline is not None
    base_point = summary.best_grid_point(baseline)
    if base_point is None:
        return []
    metric = summary.selection_metric
    base = final_by_seed(runs, baseline, base_point.label, metric)
    out = []
    for opt in summary.optimizers:
        point = summary.best_grid_point(opt)
        if opt == baseline or point is None:
            continue
        mine = final_by_seed(runs, opt, point.label, metric)
        seeds = sorted(set(mine) & set(base))
        out.append(
            paired(
                opt,
                baseline,
                metric,
                summary.selection_mode,
                seeds,
                [mine[s] for s in seeds],
                [base[s] for s in seeds],
            )
        )
    return out


def paired(
    optimizer: str,
    baseline: str,
    metric: str,
    mode: Mode,
    seeds: list[int],
    mine: list[float],
    base: list[float],
) -> PairedComparison:
    """Optimizer minus baseline per seed: mean, its t interval, the paired t-test, one plain sentence."""
    n = len(seeds)
    diffs = [a - b for a, b in zip(mine, base, strict=True)]
    d = describe(diffs)
    p_value: float | None = None
    # Differences equal on every seed up to rounding have no spread: the t statistic is then
    # 0/0 or x/0 and its p-value meaningless, so it stays None and the sentence says why.
    scale = max((abs(x) for x in [*mine, *base]), default=1.0) or 1.0
    spread = n >= 2 and d.std is not None and d.std > 1e-12 * scale
    if spread:
        p_value = finite(float(scipy_stats().ttest_rel(mine, base).pvalue))
    where = f"in {metric} ({'lower' if mode == 'min' else 'higher'} is better)"
    if n == 0:
        sentence = f"No seed on which both {optimizer} and {baseline} succeeded: nothing to compare."
    elif n < MIN_SEEDS_TO_CONCLUDE:
        sentence = (
            f"Only {n} common seed{'s' if n != 1 else ''}: too few seeds to conclude "
            f"(at least {MIN_SEEDS_TO_CONCLUDE} are needed)."
        )
    elif not spread:
        if all(abs(x) <= 1e-12 * scale for x in diffs):
            sentence = (
                f"{optimizer} and {baseline} are identical {where} on all {n} seeds: no difference, "
                "and no spread for a t-test (p-value undefined)."
            )
        else:
            sentence = (
                f"{optimizer} differs from {baseline} by exactly {diffs[0]:+.4g} {where} on all {n} seeds; "
                "with no spread the t-test's p-value is undefined."
            )
    else:
        assert d.mean is not None and p_value is not None
        better = d.mean < 0 if mode == "min" else d.mean > 0
        figures = (
            f"mean difference {d.mean:+.4g} (95% CI {d.ci_low:+.4g} to {d.ci_high:+.4g}), "
            f"p = {p_value:.3g} over {n} seeds"
        )
        if p_value < SIGNIFICANCE:
            sentence = f"{optimizer} is {'better' if better else 'worse'} than {baseline} {where}: {figures}."
        else:
            sentence = (
                f"No significant difference between {optimizer} and {baseline} {where} at the 5% level: "
                f"{figures}."
            )
    return PairedComparison(
        optimizer=optimizer,
        baseline=baseline,
        metric=metric,
        seeds=seeds,
        n=n,
        mean_difference=d.mean,
        ci_low=d.ci_low,
        ci_high=d.ci_high,
        p_value=p_value,
        conclusion=sentence,
    )


def median_or_none(values: Sequence[float]) -> float | None:
    finite_values = [v for v in values if math.isfinite(v)]
    return finite(float(statistics.median(finite_values))) if finite_values else None


def time_split(optimizer: str, runs: Sequence[StudyRun]) -> TimeSplit:
    """Medians over the succeeded jobs: forward+backward = step time - optimizer step, paired by step."""
    succeeded = [r for r in runs if r.status == "succeeded"]
    forward_backward: list[float] = []
    optimizer_step: list[float] = []
    state: list[float] = []
    used = 0
    for run in succeeded:
        step_ms = {p.step: p.value for p in run.history.get("perf/step_time_ms", [])}
        opt_ms = {p.step: p.value for p in run.history.get("perf/optimizer_step_ms", [])}
        last_state = final_value(run.history.get("optim/state_bytes", []))
        if not (step_ms or opt_ms or last_state is not None):
            continue
        used += 1
        forward_backward += [step_ms[s] - opt_ms[s] for s in sorted(step_ms.keys() & opt_ms.keys())]
        optimizer_step += list(opt_ms.values())
        if last_state is not None:
            state.append(last_state)
    return TimeSplit(
        optimizer=optimizer,
        jobs=used,
        forward_backward_ms=median_or_none(forward_backward),
        optimizer_step_ms=median_or_none(optimizer_step),
        state_bytes=median_or_none(state),
    )


def problem_jobs(runs: Sequence[StudyRun], optimizers: list[str]) -> list[ProblemJob]:
    problems = [r for r in runs if r.status in PROBLEM_STATUSES]
    problems.sort(key=lambda r: (optimizers.index(r.optimizer), grid_sort_key(r.grid), r.seed, r.job_id))
    return [
        ProblemJob(
            job_id=r.job_id,
            optimizer=r.optimizer,
            label=grid_label(r.grid),
            seed=r.seed,
            status=r.status,
            error=r.error,
            run_id=r.run_id,
        )
        for r in problems
    ]


def notes_on(
    points: list[GridPointSummary],
    ranking: list[RankingRow],
    runs: Sequence[StudyRun],
    baseline: str | None,
    selection_metric: str,
) -> list[str]:
    """Plain sentences for what the tables cannot show on their own."""
    notes = []
    for point in points:
        c = point.counts
        if c.succeeded == 0:
            notes.append(
                f"{point.optimizer} {point.label}: no succeeded seed ({c.failed} failed, "
                f"{c.diverged} diverged, {c.cancelled} cancelled, {c.unfinished} unfinished), "
                "so no statistics."
            )
        elif (s := selection_stat(point, selection_metric)) is not None and s.n < c.succeeded:
            notes.append(
                f"{point.optimizer} {point.label}: {c.succeeded - s.n} succeeded seed(s) logged no finite "
                f"{selection_metric}."
            )
    for row in ranking:
        if row.rank is None:
            notes.append(
                f"{row.optimizer}: no grid point has a {selection_metric} result, so it is not ranked."
            )
    if baseline is not None:
        names = {r.optimizer for r in runs}
        if baseline not in names:
            notes.append(f"The baseline {baseline} has no jobs in this study: no paired comparisons.")
        elif not any(r.optimizer == baseline and r.rank is not None for r in ranking):
            notes.append(f"The baseline {baseline} has no result: no paired comparisons.")
    return notes


def instability_notes(
    points: list[GridPointSummary], optimizers: list[str], selection_metric: str, mode: Mode
) -> list[str]:
    """Where failed or diverged jobs decided, or weaken, an optimizer's best grid point."""
    notes = []
    for opt in optimizers:
        own = [p for p in points if p.optimizer == opt]
        chosen, top = pick_best(own, selection_metric, mode), best_mean(own, selection_metric, mode)
        if chosen is None or top is None:
            continue
        if top is not chosen:
            notes.append(
                f"{opt} {top.label}: a better mean final {selection_metric} over the seeds that survived "
                f"({top.counts.succeeded} of {top.counts.total}), but "
                f"{unstable_jobs(top)} of its jobs failed or diverged; {chosen.label}, "
                "where none did, was chosen."
            )
        elif unstable(chosen):
            notes.append(
                f"{opt}: at every grid point some jobs failed or diverged; its best, {chosen.label}, stands "
                f"on the {chosen.counts.succeeded} of {chosen.counts.total} seeds that survived."
            )
    return notes


MAX_SEGMENT = 60
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. ]")


def mlflow_key(text: str) -> str:
    """`text` with MLflow-safe characters only, its `/` kept as path separators (no empty or dot parts)."""
    parts = [_UNSAFE.sub("_", part).strip() for part in text.split("/")]
    return "/".join(part if part.strip(".") else part.replace(".", "_") or "_" for part in parts)


def mlflow_segments(names: Sequence[str]) -> dict[str, str]:
    """One key segment per name (its `/` replaced too, at most 60 characters, MLflow keys end at 250);
    a clash after cleaning gets a `-2`, `-3` suffix."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        segment = mlflow_key(name.replace("/", "_")[:MAX_SEGMENT])
        unique, i = segment, 2
        while unique in taken:
            unique, i = f"{segment}-{i}", i + 1
        taken.add(unique)
        out[name] = unique
    return out
