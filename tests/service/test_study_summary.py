"""The study statistics (service/studies/summary.py) against hand-computed figures.

Small fixed numbers: three seeds whose mean and sample std are known by heart, the 95%
interval from the textbook t quantile (4.303 for two degrees of freedom) and from scipy
called here independently, paired t-tests checked against scipy.stats.ttest_rel.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats  # type: ignore[import-untyped]

from service.studies.summary import (
    GridValue,
    MetricPoint,
    Stat,
    StudyRun,
    StudySummary,
    TargetRule,
    describe,
    direction_of,
    grid_label,
    summarize,
)
from tests.conftest import ROOT

T_2 = 4.302652729749462  # two-sided 95% Student's t quantile, 2 degrees of freedom (textbook 4.303)


def points(values: Sequence[float], *, every: int = 10, seconds_per_step: float = 0.5) -> list[MetricPoint]:
    """Points at steps every, 2*every, ...; seconds grow linearly with the step."""
    return [
        MetricPoint(step=every * (i + 1), seconds=every * (i + 1) * seconds_per_step, value=v)
        for i, v in enumerate(values)
    ]


def make_run(
    job_id: int,
    optimizer: str,
    seed: int,
    *,
    grid: dict[str, GridValue] | None = None,
    status: str = "succeeded",
    error: str | None = None,
    **history: list[MetricPoint],
) -> StudyRun:
    """A run; history keys use `__` for `/` (val__loss -> val/loss)."""
    return StudyRun(
        job_id=job_id,
        optimizer=optimizer,
        grid={"lr": 1e-3} if grid is None else grid,
        seed=seed,
        status=status,
        history={key.replace("__", "/"): value for key, value in history.items()},
        run_id=f"run{job_id}",
        error=error,
    )


def study(finals: dict[tuple[str, float], Sequence[float]], metric: str = "val/loss") -> list[StudyRun]:
    """One succeeded run per seed with the given final values (after a worse first point)."""
    runs: list[StudyRun] = []
    for (opt, lr), values in finals.items():
        for seed, final in enumerate(values):
            runs.append(
                StudyRun(
                    job_id=len(runs) + 1,
                    optimizer=opt,
                    grid={"lr": lr},
                    seed=seed,
                    status="succeeded",
                    history={metric: points([final + 1.0, final])},
                )
            )
    return runs


def summary_of(runs: list[StudyRun], **kwargs: object) -> StudySummary:
    options: dict[str, object] = {
        "target": None,
        "baseline": None,
        "selection_metric": "val/loss",
        "selection_mode": "min",
    }
    options.update(kwargs)
    return summarize(runs, **options)  # type: ignore[arg-type]


# --- statistics -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "n", "mean", "std", "half"),
    [
        ([], 0, None, None, None),
        ([5.0], 1, 5.0, None, None),
        ([1.0, 2.0, 3.0], 3, 2.0, 1.0, T_2 / math.sqrt(3)),
        ([0.5, 0.6, 0.7], 3, 0.6, 0.1, T_2 * 0.1 / math.sqrt(3)),
        ([2.0, 4.0], 2, 3.0, math.sqrt(2.0), 12.706204736174698 * math.sqrt(2.0) / math.sqrt(2)),
        ([1.0, float("nan"), 3.0, float("inf")], 2, 2.0, math.sqrt(2.0), 12.706204736174698),
    ],
)
def test_describe_matches_hand_computed_mean_std_and_t_interval(
    values: list[float], n: int, mean: float | None, std: float | None, half: float | None
) -> None:
    stat = describe(values)
    assert stat.n == n
    assert stat.mean == pytest.approx(mean)
    assert stat.std == pytest.approx(std)
    if half is None:
        assert stat.ci_low is None and stat.ci_high is None
    else:
        assert stat.ci_low == pytest.approx(mean - half)  # type: ignore[operator]
        assert stat.ci_high == pytest.approx(mean + half)  # type: ignore[operator]


def test_the_interval_uses_students_t_from_scipy_and_the_textbook_value() -> None:
    stat = describe([1.0, 2.0, 3.0])
    assert stat.ci_high is not None and stat.mean is not None
    assert (stat.ci_high - stat.mean) * math.sqrt(3) == pytest.approx(stats.t.ppf(0.975, 2))
    assert (stat.ci_high - stat.mean) * math.sqrt(3) == pytest.approx(4.303, abs=5e-4)


@pytest.mark.parametrize(
    ("metric", "direction"),
    [
        ("val/loss", "min"),
        ("train/loss", "min"),
        ("val/rmse", "min"),
        ("val/bits_per_char", "min"),
        ("val/accuracy", "max"),
        ("val/something_new", "min"),  # the documented default
    ],
)
def test_metric_directions_come_from_the_table(metric: str, direction: str) -> None:
    assert direction_of(metric) == direction


def test_final_is_the_last_point_and_best_the_minimum_over_seeds() -> None:
    runs = [
        make_run(1, "sgd", 0, val__loss=points([1.0, 0.4, 0.5])),  # best 0.4, final 0.5
        make_run(2, "sgd", 1, val__loss=points([1.0, 0.6, 0.6])),
        # logged out of order: the last point is the one with the highest step
        make_run(3, "sgd", 2, val__loss=[MetricPoint(30, 3.0, 0.7), MetricPoint(10, 1.0, 0.2)]),
    ]
    metric = summary_of(runs).grid_points[0].metric("val/loss")
    assert metric is not None and metric.direction == "min"
    assert metric.final.mean == pytest.approx(0.6) and metric.final.std == pytest.approx(0.1)
    assert metric.final.n == 3
    assert metric.best.mean == pytest.approx((0.4 + 0.6 + 0.2) / 3)


def test_accuracy_best_is_the_maximum() -> None:
    runs = [make_run(1, "sgd", 0, val__accuracy=points([0.5, 0.9, 0.8]))]
    metric = (
        summary_of(runs, selection_metric="val/accuracy", selection_mode="max")
        .grid_points[0]
        .metric("val/accuracy")
    )
    assert metric is not None and metric.final.mean == 0.8 and metric.best.mean == 0.9


# --- best grid point and ranking --------------------------------------------------------

FINALS: dict[tuple[str, float], Sequence[float]] = {
    ("lion", 1e-4): [0.50, 0.60, 0.70],  # mean 0.6
    ("lion", 3e-4): [0.30, 0.40, 0.50],  # mean 0.4
    ("adamw", 1e-3): [0.45, 0.45, 0.48],  # mean 0.46
    ("adamw", 3e-3): [0.90, 0.80, 0.70],  # mean 0.8
}


@pytest.mark.parametrize(
    ("mode", "best", "order"),
    [
        ("min", {"lion": "lr=0.0003", "adamw": "lr=0.001"}, ["lion", "adamw"]),
        ("max", {"lion": "lr=0.0001", "adamw": "lr=0.003"}, ["adamw", "lion"]),
    ],
)
def test_best_grid_point_and_ranking_follow_the_selection_mode(
    mode: str, best: dict[str, str], order: list[str]
) -> None:
    runs = study(FINALS, metric="val/score")
    summary = summary_of(runs, selection_metric="val/score", selection_mode=mode)
    for opt, label in best.items():
        point = summary.best_grid_point(opt)
        assert point is not None and point.label == label
    assert [row.optimizer for row in summary.ranking] == order
    assert [row.rank for row in summary.ranking] == [1, 2]
    top = summary.ranking[0]
    assert top.selection is not None and top.selection.n == 3
    expected = {("min", "lion"): 0.4, ("max", "adamw"): 0.8}[(mode, top.optimizer)]
    assert top.selection.mean == pytest.approx(expected)
    # the selection metric's best value follows the selection mode too (each run: final + 1, then final)
    point = summary.best_grid_point(top.optimizer)
    assert point is not None and (metric := point.metric("val/score")) is not None
    assert metric.direction == mode
    assert metric.best.mean == pytest.approx(expected if mode == "min" else expected + 1.0)


def test_a_rate_where_seeds_diverged_is_not_best_for_its_survivor() -> None:
    """A at lr=0.1: 2 of 3 seeds diverged, the survivor scored 0.95; it had been A's best point and
    ranked first above B's 0.921 over three seeds, with no note."""
    runs = study({("a", 0.01): [0.90, 0.90, 0.90], ("b", 0.01): [0.92, 0.921, 0.922]}, "val/accuracy")
    runs += study({("a", 0.1): [0.95]}, "val/accuracy")
    for seed in (1, 2):
        runs.append(make_run(len(runs) + 1, "a", seed, grid={"lr": 0.1}, status="diverged", error="nan"))
    summary = summary_of(runs, selection_metric="val/accuracy", selection_mode="max")
    best = summary.best_grid_point("a")
    assert best is not None and best.label == "lr=0.01"
    assert [row.optimizer for row in summary.ranking] == ["b", "a"]
    assert (
        "a lr=0.1: a better mean final val/accuracy over the seeds that survived (1 of 3), but 2 of its "
        "jobs failed or diverged; lr=0.01, where none did, was chosen." in summary.notes
    )
    # Where every point had a job fail or diverge, the best of them is chosen, and a note says on what.
    only_unstable = [r for r in runs if r.optimizer == "a" and r.grid == {"lr": 0.1}]
    alone = summary_of(only_unstable, selection_metric="val/accuracy", selection_mode="max")
    assert alone.best_grid_point("a") is not None and alone.ranking[0].rank == 1
    assert (
        "a: at every grid point some jobs failed or diverged; its best, lr=0.1, stands on the 1 of 3 "
        "seeds that survived." in alone.notes
    )


