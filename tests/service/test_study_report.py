"""The study report (service/studies/report.py): PNGs that decode, one self-contained HTML page.

The page is also rendered by a real headless browser (Debian's `chromium`); `make test`
installs it when missing, and the test fails, never skips, without it.
"""

from __future__ import annotations

import base64
import io
import math
import re
import shutil
import subprocess
from html import escape as html_escape
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

from service.studies.report import (
    COLOURS,
    Report,
    StudySetup,
    Surface,
    cadence_text,
    error_bar,
    log_axis,
    ranking_html,
    render_report,
    sensitivity_figure,
    time_split_html,
    time_to_target_html,
)
from service.studies.summary import (
    RANKING_CAVEAT,
    MetricPoint,
    StudyRun,
    StudySummary,
    TargetRule,
    summarize,
)

# one worker renders the shared `full` report once (make test runs with --dist loadgroup)
pytestmark = pytest.mark.xdist_group("study_report")

HOSTILE = "<script>alert(1)</script> $\\frac{$"  # html, and mathtext for matplotlib
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROSENBROCK = Surface(
    f=lambda x, y: (1 - x) ** 2 + 100 * (y - x**2) ** 2,
    xlim=(-2.0, 2.0),
    ylim=(-1.0, 3.0),
    minimum=(1.0, 1.0),
)


def history(opt: str, lr: float, seed: int, *, traj: bool) -> dict[str, list[MetricPoint]]:
    """Decaying losses (faster for higher lr, a little seed noise), timings, and a path towards (1, 1)."""
    rate = 0.2 + 30 * lr + 0.05 * len(opt) % 0.3
    steps = [50 * (i + 1) for i in range(8)]
    noise = [0.03 * math.sin(seed * 1.7 + len(opt) * 0.9 + i) for i in range(len(steps))]
    loss = [2.5 * math.exp(-rate * i) + 0.5 + noise[i] for i in range(len(steps))]
    out = {
        "train/loss": [MetricPoint(s, s * 0.1, v + 0.1) for s, v in zip(steps, loss, strict=True)],
        "val/loss": [MetricPoint(s, s * 0.1, v) for s, v in zip(steps, loss, strict=True)],
        "perf/step_time_ms": [MetricPoint(s, s * 0.1, 12.0) for s in steps],
        "perf/optimizer_step_ms": [MetricPoint(s, s * 0.1, 2.0) for s in steps],
    }
    if traj:
        out["traj/x"] = [
            MetricPoint(s, 0.0, -1.5 + 2.5 * (1 - math.exp(-rate * i))) for i, s in enumerate(steps)
        ]
        out["traj/y"] = [MetricPoint(s, 0.0, 2.0 - (1 - math.exp(-rate * i))) for i, s in enumerate(steps)]
    return out


def make_runs(*, traj: bool) -> list[StudyRun]:
    runs: list[StudyRun] = []
    for opt, lrs in (("lion", [1e-4, 3e-3]), ("adamw", [1e-3, 1e-2]), (HOSTILE, [1e-2])):
        for lr in lrs:
            for seed in (0, 1, 2):
                runs.append(
                    StudyRun(
                        len(runs) + 1, opt, {"lr": lr}, seed, "succeeded", history(opt, lr, seed, traj=traj)
                    )
                )
    runs.append(
        StudyRun(len(runs) + 1, "adamw", {"lr": 1e-2}, 3, "diverged", {}, error="loss nan <b>at</b> 50")
    )
    runs.append(
        StudyRun(len(runs) + 1, "lion", {"lr": 1e-4}, 3, "failed", {}, error="ValueError: boom & bust")
    )
    return runs


TARGET = TargetRule("val/loss", "min", 0.9)


def summary_for(runs: list[StudyRun], *, target: TargetRule | None = TARGET) -> StudySummary:
    return summarize(
        runs,
        target=target,
        baseline="adamw",
        selection_metric="val/loss",
        selection_mode="min",
        eval_every=50,
    )


