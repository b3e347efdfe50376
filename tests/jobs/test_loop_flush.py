"""The loop reads a step's values at a flush, not every step: every point still arrives exactly once
with its own step, the first non-finite step is still named exactly, and the torch pieces that make
a step cheap (device scalars read in bulk, the foreach gradient norm, device batches) give what the
per-step reads gave."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jobs.batches import BatchOrder
from jobs.errors import Diverged
from jobs.frameworks.torch_driver import Batches, gradient_norm
from jobs.report import Reporter
from jobs.tracking import Point
from jobs.training import loop
from jobs.training.loop import TrainingJob
from optimizers.registry import Registry, load_registry

from .helpers import digits_spec, registry_with

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEP_KEYS = ("train/loss", "train/lr", "train/grad_norm")  # every step
TIMING_KEYS = ("perf/step_time_ms", "perf/optimizer_step_ms", "perf/samples_per_sec")  # every flush


class Recorder:
    """A tracker that keeps every point and which call brought it (`metric` or one `metrics`)."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.calls: list[list[Point]] = []

    def metric(self, key: str, value: float, step: int) -> None:
        self.metrics([Point(key, float(value), int(step), 0)])

    def metrics(self, points: Sequence[Point]) -> None:
        self.calls.append(list(points))
        self.points += points

    def steps(self, key: str) -> list[int]:
        return [p.step for p in self.points if p.key == key]

    def window_ends(self) -> list[int]:
        """The last step of each flush (each call that brought train/loss points)."""
        return [max(p.step for p in call if p.key == "train/loss") for call in self.calls if has_loss(call)]

    def steps_before(self, key: str, step: int) -> list[int]:
        """The steps of `key` delivered before the first point of any key at `step` with another prefix."""
        position = next(
            i for i, p in enumerate(self.points) if p.step == step and not p.key.startswith("train/")
        )
        return [p.step for p in self.points[:position] if p.key == key]


def has_loss(call: list[Point]) -> bool:
    return any(p.key == "train/loss" for p in call)


@pytest.fixture
def no_clock_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flushes by step count and boundaries only: a loaded machine must not move them."""
    monkeypatch.setattr(loop, "FLUSH_EVERY_S", math.inf)


@pytest.fixture
def run_job(tmp_path: Path) -> Iterator[Callable[..., tuple[TrainingJob, Recorder]]]:
    """`run_job(spec, registry=...)` -> the job (not run yet) and its recording tracker."""
    built = load_registry(plugin_dirs=[])
    count = iter(range(1000))

    def make(spec: Any, registry: Registry | None = None) -> tuple[TrainingJob, Recorder]:
        workdir = tmp_path / f"job-{next(count)}"
        workdir.mkdir()
        recorder = Recorder()
        job = TrainingJob(
            spec, registry=registry or built, workdir=workdir, tracker=recorder, reporter=Reporter(workdir)
        )
        return job, recorder

    yield make


# -- every point once, at the right cadence ----------------------------------------------------------


@pytest.mark.usefixtures("no_clock_flush")
def test_every_step_logs_each_key_exactly_once_with_its_own_step(run_job: Callable[..., Any]) -> None:
    spec = digits_spec(steps=130, eval_every=40, checkpoint_every=50)
    job, recorder = run_job(spec)
    outcome = job.run()
    for key in STEP_KEYS:
        assert recorder.steps(key) == list(range(130)), key
    losses = [p.value for p in recorder.points if p.key == "train/loss"]
    assert outcome.final["train_loss"] == losses[-1]
    # Each step's points carry that step's own time, and time only moves forward.
    stamps = {p.step: p.timestamp_ms for p in recorder.points if p.key == "train/loss"}
    assert all(p.timestamp_ms == stamps[p.step] for p in recorder.points if p.key in STEP_KEYS + TIMING_KEYS)
    assert list(stamps.values()) == sorted(stamps.values())
    # The timings once a flush, at its last step: after the first step, before each evaluation
    # (40, 80, 120) and checkpoint (50, 100), at the end.
    ends = recorder.window_ends()
    assert ends == [0, 39, 49, 79, 99, 119, 129]
    for key in TIMING_KEYS:
        assert recorder.steps(key) == ends, key
    # Window means: weighted by their windows' lengths they add up to the run's step time.
    mean_ms = [p.value for p in recorder.points if p.key == "perf/step_time_ms"]
    lengths = np.diff([-1, *ends])
    total_ms = float(np.dot(mean_ms, lengths))
    assert outcome.samples_per_sec == pytest.approx(130 * 32 / (total_ms / 1000))
    rates = [p.value for p in recorder.points if p.key == "perf/samples_per_sec"]
    assert rates == pytest.approx([32 / (ms / 1000) for ms in mean_ms])
    # Each window's optimizer step is a part of its step (the means are not swapped or mixed up).
    optimizer_ms = [p.value for p in recorder.points if p.key == "perf/optimizer_step_ms"]
    assert all(0 < opt <= step for opt, step in zip(optimizer_ms, mean_ms, strict=True))
    assert outcome.step_time_ms_median is not None and outcome.step_time_ms_median > 0


@pytest.mark.usefixtures("no_clock_flush")
def test_a_flush_comes_after_the_first_step_and_every_hundred_steps(run_job: Callable[..., Any]) -> None:
    job, recorder = run_job(digits_spec(steps=250, eval_every=1000, checkpoint_every=1000))
    job.run()
    windows = [[p.step for p in call if p.key == "train/loss"] for call in recorder.calls]
    windows = [steps for steps in windows if steps]
    assert windows == [[0], list(range(1, 101)), list(range(101, 201)), list(range(201, 250))]


def test_the_clock_flushes_too(run_job: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "FLUSH_EVERY_S", 0.0)  # every step is past the deadline
    job, recorder = run_job(digits_spec(steps=12, eval_every=1000, checkpoint_every=1000))
    job.run()
    windows = [[p.step for p in call if p.key == "train/loss"] for call in recorder.calls]
    assert [steps for steps in windows if steps] == [[step] for step in range(12)]


@pytest.mark.usefixtures("no_clock_flush")
def test_evaluations_and_checkpoints_see_every_step_before_them(run_job: Callable[..., Any]) -> None:
    job, recorder = run_job(digits_spec(steps=90, eval_every=40, checkpoint_every=25))
    job.run()
    for key, step in (("val/loss", 40), ("checkpoint/roundtrip_ok", 25), ("checkpoint/roundtrip_ok", 50)):
        assert step in recorder.steps(key)
        assert recorder.steps_before("train/loss", step) == list(range(step)), (key, step)
    last_loss = [p.value for p in recorder.points if p.key == "train/loss"][-1]
    progress = job.reporter._progress
    assert progress is not None and (progress.step, progress.loss) == (90, last_loss)
    assert progress.val_loss == next(p.value for p in recorder.points if p.key == "val/loss" and p.step == 90)


# -- divergence inside a window ----------------------------------------------------------------------

POISONED_UPDATE = 37  # the update that writes NaN: the loss of step 37 (0-based) is the first NaN


class PoisonAt37(torch.optim.SGD):
    """Plain SGD until its 37th update, which writes NaN into the weights: step 37's loss is NaN."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, lr=lr)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        super().step()
        group = self.param_groups[0]
        group["updates"] = group.get("updates", 0) + 1
        if group["updates"] == POISONED_UPDATE:
            for p in group["params"]:
                p.fill_(math.nan)
        return None


