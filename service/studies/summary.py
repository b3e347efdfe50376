"""A study's statistics, computed from its jobs' metric histories and results (pure functions, no I/O).

`summarize` turns the study's `StudyRun`s (read back from the store and MLflow by the
studies core) into a `StudySummary`: per optimizer and grid point the mean, sample std and
95% Student's t interval over seeds of each `val/*` metric's final and best value, the best
grid point per optimizer, time to target per seed, the time split per optimizer, a ranking,
paired comparisons against the baseline and notes.

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
- Time to target counts, like the ranking, the jobs that succeeded: one reached the target at the
  first logged point that meets it. Any other job is listed with its status and has not reached
  it (a job that met the target and diverged later is not an optimizer that reaches it; a
  cancelled one's seconds stand on a seed the ranking leaves out), so "reached 2/2" stands on the
  same seeds as the ranking's n=2. A failed or diverged job counts as not reached; a cancelled one
  is listed and not counted (it was stopped, the optimizer did not fail to reach the target).
- Optimizers whose mean final selection metric is exactly equal share a rank (1, 2, 2, 4): the
  ranking orders means, and the order of a tie is no finding.
- An interval is cut to the values its quantity can take (`jobs.spec.METRIC_BOUNDS`: accuracy in [0, 1],
  rmse at least 0; time to target at least 0, and its steps at most the study's steps); the means
  are left as they are. The cut part cannot hold the true mean, so the interval covers it as often.
- The time split is the median over the succeeded jobs of each job's own medians over its steps
  (its result's `step_time_ms_median`, `optimizer_step_ms_median`; forward+backward is the one
  minus the other). Only for a job whose result lacks them: the medians of its perf/* points,
  which are means of flush windows, leaving out the first window (step 0's warm-up). A job that
  does not time its update apart (Keras: one compiled step) gives only the whole step's time. The
  state bytes are the best grid point's.
- Notes say what the tables cannot: an optimizer ranked on fewer seeds than the study ran (and
  what became of the others), ranked optimizers on different numbers of seeds, a single seed (no
  interval), seeds that changed nothing (by the trained parameters' hash, or every final train/
  and val/ value: never the selection metric alone), a succeeded job whose selection metric ended
  worse than its first evaluation by more than WORSE_MARGIN, a job interrupted after it ran steps
  (as its attempts went: resumed from a checkpoint or from the start in the same MLflow run, its
  seconds including the time it was down; started afresh in a new run, its seconds from that start;
  or ended failed), and
  a best grid value at the edge of its axis, and timings disturbed by machine load (forward+backward,
  the same for every optimizer, more than LOAD_RATIO apart between them). Notes never change which
  point is best.
- JSON holds no NaN or infinity: an undefined figure is None (and the models refuse
  non-finite floats).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from jobs.spec import metric_bounds

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


# What the ranking can and cannot say, shown with it by the report and by `optlab study --wait`
# (here, not in report.py, so the CLI need not import matplotlib to print one sentence).
RANKING_CAVEAT = (
    "Each best grid point is chosen on the same seeds its figures report, so a best point's figures "
    "are optimistic, the more so the larger its grid; the ranking orders means, and only a paired "
    "comparison says whether a difference is significant."
)

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
    # From the job row (None where unknown: a job that never ran, a result without them):
    step_time_ms_median: float | None = None  # the job's own median over its steps (jobs/result.py)
    optimizer_step_ms_median: float | None = None
    attempt: int = 1  # the attempts it ran
    # The step an earlier attempt reached before it was cut short (its worker stopped, its process was
    # killed): this one resumed from there, in the same run. None: no earlier attempt ran a step.
    interrupted_at: int | None = None
    # The checkpoint step its last attempt started from (0: from the start), in the same MLflow run;
    # None where it did not resume or its result does not say (a job that ended without writing one).
    resumed_from: int | None = None
    # True where its result says its last attempt resumed nothing: with no checkpoint to resume from it
    # trained from step 0 in a new MLflow run, its seconds counted from that run's start.
    new_run: bool = False
    # False where its driver times the whole step as the optimizer step (Keras compiles the gradients
    # and the update into one graph: jobs/frameworks/keras_driver.py `train_step`).
    update_timed_apart: bool = True
    params_sha256: str | None = None  # the trained parameters' hash, from its result


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
    reached: int  # succeeded jobs that met it
    not_reached: int  # ended jobs that did not reach it: succeeded, failed or diverged (not cancelled)
    pending: int  # queued or running jobs
    steps: Stat  # over the seeds that reached it
    seconds: Stat
    # the jobs that could reach it, the ranking's seeds: "reached 2/2" (None: recorded before it was)
    succeeded: int | None = None


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
    """Where an optimizer's step time goes: medians over its succeeded jobs of each job's own medians."""

    optimizer: str
    jobs: int  # the jobs these figures stand on
    forward_backward_ms: float | None  # median over jobs of (step time median - optimizer step median)
    optimizer_step_ms: float | None  # median over jobs of the optimizer step median
    # median over the best grid point's jobs of the last optim/state_bytes, and that point's label
    state_bytes: float | None
    state_label: str | None = None
    step_ms: float | None = None  # median over jobs of the whole step's time median
    # False where no job timed its update apart from forward+backward (Keras: one compiled step):
    # there is then only the whole step's time, and the two figures above are None.
    split_measured: bool = True


class RankingRow(_Model):
    """One optimizer at its best grid point; rank None when no grid point has a result, and equal
    means share a rank (1, 2, 2, 4)."""

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
    # Steps between evaluations, where time to target on a val/* metric is measured (the study's
    # `eval_every`); None when unknown. A default: summaries recorded before it validate as they are.
    eval_every: int | None = None
    steps: int | None = None  # the study's steps per job; None when unknown

    def best_grid_point(self, optimizer: str) -> GridPointSummary | None:
        row = next((r for r in self.ranking if r.optimizer == optimizer), None)
        if row is None or row.label is None:
            return None
        return next(p for p in self.grid_points if p.optimizer == optimizer and p.label == row.label)

    def flat_metrics(self) -> dict[str, float]:
        """Finite figures for the parent MLflow run, keys with MLflow-safe characters only.

        `summary/study/...` for the job counts; per optimizer `rank`, `jobs_failed`,
        `jobs_diverged`, `jobs_cancelled`, at its best grid point `<metric>_final_mean` (and `_std`,
        `_ci_low`, `_ci_high`, `_n`, `_best_mean`) and `target_*`, the time split (`step_ms`, and
        where measured `forward_backward_ms`, `optimizer_step_ms`) and `vs_<baseline>/*`, all under
        `summary/<optimizer>/`; every grid point's final means under `summary/<optimizer>/grid/<label>/`
        (one segment per label: see `mlflow_segments`). None is left out.
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
            put(f"{base}/jobs_cancelled", row.jobs.cancelled)
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
            put(f"{base}/step_ms", split.step_ms)
            put(f"{base}/state_bytes", split.state_bytes)
        for c in self.comparisons:
            base = f"summary/{names[c.optimizer]}/vs_{names.get(c.baseline, mlflow_key(c.baseline))}"
            put(f"{base}/mean_difference", c.mean_difference)
            put(f"{base}/ci_low", c.ci_low)
            put(f"{base}/ci_high", c.ci_high)
            put(f"{base}/p_value", c.p_value)
            put(f"{base}/n", c.n)
        labels = {
            opt: mlflow_segments([p.label for p in self.grid_points if p.optimizer == opt])
            for opt in self.optimizers
        }
        for point in self.grid_points:
            base = f"summary/{names[point.optimizer]}/grid/{labels[point.optimizer][point.label]}"
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
    steps: int | None = None,
    eval_every: int | None = None,
) -> StudySummary:
    """The study's statistics from its runs (any status; see the module docstring for the rules).
    `steps`, `eval_every`: the study's, where time to target is cut and measured."""
    target_model = (
        None if target is None else Target(metric=target.metric, mode=target.mode, value=target.value)
    )
    optimizers = list(dict.fromkeys(run.optimizer for run in runs))
    points = [
        summarize_grid_point(
            group,
            target=target,
            selection_metric=selection_metric,
            selection_mode=selection_mode,
            steps=steps,
        )
        for group in group_by_grid_point(runs, optimizers)
    ]
    ranking = rank(points, runs, optimizers, selection_metric, selection_mode)
    notes = [
        *notes_on(points, ranking, runs, baseline, selection_metric),
        *instability_notes(points, optimizers, selection_metric, selection_mode),
        *seed_count_notes(ranking, runs, selection_metric),
        *identical_seeds_notes(runs, optimizers),
        *worse_than_first_notes(runs, optimizers, selection_metric, selection_mode),
        *resumed_notes(runs),
        *edge_notes(points, ranking),
    ]
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
        time_split=[
            time_split(opt, [r for r in runs if r.optimizer == opt], row.label)
            for opt, row in zip(optimizers, ranking_by_optimizer(ranking, optimizers), strict=True)
        ],
        problems=problem_jobs(runs, optimizers),
        notes=notes,
        eval_every=eval_every,
        steps=steps,
    )
    comparisons = compare_to_baseline(summary, runs) if baseline in optimizers else []
    load_note = machine_load_note(summary.time_split)
    return summary.model_copy(
        update={"comparisons": comparisons, "notes": [*notes, *([load_note] if load_note else [])]}
    )