Full = tuple[Report, list[StudyRun], StudySummary]  # the `full` fixture: report, runs, summary
TITLE = f"lion vs adamw {HOSTILE}"
# As long as a study's link is (its runs, filtered), and with markup to escape.
MLFLOW_URL = (
    "http://127.0.0.1:5000/#/experiments/3/runs?searchFilter=tags.%60optlab.study_id%60%20%3D%20%2712%27"
    "%20AND%20attributes.run_name%20LIKE%20%27%25%27&compareRunsMode=CHART&viewMode=table&a=<b>"
)


@pytest.fixture(scope="module")
def full() -> Full:
    """The report with every plot: a target and a surface, runs logged with traj/x and traj/y."""
    runs = make_runs(traj=True)
    summary = summary_for(runs)
    report = render_report(summary, runs, title=TITLE, surface=ROSENBROCK, mlflow_url=MLFLOW_URL)
    return report, runs, summary


def decode(png: bytes) -> Image.Image:
    assert png.startswith(PNG_SIGNATURE)
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def colours(image: Image.Image) -> int:
    """How many distinct RGB colours the image has (packed into one integer each: a fast 1-D unique)."""
    rgb = np.asarray(image.convert("RGB")).astype(np.uint32)
    return len(np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]))


def not_one_colour(image: Image.Image) -> bool:
    return colours(image) > 50


def test_every_plot_is_a_png_that_decodes_and_shows_something(
    full: Full,
) -> None:
    report = full[0]
    assert set(report.images) == {"curves.png", "sensitivity.png", "time_to_target.png", "trajectories.png"}
    for name, png in report.images.items():
        image = decode(png)
        assert image.width >= 400 and image.height >= 300, name
        assert not_one_colour(image), name


def test_the_html_holds_every_image_inline(full: Full) -> None:
    report = full[0]
    for name, png in report.images.items():
        assert f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"' in report.html, name
    assert report.html.count("<img ") == len(report.images)
    # nothing else to fetch: no external script, style sheet or image
    assert 'src="http' not in report.html and "<link" not in report.html


def test_user_strings_are_escaped(full: Full) -> None:
    html = full[0].html
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "loss nan &lt;b&gt;at&lt;/b&gt; 50" in html and "boom &amp; bust" in html
    assert f'href="{html_escape(MLFLOW_URL)}"' in html and html_escape(MLFLOW_URL).endswith(
        "&amp;a=&lt;b&gt;"
    )


def test_the_html_shows_the_tables(full: Full) -> None:
    report, _, summary = full
    html = report.html
    for heading in (
        "Ranking",
        "Paired comparisons against adamw",
        "Time to target",
        "Every grid point",
        "Time split",
        "Failed, diverged and cancelled jobs (2)",
    ):
        assert f"<h2>{heading}</h2>" in html, heading
    assert summary.comparisons
    for c in summary.comparisons:
        assert html_escape(c.conclusion) in html
    assert '<span class="bad">diverged</span>' in html and '<span class="bad">failed</span>' in html


def test_a_javascript_address_is_not_a_link() -> None:
    report = render_report(summary_for([]), [], title="t", mlflow_url="javascript:alert(1)")
    assert report.images == {} and "No metric was logged to plot" in report.html
    assert 'href="javascript' not in report.html and "javascript:alert(1)" in report.html


@pytest.mark.parametrize(
    ("surface", "traj", "target"),
    [(ROSENBROCK, False, TARGET), (None, True, None)],
    ids=["surface-without-traj", "traj-without-surface-or-target"],
)
def test_no_trajectories_without_both_a_surface_and_traj_data(
    surface: Surface | None, traj: bool, target: TargetRule | None
) -> None:
    # (with both, the `full` report draws them: the first test)
    runs = [r for r in make_runs(traj=traj) if r.seed == 0]
    report = render_report(summary_for(runs, target=target), runs, title="t", surface=surface)
    assert "trajectories.png" not in report.images
    assert {"curves.png", "sensitivity.png"} <= set(report.images)
    if surface is not None:
        assert "no succeeded job at a best grid point logged traj/x and traj/y" in report.html
    # no time-to-target plot nor table without a target
    assert ("time_to_target.png" in report.images) is (target is not None)
    assert ("<h2>Time to target</h2>" in report.html) is (target is not None)