class FailAt45(torch.optim.SGD):
    """Plain SGD that raises in its 46th update (step 45), as a buggy optimizer does."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        group = self.param_groups[0]
        group["updates"] = group.get("updates", 0) + 1
        if group["updates"] == 46:
            raise RuntimeError("broken on purpose")
        return super().step()


@pytest.mark.usefixtures("no_clock_flush")
def test_a_nan_mid_window_is_named_at_its_step_and_nothing_after_it_is_logged(
    run_job: Callable[..., Any],
) -> None:
    spec = digits_spec(
        optimizer={"name": "poison_at37", "params": {"lr": 0.05}},
        steps=80,
        checkpoint_every=30,
        eval_every=1000,
    )
    job, recorder = run_job(spec, registry_with(PoisonAt37))
    with pytest.raises(Diverged) as raised:
        job.run()
    assert raised.value.step == POISONED_UPDATE
    assert "train/loss became nan at step 37" in str(raised.value)
    for key in STEP_KEYS:
        assert recorder.steps(key) == list(range(POISONED_UPDATE)), key
    for key in TIMING_KEYS:  # the diverging window's good steps still get their timings
        assert recorder.steps(key) == [0, 29, POISONED_UPDATE - 1], key
    assert all(math.isfinite(p.value) for p in recorder.points if p.key == "train/loss")
    # Progress shows the steps taken before the NaN (it had stayed at step 30's flush).
    progress = json.loads((job.reporter.workdir / "progress.json").read_text())
    last_good = next(
        p.value for p in recorder.points if p.key == "train/loss" and p.step == POISONED_UPDATE - 1
    )
    assert (progress["step"], progress["loss"]) == (POISONED_UPDATE, last_good)
    # The checkpoint at 30 was verified; none was taken of the diverged weights (60 is never reached).
    assert [(c.step, c.ok) for c in job.verified] == [(30, True)]
    assert [p.name for p in job.checkpoint_dir.iterdir()] == ["step-00000030.pt"]


@pytest.mark.usefixtures("no_clock_flush")
def test_a_step_that_raises_still_delivers_the_steps_before_it(run_job: Callable[..., Any]) -> None:
    spec = digits_spec(
        optimizer={"name": "fail_at45", "params": {"lr": 0.05}}, steps=80, checkpoint_every=1000
    )
    job, recorder = run_job(spec, registry_with(FailAt45))
    with pytest.raises(RuntimeError, match="broken on purpose"):
        job.run()
    for key in STEP_KEYS:
        assert recorder.steps(key) == list(range(45)), key
    for key in TIMING_KEYS:
        assert recorder.steps(key)[-1] == 44 and recorder.steps(key) == recorder.window_ends(), key


# -- the torch session's side ------------------------------------------------------------------------


def test_a_torch_step_returns_detached_device_scalars(run_job: Callable[..., Any]) -> None:
    job, _ = run_job(digits_spec())
    session = job.session
    objects = session.build()
    record = session.train_step(objects, session.batch(0), 0)
    for value in (record.loss, record.grad_norm):
        assert isinstance(value, torch.Tensor) and value.dim() == 0
        assert value.grad_fn is None and not value.requires_grad
    assert isinstance(record.optimizer_ms, float) and record.step_ms is None  # the CPU: host clock


class Deferred:
    """Something `float()` reads, as a CUDA event timing is."""

    def __float__(self) -> float:
        return 2.5


def test_to_floats_reads_tensors_and_other_values_in_order(run_job: Callable[..., Any]) -> None:
    session = run_job(digits_spec())[0].session
    values = [
        torch.tensor(1.5),
        3.0,
        torch.tensor(math.nan),
        Deferred(),
        torch.tensor(0.1, dtype=torch.float64),
        torch.tensor(math.inf, requires_grad=True) * 1,
        7,
    ]
    floats = session.to_floats(values)
    assert floats[:2] == [1.5, 3.0] and math.isnan(floats[2])
    assert floats[3:] == [2.5, 0.1, math.inf, 7.0]
    assert all(type(value) is float for value in floats)
    assert session.to_floats([]) == []


def per_parameter_norm(parameters: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradient norm as the driver took it before (one norm per parameter, coalescing sparse ones)."""
    norms = [
        p.grad.coalesce().values().norm() if p.grad.is_sparse else p.grad.norm()
        for p in parameters
        if p.grad is not None
    ]
    return torch.stack(norms).norm()