def ranking_by_optimizer(ranking: list[RankingRow], optimizers: list[str]) -> list[RankingRow]:
    """The ranking's rows in the order of `optimizers` (every optimizer has one)."""
    rows = {row.optimizer: row for row in ranking}
    return [rows[opt] for opt in optimizers]


def first_line(error: str) -> str:
    """A stored error's first line (`Type: message`), what a reader needs: a validation error's
    detail follows it on lines of its own."""
    return error.strip().split("\n", 1)[0]


def direction_of(metric: str) -> Mode:
    """Which way `metric` improves, from METRIC_DIRECTIONS by the key's last part; min by default."""
    return METRIC_DIRECTIONS.get(metric.rsplit("/", 1)[-1], DEFAULT_DIRECTION)


def describe(
    stat_values: Iterable[float], *, at_least: float | None = None, at_most: float | None = None
) -> Stat:
    """Mean, sample std (ddof=1) and the 95% Student's t interval of the mean of finite values.

    `at_least`, `at_most`: what the quantity cannot go below or above (steps, seconds, accuracy):
    the interval is cut there, the mean left as it is. With few seeds and a wide spread it reached
    below 0 ("-38 to 89 steps") or above 1 (accuracy); the cut part cannot hold the true mean, so
    the interval still covers it as often."""
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
    high = mean + half if at_most is None else min(mean + half, at_most)
    return Stat(n=n, mean=finite(mean), std=finite(std), ci_low=finite(low), ci_high=finite(high))


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
    runs: list[StudyRun],
    *,
    target: TargetRule | None,
    selection_metric: str,
    selection_mode: Mode,
    steps: int | None = None,
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
        low, high = metric_bounds(name)
        metrics.append(
            MetricStats(
                metric=name,
                direction=mode,
                final=describe(finals, at_least=low, at_most=high),
                best=describe(bests, at_least=low, at_most=high),
            )
        )
    first = runs[0]
    return GridPointSummary(
        optimizer=first.optimizer,
        grid=dict(sorted(first.grid.items())),
        label=grid_label(first.grid),
        counts=count_jobs(runs),
        seeds=sorted(run.seed for run in succeeded),
        metrics=metrics,
        time_to_target=None if target is None else time_to_target(runs, target, steps=steps),
    )