def test_a_grid_of_null_and_strings_is_plotted_by_category() -> None:
    """A grid over a hyperparameter that takes null or one of listed strings: a category each."""
    runs = [
        StudyRun(
            index + 1,
            "prodigy",
            {"beta3": beta3},
            seed,
            "succeeded",
            history("prodigy", 1e-3, seed, traj=False),
        )
        for index, (beta3, seed) in enumerate((b, s) for b in (None, 0.5, "auto") for s in (0, 1))
    ]
    report = render_report(summary_for(runs, target=None), runs, title="t")
    assert not_one_colour(decode(report.images["sensitivity.png"]))
    assert "beta3=null" in report.html and "beta3=auto" in report.html


def test_the_same_input_gives_the_same_report(full: Full) -> None:
    report, runs, summary = full
    again = render_report(summary, runs, title=TITLE, surface=ROSENBROCK, mlflow_url=MLFLOW_URL)
    assert again.html == report.html and again.images == report.images


def test_a_headless_browser_shows_the_report(full: Full, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium, (
        "Debian's `chromium` is not installed, so the report cannot be shown in a browser: "
        "install it with `apt-get install -y --no-install-recommends chromium` (make test does)"
    )
    page = tmp_path / "report.html"
    page.write_text(full[0].html, encoding="utf-8")
    shot = tmp_path / "shot.png"
    completed = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # tests run as root in CI
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,3000",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), (
        f"chromium wrote no screenshot (rc {completed.returncode}): {completed.stderr[-2000:]}"
    )
    image = decode(shot.read_bytes())
    assert image.size == (1200, 3000)
    pixels = np.asarray(image.convert("RGB"))
    assert not_one_colour(image)
    # the plots appear: many pixels in the optimizers' colours (not a blank page of text only)
    blue = np.all(np.abs(pixels.astype(int) - [31, 119, 180]) < 40, axis=-1).sum()
    orange = np.all(np.abs(pixels.astype(int) - [255, 127, 14]) < 40, axis=-1).sum()
    assert blue > 2000 and orange > 2000, (blue, orange)