def test_grid_points_are_ordered_numerically_whatever_the_run_order() -> None:
    runs = study({("sgd", 0.1): [1.0], ("sgd", 0.01): [2.0], ("sgd", 1.0): [3.0]})
    forwards = summary_of(runs)
    backwards = summary_of(list(reversed(runs)))
    assert [p.label for p in forwards.grid_points] == ["lr=0.01", "lr=0.1", "lr=1"]
    assert forwards.model_dump_json() == backwards.model_dump_json()


# --- time to target ---------------------------------------------------------------------


def test_time_to_target_per_seed_reached_and_not_reached() -> None:
    runs = [
        make_run(1, "sgd", 0, val__loss=points([0.9, 0.7, 0.4, 0.3], seconds_per_step=0.5)),  # step 30, 15 s
        make_run(2, "sgd", 1, val__loss=points([0.9, 0.5, 0.6], seconds_per_step=0.2)),  # step 20 (== target)
        make_run(3, "sgd", 2, val__loss=points([0.9, 0.8, 0.7])),  # not reached
        make_run(4, "sgd", 3, status="diverged", error="nan", val__loss=points([0.45, float("nan")])),
        make_run(5, "sgd", 4, status="running", val__loss=points([0.9])),
    ]
    summary = summary_of(runs, target=TargetRule(metric="val/loss", mode="min", value=0.5))
    ttt = summary.grid_points[0].time_to_target
    assert ttt is not None
    by_seed = {s.seed: s for s in ttt.seeds}
    assert (by_seed[0].reached, by_seed[0].step, by_seed[0].seconds) == (True, 30, 15.0)
    assert (by_seed[1].reached, by_seed[1].step, by_seed[1].seconds) == (True, 20, 4.0)
    assert (by_seed[2].reached, by_seed[2].step, by_seed[2].seconds) == (False, None, None)
    # a job that met the target and then diverged is not one that reached it (a point where two of
    # three seeds diverged had read "reached 3/3"); it is counted as not reached, its status kept
    assert (by_seed[3].reached, by_seed[3].step, by_seed[3].status) == (False, None, "diverged")
    assert (ttt.reached, ttt.not_reached, ttt.pending) == (2, 2, 1)
    assert ttt.steps.n == 2 and ttt.steps.mean == pytest.approx(25.0)
    assert ttt.seconds.mean == pytest.approx((15.0 + 4.0) / 2)
    # Two seeds 10 steps apart: the t interval, 25 -+ 63.5, is cut at 0, where a time cannot go.
    half = stats.t.ppf(0.975, 1) * np.std([30, 20], ddof=1) / math.sqrt(2)
    assert (ttt.steps.ci_low, ttt.steps.ci_high) == (0.0, pytest.approx(25.0 + half))
    assert ttt.seconds.ci_low == 0.0
    assert summary.ranking[0].target_reached == 2