def meets(value: float, target: TargetRule) -> bool:
    if not math.isfinite(value):
        return False
    return value <= target.value if target.mode == "min" else value >= target.value


def time_to_target(runs: list[StudyRun], target: TargetRule, *, steps: int | None = None) -> TimeToTarget:
    """Per job, the first logged point (by step) that meets the target; only a job that succeeded can
    have reached it (see the module docstring). `steps`: the study's steps per job, where the
    interval of the steps is cut."""
    seeds = []
    for run in runs:
        points = run.history.get(target.metric, []) if run.status == "succeeded" else []
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
        # a cancelled job is listed, not counted: it stopped before the optimizer could reach the target
        not_reached=sum(1 for s in seeds if not s.reached and s.status in ENDED - {"cancelled"}),
        pending=sum(1 for s in seeds if s.status not in ENDED),
        succeeded=sum(1 for s in seeds if s.status == "succeeded"),
        steps=describe((float(s.step) for s in reached if s.step is not None), at_least=0.0, at_most=steps),
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
    # Standard competition ranking (1, 2, 2, 4): exactly equal means share the rank of the first of
    # them, as the order within a tie is only the order the optimizers were listed in.
    means = [r.selection.mean for r in ranked]  # type: ignore[union-attr]
    ranks = [means.index(mean) + 1 for mean in means]
    return [r.model_copy(update={"rank": k}) for r, k in zip(ranked, ranks, strict=True)] + unranked


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