def test_the_report_fits_a_narrow_window_without_scrolling_sideways(full: Full, tmp_path: Path) -> None:
    """The MLflow link, one unbroken word as long as a study's filter, had widened the page."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's `chromium` is not installed (make test installs it)"
    page = tmp_path / "report.html"
    # The page's width once laid out, where --dump-dom shows it.
    measure = "<script>document.title = String(document.documentElement.scrollWidth)</script>"
    page.write_text(full[0].html.replace("</body>", measure + "</body>"), encoding="utf-8")
    completed = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,800", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    width = re.search(r"<title>(\d+)</title>", completed.stdout)
    assert width, completed.stderr[-2000:]
    assert int(width[1]) <= 1000


def test_the_report_states_the_ranking_caveat_the_cli_prints_too(full: Full) -> None:
    assert html_escape(RANKING_CAVEAT) in full[0].html


def test_a_rate_where_every_seed_diverged_or_failed_is_marked_on_the_sensitivity_plot() -> None:
    """adamw at lr=0.1 diverged on every seed: the plot dropped the rate as if it was never tried."""
    runs = [r for r in make_runs(traj=False) if r.seed < 3]
    start = len(runs) + 1
    runs += [StudyRun(start + seed, "adamw", {"lr": 0.1}, seed, "diverged", {}) for seed in (0, 1)]
    runs += [StudyRun(start + 2, "adamw", {"lr": 0.1}, 2, "failed", {}, error="boom")]
    runs += [StudyRun(start + 3, "lion", {"lr": 0.5}, 0, "cancelled", {})]  # cancelled only: no mark
    figure = sensitivity_figure(summary_for(runs))
    assert figure is not None
    (axes,) = figure.axes
    marks = [line for line in axes.get_lines() if line.get_marker() == "x" and np.size(line.get_xdata())]
    assert [(np.asarray(m.get_xdata()).tolist(), np.asarray(m.get_ydata()).tolist()) for m in marks] == [
        ([0.1], [1.0])
    ]
    # at the top edge: y in axes coordinates, x in data
    assert marks[0].get_transform() == axes.get_xaxis_transform()
    assert marks[0].get_color() == COLOURS[1]  # adamw's colour
    assert LOST in legend_texts(figure)
    # grid points with survivors (adamw lr=0.01 lost one seed) are drawn, not marked
    assert LOST not in legend_texts(sensitivity_figure(summary_for(make_runs(traj=False))))


def test_optimizers_tuned_over_different_hyperparameters_each_get_a_panel() -> None:
    """A rate-free optimizer tuned over its `d_coef` beside one tuned over `lr`: only the `lr` axis was
    drawn, and the rate-free one was missing from the plot. Two lines of one optimizer (its other grid
    values) had looked alike: one colour, and now their own dashes."""
    points = [("adamw", {"lr": lr, "wd": wd}, lr) for lr in (1e-3, 1e-2) for wd in (0.0, 0.1)]
    points += [("prodigy", {"d_coef": d}, d / 100) for d in (0.5, 1.0, 2.0)]
    runs = [
        StudyRun(index + 1, opt, grid, seed, "succeeded", history(opt, rate, seed, traj=False))
        for index, ((opt, grid, rate), seed) in enumerate(
            (point, seed) for point in points for seed in (0, 1)
        )
    ]
    figure = sensitivity_figure(summary_for(runs, target=None))
    assert figure is not None
    top, bottom = figure.axes
    assert (top.get_xlabel(), bottom.get_xlabel()) == ("lr", "d_coef")
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["adamw (wd=0)", "adamw (wd=0.1)"]
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == ["prodigy"]
    dashes = {bars.get_label(): bars.lines[0].get_linestyle() for bars in top.containers}
    assert dashes["adamw (wd=0)"] != dashes["adamw (wd=0.1)"]


def test_the_learning_rate_axis_is_log_and_two_optimizers_at_one_rate_are_both_seen() -> None:
    """The service probe's study 1: lr 0.001 to 0.01 (a factor of 10, not more) was drawn on a linear axis,
    and probe_momentum's point at lr=0.003 sat under adam's star at the same rate, unseen."""
    finals = {("probe_momentum", 0.001): 0.90, ("probe_momentum", 0.003): 0.9222, ("adam", 0.003): 0.9236}
    finals[("adam", 0.01)] = 0.91
    runs = [
        StudyRun(
            index * 2 + seed + 1,
            opt,
            {"lr": lr},
            seed,
            "succeeded",
            {"val/accuracy": [MetricPoint(120, 1.0, value + 0.001 * seed)]},
        )
        for index, ((opt, lr), value) in enumerate(finals.items())
        for seed in (0, 1)
    ]
    summary = summarize(
        runs, target=None, baseline=None, selection_metric="val/accuracy", selection_mode="max"
    )
    figure = sensitivity_figure(summary)
    assert figure is not None
    (axes,) = figure.axes
    assert axes.get_xscale() == "log"
    at_0_003 = {
        line.get_color(): x
        for line in axes.get_lines()
        for x in np.asarray(line.get_xdata(), dtype=float).tolist()
        if line.get_marker() in ("o", "*") and abs(math.log10(x / 0.003)) < 0.05
    }
    momentum, adam = at_0_003[COLOURS[0]], at_0_003[COLOURS[1]]
    # apart, on either side of the rate, and close enough to read the rate off the axis
    assert momentum < 0.003 < adam and max(adam / momentum, momentum / adam) < 1.2
    # a hyperparameter other than the rate stays linear where its values span a factor of 3 or less
    assert (
        not log_axis("momentum", [0.5, 0.9]) and log_axis("momentum", [0.1, 0.9]) and log_axis("lr", [0.01])
    )


LOST = "diverged or failed"


def legend_texts(figure: Figure | None) -> list[str]:
    assert figure is not None
    legend = figure.axes[0].get_legend()
    assert legend is not None
    return [text.get_text() for text in legend.get_texts()]


def test_an_interval_cut_at_what_the_metric_can_take_is_written_out() -> None:
    runs = [
        StudyRun(seed + 1, "sgd", {"lr": 0.1}, seed, "succeeded", {"val/accuracy": [MetricPoint(10, 1.0, v)]})
        for seed, v in enumerate([0.99, 1.0, 0.95])
    ]
    summary = summarize(
        runs, target=None, baseline=None, selection_metric="val/accuracy", selection_mode="max"
    )
    stat = summary.grid_points[0].metric("val/accuracy")
    assert stat is not None and stat.final.ci_low is not None and stat.final.ci_high == 1.0
    below, above = error_bar(stat.final)
    assert above == pytest.approx(1.0 - 0.98) and below > above
    assert f"0.98 ({stat.final.ci_low:.4g} to 1, n=3)" in render_report(summary, runs, title="t").html


def test_time_to_target_says_steps_are_measured_at_evaluations(full: Full) -> None:
    html = full[0].html
    assert full[2].eval_every == 50  # the study's, as finalize passes it
    assert (
        "Steps to target are measured at evaluation points, every 50 steps (eval_every): a seed that met "
        "the target between two evaluations is counted at the later one" in html
    )
    assert "<th>steps (at evaluations)</th>" in html


def one_job_summary(run: StudyRun, **options: object) -> StudySummary:
    return summarize(
        [run], target=None, baseline=None, selection_metric="val/loss", selection_mode="min", **options
    )  # type: ignore[arg-type]


def test_a_keras_time_split_says_it_is_not_measured_apart() -> None:
    """The probe's Keras study showed forward+backward 0.007 ms beside an optimizer step of 0.42 ms:
    a Keras job times its whole compiled step as the optimizer's."""
    run = StudyRun(
        1,
        "sgd",
        {"lr": 0.1},
        0,
        "succeeded",
        {"val/loss": [MetricPoint(100, 1.0, 0.5)], "optim/state_bytes": [MetricPoint(100, 1.0, 8.0)]},
        step_time_ms_median=0.4015,
        optimizer_step_ms_median=0.3945,
        update_timed_apart=False,
    )
    html = time_split_html(one_job_summary(run))
    assert '<td class="num">0.4015</td>' in html  # the whole step
    assert html.count("not measured apart") == 2 and "0.007" not in html and "0.3945" not in html
    assert "sgd: the update is compiled into one graph with the gradients (Keras)" in html
    assert "8 (lr=0.1)" in html  # the state bytes, and the grid point they are from