def test_time_to_target_in_max_mode() -> None:
    runs = [make_run(1, "sgd", 0, val__accuracy=points([0.5, 0.94, 0.95, 0.9]))]
    summary = summary_of(
        runs,
        target=TargetRule(metric="val/accuracy", mode="max", value=0.95),
        selection_metric="val/accuracy",
        selection_mode="max",
    )
    ttt = summary.grid_points[0].time_to_target
    assert ttt is not None and ttt.seeds[0].step == 30 and ttt.reached == 1


def test_no_target_no_time_to_target() -> None:
    assert summary_of(study({("sgd", 0.1): [1.0]})).grid_points[0].time_to_target is None


# --- paired comparison ------------------------------------------------------------------


def paired_study(mine: Sequence[float], base: Sequence[float]) -> StudySummary:
    runs = study({("lion", 1e-4): mine, ("adamw", 1e-3): base})
    return summary_of(runs, baseline="adamw")


def test_paired_comparison_with_three_seeds_matches_scipy() -> None:
    mine, base = [0.40, 0.52, 0.47], [0.50, 0.55, 0.60]
    (c,) = paired_study(mine, base).comparisons
    diffs = [a - b for a, b in zip(mine, base, strict=True)]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert (c.optimizer, c.baseline, c.n, c.seeds) == ("lion", "adamw", 3, [0, 1, 2])
    assert c.mean_difference == pytest.approx(mean)
    assert c.ci_low == pytest.approx(mean - T_2 * std / math.sqrt(3))
    assert c.ci_high == pytest.approx(mean + T_2 * std / math.sqrt(3))
    assert c.p_value == pytest.approx(stats.ttest_rel(mine, base).pvalue)
    assert "too few" not in c.conclusion and f"p = {c.p_value:.3g}" in c.conclusion


def test_a_clear_difference_is_called_better() -> None:
    (c,) = paired_study([0.10, 0.11, 0.12, 0.10], [0.50, 0.52, 0.51, 0.50]).comparisons
    assert c.p_value is not None and c.p_value < 0.05
    assert c.conclusion.startswith("lion is better than adamw")


def test_two_seeds_are_too_few_to_conclude() -> None:
    (c,) = paired_study([0.4, 0.5], [0.5, 0.7]).comparisons
    assert c.n == 2
    assert "too few seeds to conclude" in c.conclusion


def test_identical_runs_give_no_nan_and_say_the_p_value_is_undefined() -> None:
    summary = paired_study([0.4, 0.5, 0.6], [0.4, 0.5, 0.6])
    (c,) = summary.comparisons
    assert c.mean_difference == 0.0 and c.p_value is None
    assert "identical" in c.conclusion and "undefined" in c.conclusion
    text = summary.model_dump_json()
    assert "NaN" not in text and "Infinity" not in text


def test_a_constant_offset_has_no_spread_and_no_p_value() -> None:
    (c,) = paired_study([0.5, 0.75, 1.0], [0.25, 0.5, 0.75]).comparisons
    assert c.mean_difference == pytest.approx(0.25) and c.p_value is None
    assert "undefined" in c.conclusion


def test_comparisons_use_only_the_seeds_both_succeeded_on() -> None:
    runs = study({("lion", 1e-4): [0.4, 0.5, 0.45], ("adamw", 1e-3): [0.5, 0.6, 0.55]})
    runs[1] = make_run(runs[1].job_id, "lion", 1, grid={"lr": 1e-4}, status="failed", error="boom")
    (c,) = summary_of(runs, baseline="adamw").comparisons
    assert c.seeds == [0, 2] and c.n == 2 and "too few seeds" in c.conclusion


def test_no_baseline_no_comparisons_and_an_unknown_baseline_is_noted() -> None:
    runs = study({("lion", 1e-4): [0.4], ("adamw", 1e-3): [0.5]})
    assert summary_of(runs).comparisons == []
    summary = summary_of(runs, baseline="sgd")
    assert summary.comparisons == [] and any("baseline sgd" in note for note in summary.notes)


# --- failed, diverged, cancelled --------------------------------------------------------


def test_failed_diverged_and_cancelled_jobs_are_counted_and_listed() -> None:
    runs = [
        make_run(1, "lion", 0, val__loss=points([1.0, 0.5])),
        make_run(2, "lion", 1, val__loss=points([1.0, 0.7])),
        make_run(3, "lion", 2, status="diverged", error="loss nan at step 20", val__loss=points([9.0])),
        make_run(4, "lion", 3, status="failed", error="Traceback: boom"),
        make_run(5, "lion", 4, status="cancelled"),
        make_run(6, "lion", 5, status="queued"),
        make_run(7, "adamw", 0, status="failed", error="bad lr"),
    ]
    summary = summary_of(runs)
    point = summary.grid_points[0]
    c = point.counts
    assert (c.total, c.succeeded, c.failed, c.diverged, c.cancelled, c.unfinished) == (6, 2, 1, 1, 1, 1)
    # statistics stand on the two succeeded seeds only, and say so
    metric = point.metric("val/loss")
    assert metric is not None and metric.final.n == 2 and metric.final.mean == pytest.approx(0.6)
    assert point.seeds == [0, 1]
    assert [(p.job_id, p.status, p.error) for p in summary.problems] == [
        (3, "diverged", "loss nan at step 20"),
        (4, "failed", "Traceback: boom"),
        (5, "cancelled", None),
        (7, "failed", "bad lr"),
    ]
    lion, adamw = summary.ranking
    assert (lion.rank, lion.jobs.failed, lion.jobs.diverged) == (1, 1, 1)
    assert (adamw.optimizer, adamw.rank, adamw.label, adamw.jobs.failed) == ("adamw", None, None, 1)
    assert any("adamw" in n and "no succeeded seed" in n for n in summary.notes)
    assert summary.counts.total == 7 and summary.counts.failed == 2


