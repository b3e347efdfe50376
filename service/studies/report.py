"""A study's report: PNG plots and one self-contained HTML page (pure: no store, no MLflow).

The plots are `matplotlib.figure.Figure` objects drawn on their own Agg canvas, never
pyplot: pyplot's global state (current figure, backend) belongs to whoever else runs in the
process. PNGs are saved without the software tag, so the same input gives the same bytes.
The HTML holds every image inline as a base64 data URI (a browser shows it as is, offline)
and escapes every string that came from a user (optimizer names, grid values, errors, the
title, the MLflow address).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jobs.workloads.surfaces import SurfaceSpec
from service.studies.summary import (
    RANKING_CAVEAT,
    GridPointSummary,
    GridValue,
    JobCounts,
    MetricPoint,
    SeedTime,
    Stat,
    StudyRun,
    StudySummary,
    TimeToTarget,
    format_value,
    grid_label,
    machine_load_note,
    unstable,
)

# One colour per optimizer, the same in every plot (matplotlib's tab10, written out so no
# global style or rcParams change can recolour the report).
COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
DPI = 100
NONE = "\N{EN DASH}"  # an undefined figure in a table
LOG_SPAN = 10.0  # a numeric axis whose positive values span more than this factor is drawn log


# The 2-D test function a report draws trajectories over: the workloads' own record.
Surface = SurfaceSpec


@dataclass(frozen=True)
class StudySetup:
    """What the study ran, for the report's header: a reader cannot tell from "adam" alone whether it
    was the torch, Keras or legacy tf.keras implementation, nor on what."""

    framework: str  # torch | tensorflow
    workload: str
    steps: int
    batch_size: int
    # every optimizer by its study name (label): its catalogue name and style, e.g. "adam (tf_legacy)"
    implementations: dict[str, str]


@dataclass(frozen=True)
class Report:
    html: str  # self-contained: every image inline as data:image/png;base64
    images: dict[str, bytes]  # file name -> PNG bytes (also logged as parent-run artifacts)


@dataclass(frozen=True)
class Plot:
    name: str  # file name, e.g. "curves.png"
    caption: str
    png: bytes


def render_report(
    summary: StudySummary,
    runs: Sequence[StudyRun],
    *,
    title: str,
    surface: Surface | None = None,
    mlflow_url: str | None = None,
    setup: StudySetup | None = None,
) -> Report:
    """The study's plots as PNGs and the HTML page that shows them with the summary's tables."""
    plots = [
        plot
        for plot in (
            curves_plot(summary, runs),
            sensitivity_plot(summary),
            time_to_target_plot(summary),
            trajectories_plot(summary, runs, surface) if surface is not None else None,
        )
        if plot is not None
    ]
    page = html_page(
        summary, plots, title=title, mlflow_url=mlflow_url, surface_given=surface is not None, setup=setup
    )
    return Report(html=page, images={plot.name: plot.png for plot in plots})


# ---------------------------------------------------------------------------------------
# plots


def new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


def plain(text: str) -> str:
    """`text` shown literally by matplotlib: `$` starts mathtext, a leading `_` hides a legend entry."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def colour(summary: StudySummary, optimizer: str) -> str:
    return COLOURS[summary.optimizers.index(optimizer) % len(COLOURS)]


def best_runs(summary: StudySummary, runs: Sequence[StudyRun], optimizer: str) -> list[StudyRun]:
    """The succeeded runs of `optimizer` at its best grid point, by seed."""
    point = summary.best_grid_point(optimizer)
    if point is None:
        return []
    return sorted(
        (
            r
            for r in runs
            if r.optimizer == optimizer and r.status == "succeeded" and grid_label(r.grid) == point.label
        ),
        key=lambda r: (r.seed, r.job_id),
    )


def finite_points(points: Sequence[MetricPoint]) -> dict[int, float]:
    return {p.step: float(p.value) for p in points if math.isfinite(p.value)}