def test_the_cadence_says_what_the_jobs_did() -> None:
    """The probe: "every 100 steps (eval_every)" for a study of 30 steps, which evaluated once."""
    run = StudyRun(1, "sgd", {"lr": 0.1}, 0, "succeeded", {"val/loss": [MetricPoint(30, 1.0, 0.5)]})
    once = one_job_summary(run, steps=30, eval_every=100)
    assert (
        cadence_text(once) == ", here once, at the last step (30; eval_every 100 is not less than the steps)"
    )
    assert cadence_text(one_job_summary(run, steps=250, eval_every=100)) == (
        ", every 100 steps (eval_every) and at the last step (250)"
    )
    assert cadence_text(one_job_summary(run, steps=300, eval_every=100)) == ", every 100 steps (eval_every)"


def test_time_to_target_shows_the_succeeded_seeds_it_counts() -> None:
    runs = [
        StudyRun(job, "adam", {"lr": 0.003}, seed, status, {"val/loss": [MetricPoint(500, 1.0, 0.4)]})
        for job, seed, status in ((29, 0, "cancelled"), (30, 1, "succeeded"), (31, 2, "succeeded"))
    ]
    summary = summarize(
        runs,
        target=TargetRule("val/loss", "min", 0.5),
        baseline=None,
        selection_metric="val/loss",
        selection_mode="min",
    )
    html = time_to_target_html(summary) + ranking_html(summary)
    assert "3/3" not in html and html.count("2/2") == 2
    assert "seed 0: cancelled, not counted" in html
    # the probe's study 2 read "reached 2/2 | not reached 1", that 1 the cancelled seed
    row = re.search(r"<tr><td>adam lr=0.003</td>(.*?)</tr>", html)
    assert row is not None and re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))[:2] == ["2/2", "0"]