def time_split(optimizer: str, runs: Sequence[StudyRun], best_label: str | None) -> TimeSplit:
    """Medians over the succeeded jobs of each job's own medians: one figure per job, so a job that
    logged more flush windows (a slow one: they close every second) weighs no more than another.

    Forward+backward and the optimizer step only from jobs that time the update apart (a Keras job
    times its whole compiled step as the optimizer's: its "forward+backward" read ~0.007 ms). The
    state bytes at the best grid point only: grid points hold different state (momentum 0 or not),
    and a median over them (of 0, 0, 35880, 35880: 17940) was a figure no job had."""
    succeeded = [run for run in runs if run.status == "succeeded"]
    step: list[float] = []
    forward_backward: list[float] = []
    optimizer_step: list[float] = []
    used = 0
    for run in succeeded:
        step_ms, opt_ms = job_step_medians(run)
        if (
            step_ms is None
            and opt_ms is None
            and final_value(run.history.get("optim/state_bytes", [])) is None
        ):
            continue
        used += 1
        if step_ms is not None:
            step.append(step_ms)
        if not run.update_timed_apart:
            continue
        if step_ms is not None and opt_ms is not None:
            forward_backward.append(step_ms - opt_ms)
        if opt_ms is not None:
            optimizer_step.append(opt_ms)
    at_best = [run for run in succeeded if best_label is not None and grid_label(run.grid) == best_label]
    state = [v for run in at_best if (v := final_value(run.history.get("optim/state_bytes", []))) is not None]
    return TimeSplit(
        optimizer=optimizer,
        jobs=used,
        step_ms=median_or_none(step),
        split_measured=not succeeded or any(run.update_timed_apart for run in succeeded),
        forward_backward_ms=median_or_none(forward_backward),
        optimizer_step_ms=median_or_none(optimizer_step),
        state_bytes=median_or_none(state),
        state_label=best_label if state else None,
    )


# How far apart the optimizers' forward+backward may be before the timings are said to be disturbed: the
# same model and batch for each, it moves with the machine's load only (the service probe saw 27 ms a
# step for one optimizer and 13 ms for adam, on a machine shared with other work).
LOAD_RATIO = 1.5


def machine_load_note(splits: Sequence[TimeSplit]) -> str | None:
    """A note where the optimizers' forward+backward medians differ by more than LOAD_RATIO: the part of a
    step an optimizer does not change moved with the machine's load, which then weighed on the seconds
    and step times of some optimizers more than others. None where it did not, or fewer than two
    optimizers timed it (a Keras job does not time it apart)."""
    timed = [s for s in splits if s.forward_backward_ms is not None and s.forward_backward_ms > 0]
    if len(timed) < 2:
        return None
    fastest = min(timed, key=lambda s: s.forward_backward_ms or 0.0)
    slowest = max(timed, key=lambda s: s.forward_backward_ms or 0.0)
    low, high = fastest.forward_backward_ms or 0.0, slowest.forward_backward_ms or 0.0
    if high <= LOAD_RATIO * low:
        return None
    return (
        f"Timings were disturbed by machine load: forward+backward, the part of a step the optimizer does "
        f"not change, took {high:.3g} ms a step for {slowest.optimizer} and {low:.3g} ms for "
        f"{fastest.optimizer} ({high / low:.1f}x), so the seconds to target and the step times do not "
        "compare the optimizers fairly in this study: compare steps to target, or run it again on a "
        "quieter machine (unless an optimizer asks for more of that part, backward(create_graph=True) "
        "or a closure, whose cost is its own)."
    )