# --- time split -------------------------------------------------------------------------


def test_time_split_is_the_median_over_jobs_of_each_jobs_own_medians() -> None:
    """The probe: the split was the median of flush-window means, 10-80x off, as windows close every
    100 steps or every second (a slow stretch makes many) and step 0's warm-up window counted. Each
    job's result holds its own medians over its steps: the split is the median over jobs of those."""
    slow_windows = points([180.0] + [60.0] * 20)  # warm-up, then a slow stretch of one-second windows
    runs = [
        replace(
            make_run(1, "lion", 0, perf__step_time_ms=slow_windows, perf__optimizer_step_ms=slow_windows),
            step_time_ms_median=10.0,
            optimizer_step_ms_median=2.0,  # forward+backward 8
        ),
        replace(make_run(2, "lion", 1), step_time_ms_median=14.0, optimizer_step_ms_median=3.0),  # 11
        replace(make_run(3, "lion", 2), step_time_ms_median=12.0, optimizer_step_ms_median=4.0),  # 8
        replace(
            make_run(4, "lion", 3, status="failed"), step_time_ms_median=1000.0, optimizer_step_ms_median=1.0
        ),
    ]
    (split,) = summary_of(runs).time_split
    assert split.jobs == 3
    assert split.forward_backward_ms == pytest.approx(8.0)  # median of 8, 11, 8
    assert split.optimizer_step_ms == pytest.approx(3.0)  # median of 2, 3, 4


def test_time_split_falls_back_to_the_history_without_the_warm_up_window() -> None:
    runs = [
        make_run(
            1,
            "lion",
            0,
            perf__step_time_ms=points([200.0, 5.0, 6.0, 9.0]),  # step 0's window first: left out
            perf__optimizer_step_ms=points([150.0, 1.0, 2.0, 3.0]),  # median 2; forward+backward 6 - 2
            optim__state_bytes=points([0.0, 400.0]),
            val__loss=points([0.5]),
        ),
        replace(
            make_run(2, "lion", 1, optim__state_bytes=points([600.0]), val__loss=points([0.5])),
            step_time_ms_median=7.0,
            optimizer_step_ms_median=2.0,  # forward+backward 5
        ),
        make_run(3, "lion", 2, status="failed", perf__step_time_ms=points([1000.0])),
    ]
    (split,) = summary_of(runs).time_split
    assert split.jobs == 2
    assert split.forward_backward_ms == pytest.approx(4.5)  # median of 4 and 5
    assert split.optimizer_step_ms == pytest.approx(2.0)  # median of 2 and 2
    assert split.state_bytes == pytest.approx(500.0)  # median of the last values 400, 600


# --- JSON and MLflow --------------------------------------------------------------------


def reject_constant(name: str) -> None:
    raise AssertionError(f"JSON holds {name}")


def test_summary_json_has_no_nan_or_infinity_and_round_trips() -> None:
    runs = [
        make_run(1, "lion", 0, val__loss=points([float("inf"), 0.5])),
        make_run(2, "lion", 1, val__loss=points([1.0, float("nan")])),  # no finite final
        make_run(3, "lion", 2, status="diverged", val__loss=points([float("nan")])),
        make_run(4, "adamw", 0, val__loss=points([0.6]), perf__step_time_ms=points([float("inf")])),
    ]
    summary = summary_of(runs, baseline="adamw", target=TargetRule("val/loss", "min", 0.55))
    text = summary.model_dump_json()
    json.loads(text, parse_constant=reject_constant)
    assert StudySummary.model_validate_json(text) == summary
    metric = summary.grid_points[0].metric("val/loss")
    assert metric is not None and metric.final.n == 1 and metric.best.n == 2
    assert any("logged no finite val/loss" in note for note in summary.notes)


def test_the_models_refuse_non_finite_figures() -> None:
    with pytest.raises(ValidationError):
        Stat(n=1, mean=float("nan"), std=None, ci_low=None, ci_high=None)


MLFLOW_SAFE = re.compile(r"^[A-Za-z0-9_\-./ ]+$")


def test_flat_metrics_are_finite_with_mlflow_safe_keys() -> None:
    hostile = '<script>alert("x")</script>/../..'
    runs = study({(hostile, 1e-4): [0.4, 0.5, 0.6], ("adamw", 1e-3): [0.5, 0.5, 0.7]})
    flat = summary_of(runs, baseline="adamw", target=TargetRule("val/loss", "min", 0.55)).flat_metrics()
    for key, value in flat.items():
        assert MLFLOW_SAFE.match(key), key
        assert posixpath.normpath(key) == key and not key.startswith("/"), key
        assert math.isfinite(value), key
    assert flat["summary/adamw/val/loss_final_mean"] == pytest.approx(0.5 + 0.2 / 3)
    assert flat["summary/adamw/rank"] == 2.0
    assert flat["summary/adamw/grid/lr_0.001/val/loss_final_n"] == 3.0
    assert flat["summary/study/jobs_total"] == 6.0
    hostile_keys = [k for k in flat if k.endswith("/val/loss_final_mean") and "adamw" not in k]
    assert hostile_keys and flat[hostile_keys[0]] == pytest.approx(0.5)
    assert any(k.endswith("vs_adamw/p_value") for k in flat)