def test_a_diverged_seed_is_not_reached_and_a_cancelled_one_is_not_counted() -> None:
    runs = [
        StudyRun(job, "adam", {"lr": 0.003}, seed, status, {"val/loss": [MetricPoint(500, 1.0, 0.4)]})
        for job, seed, status in ((29, 0, "cancelled"), (30, 1, "succeeded"), (31, 2, "diverged"))
    ]
    summary = summarize(
        runs,
        target=TargetRule("val/loss", "min", 0.5),
        baseline=None,
        selection_metric="val/loss",
        selection_mode="min",
    )
    ttt = summary.grid_points[0].time_to_target
    assert ttt is not None and (ttt.reached, ttt.not_reached) == (
        1,
        1,
    )  # the diverged seed, not the cancelled
    html = time_to_target_html(summary)
    assert "seed 0: cancelled, not counted" in html and "seed 2: diverged, not reached" in html


def test_the_header_says_what_the_study_ran() -> None:
    """The probe's study 16: nothing said "adam" was the legacy tf.keras implementation."""
    run = StudyRun(1, "adam", {"lr": 0.01}, 0, "succeeded", {"val/loss": [MetricPoint(30, 1.0, 0.5)]})
    setup = StudySetup(
        framework="tensorflow",
        workload="digits_mlp",
        steps=30,
        batch_size=64,
        implementations={"sgd": "sgd (keras)", "adam": "adam (tf_legacy)", "sgd_legacy": "sgd (tf_legacy)"},
    )
    html = render_report(one_job_summary(run), [run], title="t", setup=setup).html
    assert (
        "Framework tensorflow, workload digits_mlp, 30 steps a job, batch 64; optimizers: sgd (keras), "
        "adam (tf_legacy), sgd_legacy = sgd (tf_legacy)." in html
    )


def test_finalize_names_each_optimizers_implementation() -> None:
    from jobs.spec import StudySpec
    from service.studies.finalize import setup_of

    spec = StudySpec.model_validate(
        {
            "name": "probe-keras-nan",
            "framework": "tensorflow",
            "workload": {"name": "digits_mlp"},
            "optimizers": [
                {"name": "sgd", "params": {"lr": [0.1]}},
                {"name": "adam", "style": "tf_legacy", "params": {"lr": [0.01]}},
                {"name": "sgd", "label": "sgd_legacy", "style": "tf_legacy", "params": {"lr": [0.1]}},
            ],
            "seeds": [0, 1],
            "steps": 30,
            "eval_every": 10,
            "checkpoint_every": 30,
        }
    )
    setup = setup_of(spec)
    assert (setup.framework, setup.workload, setup.steps, setup.batch_size) == (
        "tensorflow",
        "digits_mlp",
        30,
        64,
    )
    assert setup.implementations == {
        "sgd": "sgd (keras)",
        "adam": "adam (tf_legacy)",
        "sgd_legacy": "sgd (tf_legacy)",
    }
