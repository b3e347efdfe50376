"""The study workloads train in every style through the real loop: checkpoints verified by the job's
own round trip, the metrics a study reads (val/loss, val/bits_per_char, traj/x, traj/y), the same
start in every framework, and clear failures for bad data."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.report import Reporter
from jobs.result import TrainOutcome
from jobs.spec import JobSpec
from jobs.training.loop import TrainingJob
from jobs.workloads.surfaces import ROSENBROCK_DEFAULTS, rosenbrock_value, surface_for
from optimizers.registry import load_registry
from tests.jobs.test_optimizer_metrics import RecordingTracker
from tests.jobs.workloads.conftest import NPZ_FILE

# Every workload is trained once (`runs`): on one pytest-xdist worker, not on each one that runs
# some of these tests.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread", "data_root"),
    pytest.mark.xdist_group("study_workloads"),
]

TINY_LM = {"layers": 1, "width": 16, "heads": 2, "context": 16, "corpus_chars": 20_000}
# workload -> (params, optimizer, lr, the val metrics it logs beside val/loss)
WORKLOADS: dict[str, tuple[dict[str, Any], str, float, set[str]]] = {
    "quadratic": ({"dim": 2, "condition": 50.0}, "adam", 0.05, set()),
    "rosenbrock": ({}, "adam", 0.05, set()),
    "char_lm": (TINY_LM, "adam", 3e-3, {"val/bits_per_char"}),
    "npz": ({"path": NPZ_FILE, "hidden": 16, "layers": 1}, "adam", 0.01, {"val/accuracy"}),
}
STYLES = ("torch", "keras", "tf_legacy")
# Legacy tf.keras builds char_lm and npz from the same Keras layers as Keras 3 (their models'
# equality, init and file round trips are test_models'); training them again there costs 15 s.
STYLES_OF = {"quadratic": STYLES, "rosenbrock": STYLES, "char_lm": STYLES[:2], "npz": STYLES[:2]}
STEPS = 6


def spec_for(name: str, style: str, **overrides: Any) -> JobSpec:
    params, optimizer, lr, _ = WORKLOADS[name]
    choice: dict[str, Any] = {"name": optimizer, "params": {"lr": lr}}
    if style != "torch":
        choice["style"] = style
    body = {
        "framework": "torch" if style == "torch" else "tensorflow",
        "workload": {"name": name, "params": params},
        "optimizer": choice,
        "steps": STEPS,
        "batch_size": 8,
        "checkpoint_every": STEPS,  # one verified round trip: a Keras checkpoint costs seconds
        "eval_every": 3,
        "device": "cpu",
        **overrides,
    }
    return JobSpec.model_validate(body)


def train(spec: JobSpec, workdir: Path) -> tuple[RecordingTracker, TrainOutcome]:
    style = spec.optimizer.style or "torch"
    registry = load_registry(plugin_dirs=[], styles=(style,))
    tracker = RecordingTracker()
    workdir.mkdir(parents=True, exist_ok=True)
    job = TrainingJob(spec, registry=registry, workdir=workdir, tracker=tracker, reporter=Reporter(workdir))
    return tracker, job.run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> dict[tuple[str, str], Any]:
    """Every workload in every style, trained once for all the tests below."""
    import torch

    torch.set_num_threads(1)
    trained = {}
    for workload in WORKLOADS:
        for style in STYLES_OF[workload]:
            workdir = tmp_path_factory.mktemp(f"{workload}-{style}")
            trained[workload, style] = train(spec_for(workload, style), workdir)
    return trained


@pytest.mark.parametrize(
    ("workload", "style"), [(workload, style) for workload in WORKLOADS for style in STYLES_OF[workload]]
)
def test_trains_with_its_checkpoint_verified(workload: str, style: str, runs: dict[Any, Any]) -> None:
    tracker, outcome = runs[workload, style]
    assert outcome.steps_completed == STEPS
    assert [c.step for c in outcome.checkpoints] == [STEPS] and outcome.checkpoints_verified == 1
    assert tracker.series("checkpoint/roundtrip_ok") == [(STEPS, 1.0)]
    logged = tracker.keys("val/")
    assert logged == {"val/loss", *WORKLOADS[workload][3]}
    losses = [value for _, value in tracker.series("train/loss")]
    assert losses[-1] < losses[0], losses  # a few steps already go downhill


@pytest.mark.parametrize("workload", ["quadratic", "rosenbrock"])
def test_every_framework_starts_from_the_same_point(workload: str, runs: dict[Any, Any]) -> None:
    """A fixed start: the same loss up to float32 rounding (random initial weights of the same scheme
    give the same scale: test_models' initial-loss test)."""
    first = {style: runs[workload, style][0].series("train/loss")[0][1] for style in STYLES}
    assert max(first.values()) == pytest.approx(min(first.values()), rel=1e-6), first


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("workload", ["quadratic", "rosenbrock"])
def test_two_dimensional_functions_log_their_trajectory(
    workload: str, style: str, runs: dict[Any, Any]
) -> None:
    tracker, outcome = runs[workload, style]
    xs, ys = tracker.series("traj/x"), tracker.series("traj/y")
    assert [step for step, _ in xs] == [step for step, _ in ys] == list(range(STEPS + 1))
    # Every logged position is on the function the loss measured: f(traj) is train/loss at that step.
    surface = surface_for(workload, WORKLOADS[workload][0])
    assert surface is not None
    for (step, x), (_, y), (_, loss) in zip(xs, ys, tracker.series("train/loss"), strict=False):
        assert float(surface.f(np.array(x), np.array(y))) == pytest.approx(loss, rel=1e-4), step
    # val/loss at the end is f at the last position.
    last = float(surface.f(np.array(xs[-1][1]), np.array(ys[-1][1])))
    assert outcome.final["val_loss"] == pytest.approx(last, rel=1e-4)


def test_char_lm_bits_per_char_is_the_loss_in_bits(runs: dict[Any, Any]) -> None:
    tracker, outcome = runs["char_lm", "torch"]
    for (_, nats), (_, bits) in zip(
        tracker.series("val/loss"), tracker.series("val/bits_per_char"), strict=True
    ):
        assert bits == pytest.approx(nats / math.log(2))
    assert outcome.final["val_bits_per_char"] < math.log2(128) + 1  # near uniform at worst


def test_surfaces_for_the_report() -> None:
    rosenbrock = surface_for("rosenbrock", {})
    assert rosenbrock is not None and rosenbrock.minimum == (1.0, 1.0)
    start = (ROSENBROCK_DEFAULTS["start_x"], ROSENBROCK_DEFAULTS["start_y"])
    assert rosenbrock.xlim[0] <= start[0] <= rosenbrock.xlim[1]
    grid = rosenbrock.f(np.array([[1.0, -1.2]]), np.array([[1.0, 1.0]]))
    np.testing.assert_allclose(grid, [[0.0, rosenbrock_value(np.array(-1.2), np.array(1.0))]])
    quadratic = surface_for("quadratic", {"dim": 2, "condition": 100.0})
    assert quadratic is not None and float(quadratic.f(np.array(0.0), np.array(0.0))) == 0.0
    assert surface_for("quadratic", {"dim": 3}) is None
    assert surface_for("char_lm", {}) is None


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"X": np.zeros((10, 2)), "labels": np.zeros(10)}, "has no array 'y'; it holds 'X', 'labels'"),
        (
            {"X": np.zeros((10, 2)), "y": np.zeros(9)},
            r"y must be 1-D with one value per row of X \(10 rows\)",
        ),
        ({"X": np.array([["a", "b"]] * 4), "y": np.zeros(4)}, "X must be numeric; received dtype <U1"),
        ({"X": np.full((4, 2), np.nan), "y": np.zeros(4)}, "X holds NaN or infinite values"),
        ({"X": np.zeros((4, 2)), "y": np.array([0, 1, -1, 2])}, "integer y are class labels"),
    ],
)
def test_npz_with_bad_arrays_fails_the_job_saying_what_is_wrong(
    arrays: dict[str, np.ndarray], message: str, data_root: Path, tmp_path: Path
) -> None:
    name = f"bad-{abs(hash(message)) % 10**8}.npz"
    np.savez(data_root / name, **arrays)  # type: ignore[arg-type]
    spec = spec_for("npz", "torch", workload={"name": "npz", "params": {"path": name}})
    with pytest.raises(ValueError, match=message):
        train(spec, tmp_path)


def test_npz_regression_from_floating_targets(data_root: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    features = rng.normal(size=(120, 3))
    np.savez(data_root / "regression.npz", X=features, y=features @ np.array([1.0, -2.0, 0.5]))
    spec = spec_for("npz", "torch", workload={"name": "npz", "params": {"path": "regression.npz"}})
    tracker, outcome = train(spec, tmp_path)
    assert tracker.keys("val/") == {"val/loss", "val/rmse"}
    assert outcome.final["val_rmse"] == pytest.approx(math.sqrt(outcome.final["val_loss"]))