def test_grid_values_of_every_type_round_trip_through_json() -> None:
    grid: dict[str, GridValue] = {"lr": 1e-3, "batch": 64, "nesterov": True, "variant": "b"}
    runs = [make_run(1, "sgd", 0, grid=grid, val__loss=points([0.5]))]
    summary = summary_of(runs)
    again = StudySummary.model_validate_json(summary.model_dump_json())
    assert again == summary
    point = again.grid_points[0]
    assert point.grid == grid and [type(point.grid[k]) for k in grid] == [float, int, bool, str]
    assert point.label == "batch=64 lr=0.001 nesterov=True variant=b"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3e-4, "0.0003"),
        (3e-5, "3e-5"),
        (1.0, "1"),
        (1e20, "1e20"),
        (0.00030000000000000003, "0.00030000000000000003"),
        (64, "64"),
        (True, "True"),
        ("b", "b"),
        (None, "null"),  # a hyperparameter that takes null (Prodigy's `beta3`)
        ("True", '"True"'),  # strings that would read as another value, or as two, are quoted
        ("0.5", '"0.5"'),
        ("null", '"null"'),
        ("a b=1", '"a b=1"'),
    ],
)
def test_grid_labels_are_short_and_exact(value: GridValue, text: str) -> None:
    assert grid_label({"lr": value}) == f"lr={text}"


def test_a_grid_with_null_and_strings_is_summarized() -> None:
    """Prodigy's `beta3` over [null, 0.5] and a choice over two strings: every point its own label."""
    runs = [
        StudyRun(
            job_id=index + 1,
            optimizer="prodigy",
            grid={"beta3": beta3, "mode": mode},
            seed=0,
            status="succeeded",
            history={"val/loss": points([1.0 + index, 0.5 + index])},
        )
        for index, (beta3, mode) in enumerate([(None, "a"), (0.5, "a"), (None, "True"), (0.5, True)])
    ]
    summary = summary_of(runs)
    labels = [point.label for point in summary.grid_points]
    assert sorted(labels) == sorted(
        ["beta3=null mode=a", "beta3=0.5 mode=a", 'beta3=null mode="True"', "beta3=0.5 mode=True"]
    )
    assert StudySummary.model_validate_json(summary.model_dump_json()) == summary


def test_long_names_keep_mlflow_keys_short() -> None:
    runs = study({("x" * 400, 1e-3): [0.5]})
    assert max(len(key) for key in summary_of(runs).flat_metrics()) <= 250


def test_the_same_input_gives_the_same_summary() -> None:
    runs = study(FINALS)
    first, second = summary_of(runs, baseline="adamw"), summary_of(runs, baseline="adamw")
    assert first.model_dump_json() == second.model_dump_json()