def seed_band(histories: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step logged by any seed: the mean, lowest and highest value over the seeds that logged it."""
    steps = sorted({step for h in histories for step in h})
    mean, low, high = [], [], []
    for step in steps:
        values = [h[step] for h in histories if step in h]
        mean.append(sum(values) / len(values))
        low.append(min(values))
        high.append(max(values))
    return steps, mean, low, high


def spans_decades(values: Sequence[float]) -> bool:
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SPAN


def curves_plot(summary: StudySummary, runs: Sequence[StudyRun]) -> Plot | None:
    """train/loss and the selection metric per optimizer at its best grid point; band = seed min..max."""
    metrics = list(dict.fromkeys(["train/loss", summary.selection_metric]))
    figure = new_figure(6.0 * len(metrics), 4.2)
    drawn = False
    for i, metric in enumerate(metrics):
        axes = figure.add_subplot(1, len(metrics), i + 1)
        values: list[float] = []
        for opt in summary.optimizers:
            chosen = best_runs(summary, runs, opt)
            histories = [h for h in (finite_points(r.history.get(metric, [])) for r in chosen) if h]
            if not histories:
                continue
            steps, mean, low, high = seed_band(histories)
            point = summary.best_grid_point(opt)
            assert point is not None
            label = f"{opt} {point.label} ({len(histories)} seed{'s' if len(histories) != 1 else ''})"
            axes.plot(steps, mean, color=colour(summary, opt), label=plain(label), linewidth=1.6)
            if len(histories) > 1:
                axes.fill_between(steps, low, high, color=colour(summary, opt), alpha=0.2, linewidth=0)
            values += low + high
            drawn = True
        if spans_decades(values):
            axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.set_ylabel(plain(metric))
        axes.set_title(plain(f"{metric}: mean over seeds, band = min..max"), fontsize=10)
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
    if not drawn:
        return None
    return Plot(
        "curves.png",
        "Curves per optimizer at its best grid point: the line is the mean over its succeeded seeds, "
        "the band their lowest and highest value.",
        png_bytes(figure),
    )


def x_keys(summary: StudySummary) -> dict[str, str]:
    """Each optimizer's grid hyperparameter on the sensitivity plot's x axis: `lr` where its grid has
    it, else the one of its own grid with the most values (a rate-free optimizer tuned over its
    `d_coef` is drawn against that); an optimizer with no grid is left out."""
    keys = {}
    for opt in summary.optimizers:
        points = [p for p in summary.grid_points if p.optimizer == opt]
        own = sorted({key for p in points for key in p.grid})
        if own:
            keys[opt] = (
                "lr"
                if "lr" in own
                else max(own, key=lambda k: len({format_value(p.grid.get(k)) for p in points}))
            )
    return keys


def is_number(value: GridValue | None) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def error_bar(stat: Stat) -> tuple[float, float]:
    """How far the 95% interval reaches below and above the mean: unequal where it was cut at what the
    quantity can take (accuracy at 1, steps at 0)."""
    if stat.mean is None or stat.ci_low is None or stat.ci_high is None:
        return 0.0, 0.0
    return stat.mean - stat.ci_low, stat.ci_high - stat.mean


def error_bars(stats: Sequence[Stat]) -> list[list[float]]:
    """`yerr` for matplotlib: a row of the lengths below, a row of those above."""
    bars = [error_bar(stat) for stat in stats]
    return [[below for below, _ in bars], [above for _, above in bars]]


def sensitivity_plot(summary: StudySummary) -> Plot | None:
    """Final selection metric (mean, 95% CI) versus the grid hyperparameter, one line per optimizer;
    a panel per hyperparameter where the optimizers are tuned over different ones."""
    figure = sensitivity_figure(summary)
    if figure is None:
        return None
    keys = " / ".join(dict.fromkeys(x_keys(summary).values()))
    metric = summary.selection_metric
    return Plot(
        "sensitivity.png",
        f"Final {metric} versus {keys} per optimizer: mean over succeeded seeds with its 95% confidence "
        "interval (none with one seed); the star marks the grid point chosen as best, an x at the top "
        "edge a grid point with no result where jobs diverged or failed. Lines of one optimizer (its "
        "other grid values) share its colour and differ in their dashes; at a value two optimizers tried, "
        "their points are drawn a little apart along the axis, so neither hides the other.",
        png_bytes(figure),
    )


def sensitivity_figure(summary: StudySummary) -> Figure | None:
    """The sensitivity plot's figure, a panel per x hyperparameter (`x_keys`); None when no grid point
    has a result to draw."""
    by_key: dict[str, list[str]] = {}
    for opt, key in x_keys(summary).items():
        by_key.setdefault(key, []).append(opt)
    if not by_key:
        return None
    figure = new_figure(7.0, 4.5 * len(by_key))
    drawn = False
    for index, (key, optimizers) in enumerate(by_key.items()):
        axes = figure.add_subplot(len(by_key), 1, index + 1)
        drawn = _draw_sensitivity(axes, summary, key, optimizers) or drawn
    return figure if drawn else None


_DASHES = ("-", "--", ":", "-.")


def _draw_sensitivity(axes: Axes, summary: StudySummary, key: str, optimizers: list[str]) -> bool:
    """One panel: `optimizers`' final metric versus `key`; False when it had nothing to draw."""
    metric = summary.selection_metric
    xs_all = [p.grid[key] for p in summary.grid_points if p.optimizer in optimizers and key in p.grid]
    numeric = all(is_number(x) for x in xs_all)
    categories = sorted({format_value(x) for x in xs_all})
    logarithmic = numeric and log_axis(key, [float(x) for x in xs_all if isinstance(x, int | float)])
    nudge = dodge(optimizers, xs_all, numeric=numeric, logarithmic=logarithmic, categories=len(categories))
    # how many of the panel's optimizers tried each value (by its text: a list or None is a value too)
    tried_by = Counter(
        label
        for opt in optimizers
        for label in {
            format_value(p.grid[key]) for p in summary.grid_points if p.optimizer == opt and key in p.grid
        }
    )

    def position(x: GridValue, opt: str) -> float:
        """On the axis: the number itself, else the index of its category; at a value another optimizer
        also tried, moved aside by the optimizer's dodge, so its point is not hidden under the other's
        marker (probe_momentum's lr=0.003 sat under adam's star)."""
        shift = nudge[opt] if tried_by[format_value(x)] > 1 else 0.0
        if numeric and isinstance(x, int | float):
            return float(x) * 10**shift if logarithmic else float(x) + shift
        return float(categories.index(format_value(x))) + shift

    drawn = marked = False
    for opt in optimizers:
        points = [p for p in summary.grid_points if p.optimizer == opt and key in p.grid]
        # Other grid hyperparameters than `key` make separate lines, each named by their values.
        lines: dict[str, list[GridPointSummary]] = {}
        for p in points:
            rest = {k: v for k, v in p.grid.items() if k != key}
            lines.setdefault(grid_label(rest) if rest else "", []).append(p)
        best = summary.best_grid_point(opt)
        for number, (rest_label, line) in enumerate(lines.items()):
            shown = sorted(
                (
                    (position(p.grid[key], opt), m.final.mean, m.final)
                    for p in line
                    if (m := p.metric(metric)) is not None and m.final.mean is not None
                ),
                key=lambda shown_point: shown_point[0],
            )
            if not shown:
                continue
            name = f"{opt} ({rest_label})" if rest_label else opt
            axes.errorbar(
                [x for x, _, _ in shown],
                [y for _, y, _ in shown],
                yerr=error_bars([stat for _, _, stat in shown]),
                color=colour(summary, opt),
                linestyle=_DASHES[number % len(_DASHES)],
                marker="o",
                capsize=4,
                label=plain(name),
            )
            drawn = True
        # A rate where every seed diverged or failed has no mean to draw: without a mark, it read as
        # a rate never tried.
        lost = [position(p.grid[key], opt) for p in points if lost_to_instability(p, metric)]
        if lost:
            mark_lost(axes, lost, colour(summary, opt))
            marked = True
        if best is not None and key in best.grid and (m := best.metric(metric)) and m.final.mean is not None:
            axes.plot(
                [position(best.grid[key], opt)],
                [m.final.mean],
                marker="*",
                markersize=16,
                color=colour(summary, opt),
                zorder=5,
            )
    if not (drawn or marked):
        return False
    if logarithmic:
        axes.set_xscale("log")
    if not numeric:
        axes.set_xticks(range(len(categories)), [plain(c) for c in categories])
    if marked:
        # one legend entry for every optimizer's marks, in grey: the colour says whose
        axes.plot([], [], linestyle="none", marker="x", color="#555555", label=LOST_LABEL)
    axes.set_xlabel(plain(key))
    axes.set_ylabel(plain(f"final {metric}"))
    axes.set_title(plain(f"Sensitivity: final {metric} vs {key} (mean, 95% CI; star = best)"), fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    return drawn


LOST_LABEL = "diverged or failed"
# A sensitivity axis whose positive values span more than this factor is drawn log (a learning rate's
# always is): 0.001 to 0.01 drawn linear had bunched the small rates together.
SENSITIVITY_LOG_SPAN = 3.0
# How far apart the optimizers of one panel are drawn, as a fraction of the axis's width: enough to
# see two markers at one value, little enough to read the value off the axis.
DODGE_FRACTION = 0.04


def log_axis(key: str, values: Sequence[float]) -> bool:
    """Whether the sensitivity axis of `key` is drawn log: every value positive, and `key` a learning
    rate or the values spanning more than SENSITIVITY_LOG_SPAN."""
    if not values or min(values) <= 0:
        return False
    return key == "lr" or max(values) / min(values) > SENSITIVITY_LOG_SPAN


def dodge(
    optimizers: Sequence[str], xs: Sequence[GridValue], *, numeric: bool, logarithmic: bool, categories: int
) -> dict[str, float]:
    """Each optimizer's shift along the axis (in decades on a log axis, else in its units), centred on
    the true value: the optimizers of a panel side by side at a value they both tried."""
    if numeric:
        values = [float(x) for x in xs if isinstance(x, int | float)]
        if logarithmic:
            values = [math.log10(v) for v in values]
        width = (max(values) - min(values)) if values else 0.0
        width = width or (1.0 if logarithmic else abs(values[0]) if values and values[0] else 1.0)
    else:
        width = float(max(categories - 1, 1))
    middle = (len(optimizers) - 1) / 2
    return {opt: (index - middle) * DODGE_FRACTION * width for index, opt in enumerate(optimizers)}


def lost_to_instability(point: GridPointSummary, metric: str) -> bool:
    """No mean of `metric` at the point, and jobs of it diverged or failed (not merely cancelled)."""
    stats = point.metric(metric)
    return (stats is None or stats.final.mean is None) and unstable(point)


def mark_lost(axes: Axes, xs: list[float], hex_colour: str) -> None:
    """An x at the top edge of the axes (x in data, y in axes coordinates) at each of `xs`."""
    axes.plot(
        xs,
        [1.0] * len(xs),
        linestyle="none",
        marker="x",
        markersize=9,
        markeredgewidth=2,
        color=hex_colour,
        transform=axes.get_xaxis_transform(),
        clip_on=False,
        zorder=6,
    )


def time_to_target_plot(summary: StudySummary) -> Plot | None:
    """Bars of mean steps and seconds to target at each optimizer's best grid point; dots are seeds."""
    if summary.target is None or all(summary.best_grid_point(opt) is None for opt in summary.optimizers):
        return None
    figure = new_figure(11.0, 4.2)
    names = summary.optimizers
    for i, (unit, label) in enumerate((("steps", "steps to target"), ("seconds", "seconds to target"))):
        axes = figure.add_subplot(1, 2, i + 1)
        tops: list[float] = []
        for x, opt in enumerate(names):
            point = summary.best_grid_point(opt)
            ttt = None if point is None else point.time_to_target
            if ttt is None:
                continue
            measured = [s.step if unit == "steps" else s.seconds for s in ttt.seeds if s.reached]
            values = [float(v) for v in measured if v is not None]
            stat = ttt.steps if unit == "steps" else ttt.seconds
            if stat.mean is not None:
                axes.bar(
                    [x],
                    [stat.mean],
                    yerr=error_bars([stat]),
                    color=colour(summary, opt),
                    alpha=0.8,
                    capsize=4,
                )
                axes.plot([x] * len(values), values, "o", color="black", markersize=4, zorder=5)
                tops.append(max([stat.mean + error_bar(stat)[1], *values]))
        top = max(tops, default=1.0) or 1.0
        for x, opt in enumerate(names):
            point = summary.best_grid_point(opt)
            ttt = None if point is None else point.time_to_target
            if ttt is None:
                text = "no result"
            elif ttt.reached == 0:
                text = f"not reached\n({reached_text(ttt)})"
                axes.bar([x], [top * 0.05], color="none", edgecolor="#999999", hatch="//")
            else:
                text = f"{reached_text(ttt)} reached"
            axes.annotate(text, (x, top * 1.02), ha="center", va="bottom", fontsize=8, annotation_clip=False)
        axes.set_ylim(0, top * 1.25)
        # long or many names would overlap side by side
        tilted = len(names) > 4 or any(len(n) > 12 for n in names)
        axes.set_xticks(
            range(len(names)),
            [plain(n) for n in names],
            rotation=20 if tilted else 0,
            ha="right" if tilted else "center",
        )
        axes.set_ylabel(label)
        axes.grid(True, axis="y", alpha=0.3)
    target = summary.target
    figure.suptitle(
        plain(f"Time to target {target.metric} {'<=' if target.mode == 'min' else '>='} {target.value:g}"),
        fontsize=11,
    )
    return Plot(
        "time_to_target.png",
        "Time to target at each optimizer's best grid point: bar = mean over the seeds that reached it "
        "(95% CI), dots = single seeds; how many seeds reached it is written above each bar.",
        png_bytes(figure),
    )


def contour_levels(z: np.ndarray) -> np.ndarray:
    """Log-spaced levels for a non-negative surface with a wide range (Rosenbrock), linear otherwise."""
    finite_z = z[np.isfinite(z)]
    low, high = float(finite_z.min()), float(finite_z.max())
    if low >= 0 and high > 0 and high / max(low, high * 1e-6) > 100:
        return np.logspace(math.log10(max(low, high * 1e-6)), math.log10(high), 20)
    return np.linspace(low, high, 20)


def trajectories_plot(summary: StudySummary, runs: Sequence[StudyRun], surface: Surface) -> Plot | None:
    """Each optimizer's path (traj/x, traj/y) at its best grid point over the surface's contours."""
    paths: list[tuple[str, int, list[float], list[float]]] = []
    for opt in summary.optimizers:
        for run in best_runs(summary, runs, opt):
            by_step_x = finite_points(run.history.get("traj/x", []))
            by_step_y = finite_points(run.history.get("traj/y", []))
            steps = sorted(by_step_x.keys() & by_step_y.keys())
            if steps:
                paths.append((opt, run.seed, [by_step_x[s] for s in steps], [by_step_y[s] for s in steps]))
    if not paths:
        return None
    figure = new_figure(7.0, 6.0)
    axes: Axes = figure.add_subplot(1, 1, 1)
    gx = np.linspace(surface.xlim[0], surface.xlim[1], 200)
    gy = np.linspace(surface.ylim[0], surface.ylim[1], 200)
    grid_x, grid_y = np.meshgrid(gx, gy)
    z = np.asarray(surface.f(grid_x, grid_y), dtype=float)
    axes.contour(grid_x, grid_y, z, levels=contour_levels(z), cmap="viridis", linewidths=0.7, alpha=0.7)
    labelled: set[str] = set()
    for opt, _seed, xs, ys in paths:
        label = None if opt in labelled else plain(opt)
        labelled.add(opt)
        axes.plot(xs, ys, color=colour(summary, opt), linewidth=1.2, marker=".", markersize=3, label=label)
        axes.plot([xs[0]], [ys[0]], marker="o", color=colour(summary, opt), markersize=6)
    if surface.minimum is not None:
        axes.plot(
            [surface.minimum[0]],
            [surface.minimum[1]],
            marker="*",
            color="black",
            markersize=14,
            linestyle="none",
            label="minimum",
        )
    axes.set_xlim(*surface.xlim)
    axes.set_ylim(*surface.ylim)
    axes.set_xlabel("x")
    axes.set_ylabel("y")
    axes.set_title("Trajectories at each optimizer's best grid point (circle = start)", fontsize=10)
    axes.legend(fontsize=8)
    return Plot(
        "trajectories.png",
        "Each optimizer's path over the function's contours, one line per succeeded seed at its best "
        "grid point (circle: start; star: the minimum).",
        png_bytes(figure),
    )


# ---------------------------------------------------------------------------------------
# HTML

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.meta { color: #555; } .bad { color: #a40000; } .none { color: #777; font-style: italic; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; } pre { white-space: pre-wrap; margin: 0; font-size: 0.9em; }
.address { overflow-wrap: anywhere; }
.warning { color: #7a4b00; background: #fff6e0; border-left: 3px solid #e0a020; padding: 0.3em 0.6em; }
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def num(value: float | int | None, digits: int = 4) -> str:
    if value is None:
        return NONE
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def stat_text(stat: Stat | None) -> str:
    """`0.92 ± 0.025 (n=3)`: the mean and the 95% CI half width, or only the mean with one seed; an
    interval cut at what the quantity can take is no longer even about the mean, so it is written
    out: `0.98 (0.94 to 1, n=3)`."""
    if stat is None or stat.mean is None:
        return NONE
    if stat.ci_low is None or stat.ci_high is None:
        return f"{num(stat.mean)} (n={stat.n})"
    below, above = error_bar(stat)
    if not math.isclose(below, above, rel_tol=1e-9):
        return f"{num(stat.mean)} ({num(stat.ci_low)} to {num(stat.ci_high)}, n={stat.n})"
    return f"{num(stat.mean)} ± {num(above, 2)} (n={stat.n})"


def reached_text(ttt: TimeToTarget) -> str:
    """`2/2`: reached over the succeeded jobs, the seeds the ranking's n counts."""
    return f"{ttt.reached}/{len(ttt.seeds) if ttt.succeeded is None else ttt.succeeded}"


def counts_text(c: JobCounts) -> str:
    parts = [f"{c.succeeded}/{c.total} succeeded"]
    for name in ("failed", "diverged", "cancelled", "unfinished"):
        if getattr(c, name):
            parts.append(f"{getattr(c, name)} {name}")
    return ", ".join(parts)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells arrive escaped already."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def safe_link(url: str) -> str:
    """A link for http(s) addresses only (no `javascript:`); anything else is shown as text."""
    if url.lower().startswith(("http://", "https://")):
        # One unbroken word as long as the study's filter: it may break anywhere, or it widens the page.
        shown = f'<span class="meta address">({esc(url)})</span>'
        return f'<a href="{esc(url)}">Open the study in MLflow</a> {shown}'
    return f'MLflow: <span class="address">{esc(url)}</span>'


def setup_text(setup: StudySetup) -> str:
    """`Framework tensorflow, workload digits_mlp, 100 steps a job, batch 64; optimizers: sgd (keras),
    sgd_legacy = sgd (tf_legacy).`"""
    shown = ", ".join(
        implementation if implementation.startswith(f"{name} ") else f"{name} = {implementation}"
        for name, implementation in setup.implementations.items()
    )
    return (
        f"Framework {setup.framework}, workload {setup.workload}, {setup.steps} steps a job, batch "
        f"{setup.batch_size}; optimizers: {shown}."
    )


def header_html(
    summary: StudySummary, title: str, mlflow_url: str | None, setup: StudySetup | None = None
) -> str:
    target = summary.target
    lines = [
        *([esc(setup_text(setup))] if setup is not None else []),
        f"{summary.counts.total} jobs: {esc(counts_text(summary.counts))}.",
        f"Best grid point chosen on the mean final {esc(summary.selection_metric)} "
        f"({'lower' if summary.selection_mode == 'min' else 'higher'} is better), among the points where no "
        f"job failed or diverged where there are any. {esc(RANKING_CAVEAT)}",
        "Target: none."
        if target is None
        else f"Target: {esc(target.metric)} {'&lt;=' if target.mode == 'min' else '&gt;='} "
        f"{esc(num(target.value))}.",
        "Baseline: none." if summary.baseline is None else f"Baseline: {esc(summary.baseline)}.",
    ]
    if mlflow_url:
        lines.append(safe_link(mlflow_url))
    items = "".join(f"<li>{line}</li>" for line in lines)
    return f'<h1>{esc(title)}</h1><ul class="meta">{items}</ul>'


def ranking_html(summary: StudySummary) -> str:
    rows = []
    for r in summary.ranking:
        reached = NONE
        point = summary.best_grid_point(r.optimizer)
        if point is not None and point.time_to_target is not None:
            reached = reached_text(point.time_to_target)
        rows.append(
            [
                esc(r.rank if r.rank is not None else "not ranked"),
                esc(r.optimizer),
                esc(r.label or "no result"),
                esc(stat_text(r.selection)),
                esc(reached),
                esc(counts_text(r.at_best)) if r.at_best else f'<span class="none">{NONE}</span>',
                esc(counts_text(r.jobs)),
            ]
        )
    return "<h2>Ranking</h2>" + table(
        [
            "rank",
            "optimizer",
            "best grid point",
            f"final {summary.selection_metric} (mean ± 95% CI)",
            "target reached",
            "jobs at best point",
            "all its jobs",
        ],
        rows,
        numeric=(0,),
    )


def comparisons_html(summary: StudySummary) -> str:
    if summary.baseline is None:
        return '<h2>Paired comparisons</h2><p class="none">No baseline given.</p>'
    if not summary.comparisons:
        return (
            f"<h2>Paired comparisons against {esc(summary.baseline)}</h2>"
            '<p class="none">Nothing to compare (see the notes).</p>'
        )
    rows = [
        [
            esc(f"{c.optimizer} \N{MINUS SIGN} {c.baseline}"),
            esc(c.n),
            esc(num(c.mean_difference)),
            esc(NONE if c.ci_low is None else f"{num(c.ci_low)} to {num(c.ci_high)}"),
            esc(num(c.p_value, 3)),
            esc(c.conclusion),
        ]
        for c in summary.comparisons
    ]
    return (
        f"<h2>Paired comparisons against {esc(summary.baseline)}</h2>"
        f'<p class="meta">Final {esc(summary.selection_metric)} at each optimizer\'s best grid point, '
        "per seed both succeeded on; paired t-test.</p>"
        + table(["difference", "seeds", "mean", "95% CI", "p-value", "conclusion"], rows, numeric=(1, 2, 4))
    )


def time_to_target_html(summary: StudySummary) -> str:
    if summary.target is None:
        return ""
    rows = []
    for opt in summary.optimizers:
        point = summary.best_grid_point(opt)
        if point is None or point.time_to_target is None:
            rows.append([esc(opt), NONE, NONE, NONE, NONE, '<span class="none">no result</span>'])
            continue
        ttt = point.time_to_target
        per_seed = "; ".join(seed_time_text(s) for s in ttt.seeds)
        rows.append(
            [
                esc(f"{opt} {point.label}"),
                esc(reached_text(ttt)),
                esc(ttt.not_reached),
                esc(stat_text(ttt.steps)),
                esc(stat_text(ttt.seconds)),
                esc(per_seed),
            ]
        )
    at_evaluations = measured_at_evaluations(summary)
    return (
        "<h2>Time to target</h2>"
        + f'<p class="meta">{esc(granularity_text(summary))}</p>'
        + load_warning_html(summary)
        + table(
            [
                "optimizer at best point",
                "reached",
                "not reached",
                "steps (at evaluations)" if at_evaluations else "steps",
                "seconds",
                "per seed",
            ],
            rows,
            numeric=(1, 2),
        )
    )


def seed_time_text(seed: SeedTime) -> str:
    if seed.reached:
        return f"seed {seed.seed}: step {seed.step} ({num(seed.seconds, 3)} s)"
    if seed.status == "succeeded":
        return f"seed {seed.seed}: not reached"
    if seed.status == "cancelled":  # stopped: neither reached nor not reached
        return f"seed {seed.seed}: cancelled, not counted"
    return f"seed {seed.seed}: {seed.status}, not reached"


def measured_at_evaluations(summary: StudySummary) -> bool:
    """Whether the target's metric is logged only at evaluations (a val/* one)."""
    return summary.target is not None and summary.target.metric.startswith("val/")


def granularity_text(summary: StudySummary) -> str:
    """Where steps to target are read. A val/* metric is logged only at evaluations: a seed that met
    the target between two is counted at the next, so a step count is as fine as the cadence."""
    assert summary.target is not None
    metric = summary.target.metric
    if not measured_at_evaluations(summary):
        return f"Steps to target are the first logged step where {metric} met the target."
    return (
        f"Steps to target are measured at evaluation points{cadence_text(summary)}: a seed that met the "
        "target between two evaluations is counted at the later one, so steps and seconds are as fine as "
        "that cadence and no finer."
    )


NOT_MEASURED = '<span class="none">not measured apart</span>'


def cadence_text(summary: StudySummary) -> str:
    """Where the jobs evaluated: every eval_every steps and at the last step (jobs/training/loop.py), so
    a study of 30 steps with eval_every 100 evaluated once, at step 30."""
    every, steps = summary.eval_every, summary.steps
    if not every:
        return ""
    if steps is not None and steps <= every:
        return f", here once, at the last step ({steps}; eval_every {every} is not less than the steps)"
    if steps is not None and steps % every:
        return f", every {every} steps (eval_every) and at the last step ({steps})"
    return f", every {every} steps (eval_every)"


def load_warning_html(summary: StudySummary) -> str:
    """The note on timings disturbed by machine load, beside the figures it is about (the notes come
    last on the page, after the seconds they cast doubt on)."""
    note = machine_load_note(summary.time_split)
    return f'<p class="warning">{esc(note)}</p>' if note else ""


def time_split_html(summary: StudySummary) -> str:
    rows = [
        [
            esc(s.optimizer),
            esc(s.jobs),
            esc(num(s.step_ms)),
            esc(num(s.forward_backward_ms)) if s.split_measured else NOT_MEASURED,
            esc(num(s.optimizer_step_ms)) if s.split_measured else NOT_MEASURED,
            esc(NONE if s.state_bytes is None else f"{s.state_bytes:,.0f} ({s.state_label})"),
        ]
        for s in summary.time_split
    ]
    unmeasured = [s.optimizer for s in summary.time_split if not s.split_measured]
    meta = (
        f'<p class="meta">{esc(", ".join(unmeasured))}: the update is compiled into one graph with the '
        "gradients (Keras), so its time cannot be told apart from forward+backward; only the whole "
        "step's time is measured.</p>"
        if unmeasured
        else ""
    )
    return (
        "<h2>Time split</h2>"
        + load_warning_html(summary)
        + meta
        + table(
            [
                "optimizer",
                "jobs",
                "step ms (median)",
                "forward+backward ms (median)",
                "optimizer step ms (median)",
                "state bytes (at the best grid point)",
            ],
            rows,
            numeric=(1, 2, 3, 4, 5),
        )
    )


def grid_points_html(summary: StudySummary) -> str:
    metrics = sorted({m.metric for p in summary.grid_points for m in p.metrics})
    rows = []
    for p in summary.grid_points:
        best = summary.best_grid_point(p.optimizer)
        mark = " ★" if best is not None and best.label == p.label else ""
        cells = [esc(p.optimizer), esc(p.label) + mark, esc(counts_text(p.counts))]
        for name in metrics:
            m = p.metric(name)
            cells.append(
                NONE
                if m is None
                else f'{esc(stat_text(m.final))}<br><span class="meta">best {esc(stat_text(m.best))}</span>'
            )
        rows.append(cells)
    headers = ["optimizer", "grid point", "jobs", *[f"{m} final (best)" for m in metrics]]
    return (
        '<h2>Every grid point</h2><p class="meta">Mean ± 95% CI half width over the succeeded seeds '
        "(n = how many; an interval cut at what the metric can take is written out, low to high); "
        "★ = the best grid point.</p>" + table(headers, rows)
    )


def problems_html(summary: StudySummary) -> str:
    if not summary.problems:
        return '<h2>Failed, diverged and cancelled jobs</h2><p class="none">None.</p>'
    rows = [
        [
            esc(p.job_id),
            esc(p.optimizer),
            esc(p.label),
            esc(p.seed),
            f'<span class="bad">{esc(p.status)}</span>',
            f"<pre>{esc(p.error or '')}</pre>",
        ]
        for p in summary.problems
    ]
    return (
        f"<h2>Failed, diverged and cancelled jobs ({len(summary.problems)})</h2>"
        '<p class="meta">Counted above, left out of the statistics (which stand on succeeded seeds).</p>'
        + table(["job", "optimizer", "grid point", "seed", "status", "error"], rows, numeric=(0, 3))
    )


def notes_html(summary: StudySummary, surface_given: bool, plots: Sequence[Plot]) -> str:
    notes = list(summary.notes)
    if surface_given and not any(p.name == "trajectories.png" for p in plots):
        notes.append(
            "A surface was given but no succeeded job at a best grid point logged traj/x and traj/y."
        )
    if not notes:
        return ""
    return "<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"


def plots_html(plots: Sequence[Plot]) -> str:
    if not plots:
        return '<h2>Plots</h2><p class="none">No metric was logged to plot.</p>'
    figures = "".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}" '
        f'alt="{esc(p.name)}"><figcaption>{esc(p.caption)}</figcaption></figure>'
        for p in plots
    )
    return "<h2>Plots</h2>" + figures


def html_page(
    summary: StudySummary,
    plots: Sequence[Plot],
    *,
    title: str,
    mlflow_url: str | None,
    surface_given: bool,
    setup: StudySetup | None = None,
) -> str:
    body = "".join(
        [
            header_html(summary, title, mlflow_url, setup),
            ranking_html(summary),
            comparisons_html(summary),
            time_to_target_html(summary),
            plots_html(plots),
            grid_points_html(summary),
            time_split_html(summary),
            problems_html(summary),
            notes_html(summary, surface_given, plots),
        ]
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>{body}</body></html>\n"
    )