def job_step_medians(run: StudyRun) -> tuple[float | None, float | None]:
    """A job's median step time and optimizer step time (ms): its result's, over every step it took.

    Only where the result lacks them, the medians of its perf/* points without the first: a point is
    the mean of a flush window, and the first window is step 0 alone, its warm-up (compilation,
    allocation: 30-200 ms against a few ms a step)."""
    if run.step_time_ms_median is not None and run.optimizer_step_ms_median is not None:
        return finite(run.step_time_ms_median), finite(run.optimizer_step_ms_median)
    return (
        median_or_none([p.value for p in ordered_points(run.history.get("perf/step_time_ms", []))[1:]]),
        median_or_none([p.value for p in ordered_points(run.history.get("perf/optimizer_step_ms", []))[1:]]),
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


def seed_count_notes(ranking: list[RankingRow], runs: Sequence[StudyRun], selection_metric: str) -> list[str]:
    """Where the ranking stands on fewer seeds than the study ran, or on different numbers of seeds:
    a mean over two seeds ranked beside one over five reads as the same kind of figure, and is not."""
    seeds_run = sorted({run.seed for run in runs})
    if len(seeds_run) == 1:
        return [
            f"One seed only (seed {seeds_run[0]}): there is no confidence interval, and the ranking orders "
            "single runs, which cannot tell an optimizer's difference from a seed's."
        ]
    ranked = [(row, row.selection.n) for row in ranking if row.rank is not None and row.selection is not None]
    notes = []
    for row, n in ranked:
        if n < len(seeds_run):
            point_runs = [r for r in runs if r.optimizer == row.optimizer and grid_label(r.grid) == row.label]
            notes.append(
                f"{row.optimizer} {row.label}: ranked on {n} of the {len(seeds_run)} seeds run "
                f"({seed_fates(point_runs, seeds_run, selection_metric)})."
            )
    if len({n for _, n in ranked}) > 1:
        counts = ", ".join(f"{row.optimizer} n={n}" for row, n in ranked)
        notes.append(
            f"The ranked optimizers stand on different numbers of seeds ({counts}): their means are not "
            "equally certain, and a seed that failed or was cancelled may have been a hard one."
        )
    return notes


def seed_fates(runs: Sequence[StudyRun], seeds_run: list[int], metric: str) -> str:
    """What became of each seed run that a grid point's statistics lack: `seed 2 cancelled, seed 3 failed`."""
    fates = []
    for seed in seeds_run:
        own = sorted((r for r in runs if r.seed == seed), key=lambda r: r.job_id)
        if any(r.status == "succeeded" and final_value(r.history.get(metric, [])) is not None for r in own):
            continue
        if not own:
            fates.append(f"seed {seed} not run here")
        elif own[0].status == "succeeded":
            fates.append(f"seed {seed} succeeded but logged no finite {metric}")
        else:
            fates.append(f"seed {seed} {own[0].status}")
    return ", ".join(fates)


def edge_notes(points: list[GridPointSummary], ranking: list[RankingRow]) -> list[str]:
    """Where an optimizer's best value of a numeric grid axis (of three values or more: with two, every
    best is at an edge) is the largest or smallest it tried: the optimum may lie past it."""
    notes = []
    for row in ranking:
        if row.grid is None:
            continue
        own = [p for p in points if p.optimizer == row.optimizer]
        for key, value in row.grid.items():
            tried = sorted({v for p in own if is_number(v := p.grid.get(key))})  # type: ignore[type-var]
            if len(tried) < 3 or not is_number(value) or value not in (tried[0], tried[-1]):
                continue
            end = "largest" if value == tried[-1] else "smallest"
            notes.append(
                f"{row.optimizer}: its best {key}, {format_value(value)}, is the {end} tried "
                f"({format_value(tried[0])} to {format_value(tried[-1])}): the grid may not contain "
                "the optimum."
            )
    return notes


def is_number(value: GridValue) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def same_outcome(runs: Sequence[StudyRun]) -> bool:
    """Whether runs ended the same: equal trained parameters where every result has their hash, else
    the same final value of every train/ and val/ metric. Never the selection metric alone: a coarse
    accuracy (333 of 360 on both seeds) is equal on runs whose losses and parameters differ."""
    hashes = {run.params_sha256 for run in runs}
    if None not in hashes:
        return len(hashes) == 1
    keys = {key for run in runs for key in run.history if key.startswith(("train/", "val/"))}
    return bool(keys) and all(
        len({final_value(run.history.get(key, [])) for run in runs}) == 1 for key in keys
    )


def identical_seeds_notes(runs: Sequence[StudyRun], optimizers: list[str]) -> list[str]:
    """Seeds that changed nothing (a deterministic workload, such as `quadratic`): every interval is
    then of width 0, which reads as certainty and is only the absence of anything that varies."""
    succeeded = [
        [run for run in group if run.status == "succeeded"] for group in group_by_grid_point(runs, optimizers)
    ]
    groups = [group for group in succeeded if len({run.seed for run in group}) >= 2]
    if not groups or not all(same_outcome(group) for group in groups):
        return []
    hashed = all(run.params_sha256 is not None for group in groups for run in group)
    evidence = (
        "the same trained parameters (params_sha256)"
        if hashed
        else "the same final value of every train/ and val/ metric"
    )
    return [
        f"The seeds gave identical results: at every grid point with two or more seeds, every seed ended "
        f"with {evidence}, so intervals of width 0 say nothing about the spread to expect (the workload "
        "does not depend on the seed)."
    ]


# How much worse than its first evaluation a job's last must be to be noted: 1% of the metric's range
# where it has one (accuracy: 0.01, 3.6 of 360 validation examples), else 1% of the first value. Less
# is an evaluation's noise: one image of 360 (0.9861 -> 0.9833) is no blow-up.
WORSE_MARGIN = 0.01


def worse(value: float, than: float, mode: Mode) -> bool:
    return value > than if mode == "min" else value < than


def worse_margin(metric: str, first: float) -> float:
    """How far past its first value `metric` must end to count as worse (see WORSE_MARGIN)."""
    low, high = metric_bounds(metric)
    if low is not None and high is not None:
        return WORSE_MARGIN * (high - low)
    return WORSE_MARGIN * abs(first)


def margin_text(metric: str) -> str:
    low, high = metric_bounds(metric)
    if low is not None and high is not None:
        return f"by more than {WORSE_MARGIN * (high - low):g}"
    return f"by more than {WORSE_MARGIN:.0%} of the first"


def worse_than_first_notes(
    runs: Sequence[StudyRun], optimizers: list[str], selection_metric: str, mode: Mode
) -> list[str]:
    """Succeeded jobs whose selection metric ended worse than its first evaluation: a finite blow-up
    (sgd at lr=1000: val/loss 2.3 then 2853, accuracy at chance) is no divergence to the job runner,
    which stops only at a non-finite loss, so its status stays `succeeded`."""
    notes = []
    for group in group_by_grid_point(runs, optimizers):
        ends = [
            (run.seed, *first_and_final(run, selection_metric)) for run in group if run.status == "succeeded"
        ]
        pairs = [
            (seed, first, final) for seed, first, final in ends if first is not None and final is not None
        ]
        bad = [
            (seed, first, final)
            for seed, first, final in pairs
            if worse(final, first, mode) and abs(final - first) > worse_margin(selection_metric, first)
        ]
        if bad:
            shown = ", ".join(f"seed {seed}: {first:.4g} -> {final:.4g}" for seed, first, final in bad)
            notes.append(
                f"{group[0].optimizer} {grid_label(group[0].grid)}: {selection_metric} ended worse than its "
                f"first evaluation ({margin_text(selection_metric)}) in {len(bad)} of {len(pairs)} seeds "
                f"({shown})."
            )
    return notes


def first_and_final(run: StudyRun, metric: str) -> tuple[float | None, float | None]:
    """The first finite and the last logged value of `metric` (None where missing or not finite)."""
    points = ordered_points(run.history.get(metric, []))
    first = next((float(p.value) for p in points if math.isfinite(p.value)), None)
    return first, final_value(points)


def resumed_notes(runs: Sequence[StudyRun]) -> list[str]:
    """Jobs that ran again after an earlier attempt had run steps, as their attempts went: resumed from a
    checkpoint only where the last attempt did, and a job that then did not succeed said so (it read as
    resumed and fine). An attempt that ran no step, one whose MLflow server did not answer as it
    started, leaves nothing."""
    return [
        resumed_note(run) for run in sorted(runs, key=lambda r: r.job_id) if run.interrupted_at is not None
    ]


def resumed_note(run: StudyRun) -> str:
    """One job's interruption: how it ran again and how it ended. Its points' seconds count from its
    MLflow run's start: resumed in the same run, its time to target and its curves against time include
    the time it was down; started afresh in a new run (no checkpoint yet), they count from the new
    start and the interrupted attempt's time is not in them (it had read "ran again ...: its seconds
    include the time it was down" for a job that started over at step 0 in a new run)."""
    who = f"job {run.job_id} ({run.optimizer} {grid_label(run.grid)} seed={run.seed})"
    fresh = run.status == "succeeded" and run.resumed_from is None and run.new_run
    if run.resumed_from:
        again = f"resumed from its checkpoint of step {run.resumed_from}"
    elif run.resumed_from == 0:
        again = "ran again from the start in the same MLflow run"
    elif fresh:
        again = "ran again from the start in a new MLflow run"
    else:
        again = "ran again"
    interrupted = f"was interrupted at step {run.interrupted_at} and {again} (attempt {run.attempt})"
    if fresh:
        return (
            f"{who} {interrupted}: its seconds count from that run's start, the interrupted attempt's "
            "time not in them."
        )
    if run.status == "succeeded":
        return f"{who} {interrupted}: its seconds include the time it was down."
    return f"{who} {interrupted}, then ended {run.status}: it is left out of the statistics."


MAX_SEGMENT = 60
HASH_CHARS = 8


def cut_segment(text: str) -> str:
    """`text` if it fits in MAX_SEGMENT, else its start and `-` plus the first hex digits of its
    sha256: the same text gives the same key in every study, whatever other names it has."""
    if len(text) <= MAX_SEGMENT:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]
    return f"{text[: MAX_SEGMENT - HASH_CHARS - 1]}-{digest}"


_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. ]")


def mlflow_key(text: str) -> str:
    """`text` with MLflow-safe characters only, its `/` kept as path separators (no empty or dot parts)."""
    parts = [_UNSAFE.sub("_", part).strip() for part in text.split("/")]
    return "/".join(part if part.strip(".") else part.replace(".", "_") or "_" for part in parts)


def mlflow_segments(names: Sequence[str]) -> dict[str, str]:
    """One key segment per name (its `/` replaced too, at most 60 characters, MLflow keys end at 250);
    a clash after cleaning gets a `-2`, `-3` suffix.

    A longer name is cut and ends in a short hash of the whole: two grid labels that differ only past
    the cut (`... weight_decay=0.001`, `... weight_decay=0.9`) kept one key, and the second point's
    figures overwrote the first's in the parent run."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        segment = mlflow_key(cut_segment(name.replace("/", "_")))
        unique, i = segment, 2
        while unique in taken:
            unique, i = f"{segment}-{i}", i + 1
        taken.add(unique)
        out[name] = unique
    return out