def test_the_studies_modules_load_no_framework_no_pyplot_and_no_scipy_at_import() -> None:
    # a fresh interpreter: the service never imports torch or TensorFlow, the report never
    # touches pyplot's global state, and scipy (over a second) loads only when a summary is made
    unwanted = ("torch", "tensorflow", "keras", "matplotlib.pyplot", "scipy")
    code = (
        "import sys, service.studies.summary, service.studies.report; "
        f"print(sorted(m for m in {unwanted!r} if m in sys.modules))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr


def test_a_grid_of_list_values_is_summarized_and_reported() -> None:
    """`betas: [[0.9, 0.999]]`, the grid of one the README gives to fix a list hyperparameter (and two
    pairs to compare): the summary refused list values, so the study stayed `summarizing` for good."""
    from service.studies.report import render_report

    runs = [
        make_run(index + 1, "adam", seed, grid={"betas": betas}, val__loss=points([1.0, 0.5 - 0.1 * index]))
        for index, (betas, seed) in enumerate([([0.9, 0.999], 0), ([0.9, 0.999], 1), ([0.8, 0.99], 0)])
    ]
    summary = summary_of(runs)
    assert [point.label for point in summary.grid_points] == ["betas=[0.8,0.99]", "betas=[0.9,0.999]"]
    assert [point.grid["betas"] for point in summary.grid_points] == [[0.8, 0.99], [0.9, 0.999]]
    assert StudySummary.model_validate_json(summary.model_dump_json()) == summary
    assert "betas=[0.8,0.99]" in render_report(summary, runs, title="t").html


# --- what the probe of real studies found -----------------------------------------------


def test_equal_means_share_a_rank() -> None:
    """Standard competition ranking: two optimizers with exactly the same mean are both second."""
    runs = study({("a", 0.1): [0.4], ("b", 0.1): [0.5], ("c", 0.1): [0.5], ("d", 0.1): [0.6]})
    summary = summary_of(runs)
    assert [(row.optimizer, row.rank) for row in summary.ranking] == [("a", 1), ("b", 2), ("c", 2), ("d", 4)]
    assert summary.flat_metrics()["summary/c/rank"] == 2.0


def test_a_best_point_on_fewer_seeds_than_were_run_is_noted_with_what_became_of_the_others() -> None:
    runs = study({("lion", 3e-4): [0.30, 0.40, 0.50], ("adamw", 1e-3): [0.45, 0.45, 0.48]})
    runs[1] = make_run(runs[1].job_id, "lion", 1, grid={"lr": 3e-4}, status="cancelled")
    runs[2] = make_run(runs[2].job_id, "lion", 2, grid={"lr": 3e-4}, status="failed", error="boom")
    summary = summary_of(runs)
    assert (
        "lion lr=0.0003: ranked on 1 of the 3 seeds run (seed 1 cancelled, seed 2 failed)." in summary.notes
    )
    assert (
        "The ranked optimizers stand on different numbers of seeds (lion n=1, adamw n=3): their means are "
        "not equally certain, and a seed that failed or was cancelled may have been a hard one."
        in summary.notes
    )
    # the notes change nothing about the ranking: lion's one seed left, 0.3, ranks it first
    assert [(row.optimizer, row.rank) for row in summary.ranking] == [("lion", 1), ("adamw", 2)]
    # every optimizer on every seed: no such note
    full = summary_of(study(FINALS))
    assert not any("seeds run" in note or "different numbers of seeds" in note for note in full.notes)


def test_a_single_seed_study_says_there_is_no_interval() -> None:
    summary = summary_of(study({("lion", 3e-4): [0.3], ("adamw", 1e-3): [0.4]}))
    assert (
        "One seed only (seed 0): there is no confidence interval, and the ranking orders single runs, "
        "which cannot tell an optimizer's difference from a seed's." in summary.notes
    )
    assert not any("One seed only" in note for note in summary_of(study(FINALS)).notes)


IDENTICAL = "The seeds gave identical results: at every grid point with two or more seeds, every seed ended "


def test_seeds_that_change_nothing_are_noted() -> None:
    """`quadratic` is deterministic: every seed gives the same loss, and intervals of width 0 read
    as certainty."""
    identical = study({("sgd", 0.1): [0.25, 0.25, 0.25], ("adam", 0.1): [1e-30] * 3, ("lion", 0.1): [0.5]})
    note = (
        f"{IDENTICAL}with the same final value of every train/ and val/ metric, so intervals of width 0 say "
        "nothing about the spread to expect (the workload does not depend on the seed)."
    )
    assert note in summary_of(identical).notes
    # one grid point whose seeds differ: the seeds do something
    varied = identical + study({("sgd", 0.2): [0.3, 0.31]})
    assert not any(IDENTICAL in n for n in summary_of(varied).notes)
    # the same parameters on every seed: said so, by their hash
    hashed = [replace(run, params_sha256="ab12") for run in identical]
    assert any("the same trained parameters (params_sha256)" in n for n in summary_of(hashed).notes)


def test_an_equal_coarse_accuracy_is_not_seeds_that_change_nothing() -> None:
    """The probe's Keras study: val/accuracy 333/360 on both seeds, but val/loss and the trained
    parameters differed. The note read "the workload does not depend on the seed"."""

    def run(job_id: int, seed: int, loss: float, sha: str | None) -> StudyRun:
        accuracy, losses = points([0.75, 333 / 360]), points([1.4, loss])
        return replace(
            make_run(job_id, "sgd", seed, val__accuracy=accuracy, val__loss=losses), params_sha256=sha
        )

    options = {"selection_metric": "val/accuracy", "selection_mode": "max"}
    by_hash = summary_of([run(1, 0, 0.5353, "e8b4"), run(2, 1, 0.5361, "71c0")], **options)
    by_metrics = summary_of([run(1, 0, 0.5353, None), run(2, 1, 0.5361, None)], **options)
    same_hash = summary_of([run(1, 0, 0.5353, "e8b4"), run(2, 1, 0.5361, "e8b4")], **options)
    assert not any(IDENTICAL in n for n in by_hash.notes + by_metrics.notes)
    assert any(IDENTICAL in n for n in same_hash.notes)  # the parameters decide where they are known


def test_a_finite_blow_up_that_succeeded_is_noted_per_grid_point() -> None:
    """sgd at lr=1000: val/loss 2853 from 2.3, a finite value, so the job succeeded."""
    runs = [
        make_run(1, "sgd", 0, grid={"lr": 1000}, val__loss=points([2.3, 40.0, 2853.0])),
        make_run(2, "sgd", 1, grid={"lr": 1000}, val__loss=points([2.31, 1e4])),
        make_run(3, "sgd", 2, grid={"lr": 1000}, val__loss=points([2.3, 2.0])),
        make_run(4, "sgd", 0, grid={"lr": 0.1}, val__loss=points([2.3, 0.5])),
    ]
    summary = summary_of(runs)
    worse = [note for note in summary.notes if "ended worse than its first evaluation" in note]
    assert worse == [
        "sgd lr=1000: val/loss ended worse than its first evaluation (by more than 1% of the first) in 2 of "
        "3 seeds (seed 0: 2.3 -> 2853, seed 1: 2.31 -> 1e+04)."
    ]
    assert summary.counts.succeeded == 4  # the status stays
    accuracy = [make_run(1, "sgd", 0, grid={"lr": 1000}, val__accuracy=points([0.3, 0.1]))]
    maximised = summary_of(accuracy, selection_metric="val/accuracy", selection_mode="max")
    assert (
        "sgd lr=1000: val/accuracy ended worse than its first evaluation (by more than 0.01) in 1 of 1 "
        in (" ".join(maximised.notes))
    )


def test_a_drop_within_an_evaluations_noise_is_not_noted() -> None:
    """The probe: one validation image of 360 (0.9861 -> 0.9833) was noted as ending worse; a loss 1%
    worse is no blow-up either. Only a drop past the stated margin is."""
    runs = [
        make_run(1, "adam", 0, val__accuracy=points([355 / 360, 354 / 360])),
        make_run(2, "adam", 1, grid={"lr": 0.1}, val__accuracy=points([0.35, 0.1639])),
    ]
    notes = summary_of(runs, selection_metric="val/accuracy", selection_mode="max").notes
    assert [n for n in notes if "ended worse" in n] == [
        "adam lr=0.1: val/accuracy ended worse than its first evaluation (by more than 0.01) in 1 of 1 seeds "
        "(seed 1: 0.35 -> 0.1639)."
    ]
    losses = [make_run(1, "sgd", 0, val__loss=points([2.3, 2.32]))]  # 0.9% worse
    assert not any("ended worse" in n for n in summary_of(losses).notes)


def test_intervals_are_cut_at_what_the_metric_can_take_and_the_means_kept() -> None:
    accuracy = study({("sgd", 0.1): [0.99, 1.0, 0.95]}, metric="val/accuracy")
    summary = summary_of(accuracy, selection_metric="val/accuracy", selection_mode="max")
    final = summary.grid_points[0].metric("val/accuracy")
    assert final is not None
    mean = (0.99 + 1.0 + 0.95) / 3
    half = T_2 * float(np.std([0.99, 1.0, 0.95], ddof=1)) / math.sqrt(3)  # mean + half: about 1.05
    assert final.final.mean == pytest.approx(mean)
    assert (final.final.ci_low, final.final.ci_high) == (pytest.approx(mean - half), 1.0)
    rmse = summary_of(
        study({("sgd", 0.1): [0.01, 0.5, 0.02]}, metric="val/rmse"), selection_metric="val/rmse"
    )
    stat = rmse.grid_points[0].metric("val/rmse")
    assert stat is not None and stat.final.ci_low == 0.0 and stat.final.mean == pytest.approx(0.53 / 3)
    # a loss has no known bound: its interval is left as it is
    loss = summary_of(study({("sgd", 0.1): [0.01, 0.5, 0.02]})).grid_points[0].metric("val/loss")
    assert loss is not None and loss.final.ci_low is not None and loss.final.ci_low < 0


def test_describe_cuts_the_interval_at_most() -> None:
    stat = describe([1.0, 2.0, 3.0], at_least=1.0, at_most=2.5)
    assert (stat.mean, stat.ci_low, stat.ci_high) == (2.0, 1.0, 2.5)


def test_steps_to_target_are_cut_at_the_studys_steps() -> None:
    runs = [
        make_run(1, "sgd", 0, val__loss=points([0.9, 0.4, 0.3])),  # reached at 20
        make_run(2, "sgd", 1, val__loss=points([0.9, 0.8, 0.4])),  # at 30
    ]
    ttt = summary_of(runs, target=TargetRule("val/loss", "min", 0.5), steps=30).grid_points[0].time_to_target
    assert ttt is not None and ttt.steps.mean == 25.0
    assert (ttt.steps.ci_low, ttt.steps.ci_high) == (0.0, 30.0)


def test_the_evaluation_cadence_is_the_studys() -> None:
    runs = [make_run(1, "sgd", 0, val__loss=points([0.9, 0.5, 0.4], every=10))]
    assert summary_of(runs, eval_every=10).eval_every == 10
    assert summary_of(runs).eval_every is None


def test_a_resumed_job_is_noted_as_its_attempts_went() -> None:
    """Only a job interrupted after steps is noted (a second attempt after one that ran none lost no
    time in its run); resumed only where its last attempt did resume from a checkpoint. The probe's job
    291 ran again from the start twice and then failed: it read "resumed ... (attempt 3)"."""
    lion = {"grid": {"lr": 3e-4}, "val__loss": points([1.0, 0.5])}
    runs = [
        make_run(7, "lion", 2, **lion),  # type: ignore[arg-type]
        replace(make_run(8, "lion", 3, **lion), attempt=2, interrupted_at=1300, resumed_from=1000),  # type: ignore[arg-type]
        replace(make_run(9, "lion", 4, **lion), attempt=2),  # type: ignore[arg-type]
        replace(make_run(10, "lion", 5, **lion), attempt=2, interrupted_at=700, resumed_from=0),  # type: ignore[arg-type]
        replace(make_run(11, "lion", 6, grid={"lr": 3e-4}, status="failed"), attempt=3, interrupted_at=700),
        # the service probe's job 20: killed at step 24, before its first checkpoint, it trained again
        # from step 0 in a new MLflow run; it had read "ran again (attempt 2): its seconds include the
        # time it was down", wrong on both counts
        replace(make_run(12, "lion", 7, **lion), attempt=2, interrupted_at=24, new_run=True),  # type: ignore[arg-type]
    ]
    notes = [note for note in summary_of(runs).notes if note.startswith("job ")]
    assert notes == [
        "job 8 (lion lr=0.0003 seed=3) was interrupted at step 1300 and resumed from its checkpoint of step "
        "1000 (attempt 2): its seconds include the time it was down.",
        "job 10 (lion lr=0.0003 seed=5) was interrupted at step 700 and ran again from the start in the same "
        "MLflow run (attempt 2): its seconds include the time it was down.",
        "job 11 (lion lr=0.0003 seed=6) was interrupted at step 700 and ran again (attempt 3), then ended "
        "failed: it is left out of the statistics.",
        "job 12 (lion lr=0.0003 seed=7) was interrupted at step 24 and ran again from the start in a new "
        "MLflow run (attempt 2): its seconds count from that run's start, the interrupted attempt's time "
        "not in them.",
    ]


def test_flat_metrics_count_each_optimizers_cancelled_jobs() -> None:
    runs = study({("lion", 3e-4): [0.3, 0.4, 0.5]})
    runs.append(make_run(9, "lion", 3, grid={"lr": 3e-4}, status="cancelled"))
    flat = summary_of(runs).flat_metrics()
    assert flat["summary/lion/jobs_cancelled"] == 1.0
    assert flat["summary/lion/jobs_failed"] == 0.0


# --- what the second probe found ----------------------------------------------------------


def test_grid_points_that_differ_past_the_cut_keep_their_own_mlflow_keys() -> None:
    """The probe's spec s24: sgd with weight_decay [0.001, 0.9] and four one-value axes. Its labels are
    equal for their first 60 characters, so both points wrote one `summary/sgd/grid/<cut>/...` key and
    the second overwrote the first's figures."""
    fixed: dict[str, GridValue] = {"lr": 0.05, "momentum": 0.5, "dampening": 0.1, "nesterov": False}
    runs = [
        make_run(1, "sgd", 0, grid={**fixed, "weight_decay": 0.001}, val__loss=points([2.0, 0.4])),
        make_run(2, "sgd", 0, grid={**fixed, "weight_decay": 0.9}, val__loss=points([2.0, 1.9])),
    ]
    flat = summary_of(runs).flat_metrics()
    keys = [
        key for key in flat if key.startswith("summary/sgd/grid/") and key.endswith("val/loss_final_mean")
    ]
    assert sorted(flat[key] for key in keys) == [0.4, 1.9]  # both points, neither overwritten
    assert all(len(key) <= 250 and MLFLOW_SAFE.match(key) for key in keys)
    # the same point keeps its key whatever else the study holds
    alone = summary_of(runs[:1]).flat_metrics()
    assert flat.keys() & alone.keys() >= {k for k in alone if "/grid/" in k}


def keras_run(job_id: int, seed: int, step_ms: float, opt_ms: float) -> StudyRun:
    return replace(
        make_run(job_id, "sgd", seed, val__loss=points([0.5])),
        step_time_ms_median=step_ms,
        optimizer_step_ms_median=opt_ms,
        update_timed_apart=False,
    )


def test_a_keras_job_has_only_its_whole_steps_time() -> None:
    """A Keras job times its whole compiled step as the optimizer's: the probe's study read
    forward+backward 0.007 ms and optimizer step 0.42 ms. The split is not measured there."""
    summary = summary_of([keras_run(1, 0, 0.401, 0.394), keras_run(2, 1, 0.45, 0.44)])
    (split,) = summary.time_split
    assert (split.split_measured, split.forward_backward_ms, split.optimizer_step_ms) == (False, None, None)
    assert split.step_ms == pytest.approx((0.401 + 0.45) / 2) and split.jobs == 2
    flat = summary.flat_metrics()
    assert "summary/sgd/step_ms" in flat
    assert "summary/sgd/forward_backward_ms" not in flat and "summary/sgd/optimizer_step_ms" not in flat
    torch = replace(
        make_run(3, "lion", 0, val__loss=points([0.5])), step_time_ms_median=9.0, optimizer_step_ms_median=2.0
    )
    (measured,) = summary_of([torch]).time_split
    assert (measured.split_measured, measured.forward_backward_ms, measured.step_ms) == (True, 7.0, 9.0)
    # No job succeeded: nothing says the split is unmeasured (the report had called a torch class Keras).
    diverged = replace(make_run(4, "lion", 0, val__loss=points([0.5])), status="diverged")
    (none_succeeded,) = summary_of([diverged]).time_split
    assert none_succeeded.split_measured and none_succeeded.jobs == 0


def test_state_bytes_are_the_best_grid_points() -> None:
    """The probe: a median over grid points with momentum 0 and 0.9 (0, 0, 35880, 35880) read 17940,
    a state no job had."""
    runs = [
        make_run(
            1, "sgd", 0, grid={"momentum": 0.0}, val__loss=points([0.9]), optim__state_bytes=points([0.0])
        ),
        make_run(
            2, "sgd", 1, grid={"momentum": 0.0}, val__loss=points([0.9]), optim__state_bytes=points([0.0])
        ),
        make_run(
            3, "sgd", 0, grid={"momentum": 0.9}, val__loss=points([0.5]), optim__state_bytes=points([35880.0])
        ),
        make_run(
            4, "sgd", 1, grid={"momentum": 0.9}, val__loss=points([0.5]), optim__state_bytes=points([35880.0])
        ),
    ]
    (split,) = summary_of(runs).time_split
    assert (split.state_bytes, split.state_label) == (35880.0, "momentum=0.9")


def test_time_to_target_counts_only_succeeded_jobs_as_the_ranking_does() -> None:
    """The probe's study 3: a cancelled job that met the target before it was cancelled read "target
    reached 3/3" and its seconds were in the mean, beside a ranking over n=2."""
    runs = [
        make_run(29, "adam", 0, status="cancelled", val__accuracy=points([0.96], every=500)),
        make_run(30, "adam", 1, val__accuracy=points([0.96, 0.99], every=500, seconds_per_step=0.002)),
        make_run(31, "adam", 2, val__accuracy=points([0.97, 0.98], every=500, seconds_per_step=0.001)),
    ]
    summary = summary_of(
        runs,
        target=TargetRule("val/accuracy", "max", 0.95),
        selection_metric="val/accuracy",
        selection_mode="max",
    )
    ttt = summary.grid_points[0].time_to_target
    assert ttt is not None
    # listed, not counted: "reached 2/2, not reached 1" had counted the cancelled seed as not reached
    assert (ttt.reached, ttt.succeeded, ttt.not_reached, ttt.seconds.n) == (2, 2, 0, 2)
    assert ttt.seconds.mean == pytest.approx((1.0 + 0.5) / 2)
    assert ttt.seeds[0].status == "cancelled" and not ttt.seeds[0].reached
    row = summary.ranking[0]
    assert row.selection is not None and (row.target_reached, row.selection.n) == (2, 2)


def test_a_best_value_at_the_edge_of_the_grid_is_noted() -> None:
    """The probe's study 20: adam's best lr, 0.1, was the largest tried."""
    runs = study({("adam", 0.001): [0.9], ("adam", 0.01): [0.5], ("adam", 0.1): [0.2]})
    runs += study({("sgd", 0.001): [0.9], ("sgd", 0.01): [0.2], ("sgd", 0.1): [0.5]})
    runs = [replace(run, job_id=i + 1) for i, run in enumerate(runs)]
    edge = [n for n in summary_of(runs).notes if "grid may not contain" in n]
    assert edge == [
        "adam: its best lr, 0.1, is the largest tried (0.001 to 0.1): the grid may not contain the optimum."
    ]
    two = study({("adam", 0.01): [0.5], ("adam", 0.1): [0.2]})  # with two values every best is at an edge
    assert not any("grid may not contain" in n for n in summary_of(two).notes)
