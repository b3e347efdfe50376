"""A study's statistics, computed from its jobs' metric histories (pure functions, no I/O).

Interface committed first so the `studies` branch can merge it; bodies follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

Mode = Literal["min", "max"]
GridValue = float | int | str | bool


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
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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
    seeds: list[SeedTime]
    reached: int
    not_reached: int
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
        raise NotImplementedError


class TimeSplit(_Model):
    """Where an optimizer's step time goes (medians over its succeeded jobs' logged points)."""

    optimizer: str
    jobs: int  # the jobs these figures stand on
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
        raise NotImplementedError

    def flat_metrics(self) -> dict[str, float]:
        """Finite figures for the parent MLflow run, keys with MLflow-safe characters only."""
        raise NotImplementedError


def summarize(
    runs: Sequence[StudyRun],
    *,
    target: TargetRule | None,
    baseline: str | None,
    selection_metric: str,
    selection_mode: Mode,
) -> StudySummary:
    raise NotImplementedError