def test_the_foreach_gradient_norm_equals_the_per_parameter_one_bitwise() -> None:
    torch.manual_seed(0)
    params = [torch.randn(shape, requires_grad=True) for shape in ((64, 32), (32,), (10, 64), (10,))]
    for p in params[:3]:  # the last has no gradient
        p.grad = torch.randn_like(p) * 1e3
    assert torch.equal(gradient_norm(params), per_parameter_norm(params))
    assert gradient_norm([torch.zeros(2, requires_grad=True)]) == 0.0


def test_a_sparse_gradient_is_coalesced_before_its_norm() -> None:
    table = torch.zeros(5, 2, requires_grad=True)
    dense = torch.ones(3, requires_grad=True)
    # Row 1 twice: summed (norm of [2, 2] per column), not two separate rows.
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1, 3]]), torch.ones(3, 2), (5, 2))
    dense.grad = torch.full((3,), 2.0)
    norm = gradient_norm([table, dense])
    assert torch.equal(norm, per_parameter_norm([table, dense]))
    assert norm.item() == pytest.approx(math.sqrt(4 + 4 + 1 + 1 + 3 * 4))


def test_a_gradient_norm_never_extends_a_create_graph_graph() -> None:
    weight = torch.ones(3, requires_grad=True)
    (weight**3).sum().backward(create_graph=True)
    assert weight.grad is not None and weight.grad.requires_grad
    norm = gradient_norm([weight])
    assert isinstance(norm, torch.Tensor) and not norm.requires_grad


# -- batches on the device are BatchOrder's rows -------------------------------------------------------


@pytest.mark.parametrize(
    ("n_rows", "batch_size", "seed", "share"),
    [(97, 8, 0, (0, 1)), (97, 8, 3, (1, 2)), (50, 10, 7, (2, 5)), (10, 10, 1, (0, 1))],
)
def test_device_batches_are_batch_order_rows(
    n_rows: int, batch_size: int, seed: int, share: tuple[int, int]
) -> None:
    x = torch.arange(n_rows * 2, dtype=torch.float32).reshape(n_rows, 2)
    y = torch.arange(n_rows)
    batches = Batches(x, y, batch_size=batch_size, seed=seed, share=share)
    order = BatchOrder(n_rows, batch_size=batch_size, seed=seed)
    rank, ranks = share
    size = batch_size // ranks
    for step in [*range(3 * order.per_epoch), 40, 7, 0]:  # three epochs, then out of order
        expected = order.rows(step)[rank * size : (rank + 1) * size]
        features, labels = batches(step)
        assert labels.tolist() == expected.tolist(), step
        assert torch.equal(features, x[torch.from_numpy(expected)])
