"""`optim/...` metrics and the result's `optimizer_state`: what an optimizer holds and adapts, logged
by the one training loop for every style."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.report import Reporter
from jobs.result import TrainOutcome
from jobs.spec import JobSpec
from jobs.tracking import Point
from jobs.training.loop import TrainingJob
from optimizers.registry import Registry, entry_for_class, load_registry

from .helpers import digits_spec


class RecordingTracker:
    """A real Tracker that keeps every point, so a test reads what MLflow would receive."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float, int]] = []

    def metric(self, key: str, value: float, step: int) -> None:
        self.points.append((key, float(value), step))

    def metrics(self, points: Sequence[Point]) -> None:
        for point in points:
            self.metric(point.key, point.value, point.step)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, value) for name, value, step in self.points if name == key]

    def keys(self, prefix: str) -> set[str]:
        return {name for name, _, _ in self.points if name.startswith(prefix)}


def train(
    spec: JobSpec, registry: Registry, workdir: Path
) -> tuple[TrainingJob, RecordingTracker, TrainOutcome]:
    tracker = RecordingTracker()
    job = TrainingJob(spec, registry=registry, workdir=workdir, tracker=tracker, reporter=Reporter(workdir))
    return job, tracker, job.run()


# -- torch ---------------------------------------------------------------------------------------------


def growing_d_class() -> type:
    import torch

    class GrowingD(torch.optim.Optimizer):
        """SGD scaled by a `d` it raises each step in its param groups, as Prodigy adapts its `d`;
        the first parameter in a group of its own, so the second group's `d` is named by its index."""

        optlab_name = "growing_d"

        def __init__(self, params: Any, lr: float = 0.05, growth: float = 0.01, weight_decay: float = 0.0):
            params = list(params)
            groups = [{"params": params[:1]}, {"params": params[1:], "growth": 2 * growth}]
            super().__init__(groups, {"lr": lr, "growth": growth, "weight_decay": weight_decay, "d": 1.0})

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                group["d"] += group["growth"]
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad + group["weight_decay"] * p, alpha=-group["lr"] * group["d"])

    return GrowingD


@pytest.mark.usefixtures("one_torch_thread")
def test_a_value_the_optimizer_adapts_is_logged_per_group_and_constants_are_not(tmp_path: Path) -> None:
    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(growing_d_class(), source="test"))
    spec = digits_spec(
        optimizer={"name": "growing_d", "params": {"lr": 0.05, "weight_decay": 0.001}},
        steps=12,
        eval_every=5,
        checkpoint_every=5,
    )
    _, tracker, outcome = train(spec, registry, tmp_path)
    # From right after the first step, then at the evaluation cadence and the end only.
    d = tracker.series("optim/d")
    assert [step for step, _ in d] == [1, 5, 10, 12]
    assert [value for _, value in d] == pytest.approx([1.01, 1.05, 1.10, 1.12])
    assert [value for _, value in tracker.series("optim/d/group1")] == pytest.approx([1.02, 1.10, 1.20, 1.24])
    # growth, weight_decay and the scheduled lr never change on their own: not logged.
    assert tracker.keys("optim/") == {
        "optim/d",
        "optim/d/group1",
        "optim/state_bytes",
        "optim/state_to_param_ratio",
    }
    assert outcome.optimizer_state is not None
    assert outcome.optimizer_state.adapted == pytest.approx({"d": 1.12, "d/group1": 1.24})
    assert outcome.optimizer_state.state_bytes == 0  # it keeps no tensors


@pytest.mark.usefixtures("one_torch_thread")
def test_adamw_state_is_two_copies_of_the_parameters_plus_its_step_counters(tmp_path: Path) -> None:
    import torch

    spec = digits_spec(optimizer={"name": "adamw", "params": {"lr": 0.001}}, steps=6, eval_every=3)
    job, tracker, outcome = train(spec, load_registry(plugin_dirs=[]), tmp_path)
    params = list(job.session.build().model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    # torch.optim.AdamW keeps exp_avg and exp_avg_sq like each parameter, and a 0-d float32 `step`.
    state_bytes = 2 * param_bytes + len(params) * torch.tensor(0.0).element_size()
    assert tracker.series("optim/state_bytes") == [(1, state_bytes), (6, state_bytes)]
    assert [v for _, v in tracker.series("optim/state_to_param_ratio")] == [state_bytes / param_bytes] * 2
    assert outcome.optimizer_state is not None
    assert outcome.optimizer_state.param_bytes == param_bytes
    assert outcome.optimizer_state.state_to_param_ratio == pytest.approx(2.0, abs=0.01)
    assert outcome.optimizer_state.adapted == {}  # betas, eps and weight_decay are constants
    assert not tracker.keys("optim/") - {"optim/state_bytes", "optim/state_to_param_ratio"}


def gradient_history_class() -> type:
    import torch

    class GradientHistory(torch.optim.Optimizer):
        """Steps by the mean of the last `k` gradients, kept as a list of copies in its state (as
        SOAP keeps its per-dimension `Q` and `GG` in lists)."""

        optlab_name = "gradient_history"

        def __init__(self, params: Any, lr: float = 0.05, k: int = 3):
            super().__init__(params, {"lr": lr, "k": k})

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    history = self.state[p].setdefault("history", [])
                    history[:] = [*history[-(group["k"] - 1) :], p.grad.clone()]
                    p.sub_(torch.stack(history).mean(0), alpha=group["lr"])

    return GradientHistory


@pytest.mark.usefixtures("one_torch_thread")
def test_state_tensors_held_in_a_list_are_counted(tmp_path: Path) -> None:
    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(gradient_history_class(), source="test"))
    spec = digits_spec(optimizer={"name": "gradient_history", "params": {"k": 3}}, steps=4, eval_every=4)
    job, tracker, outcome = train(spec, registry, tmp_path)
    param_bytes = sum(p.numel() * p.element_size() for p in job.session.build().model.parameters())
    # One gradient copy after the first step, three (k) from the third on.
    assert tracker.series("optim/state_bytes") == [(1, param_bytes), (4, 3 * param_bytes)]
    assert outcome.optimizer_state is not None
    assert outcome.optimizer_state.state_to_param_ratio == pytest.approx(3.0)


# -- Keras 3 and tf.keras ------------------------------------------------------------------------------


def tf_spec(optimizer: str, style: str, **overrides: Any) -> JobSpec:
    body: dict[str, Any] = {
        "framework": "tensorflow",
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": optimizer, "style": style, "params": {"lr": 0.01}},
        "steps": 6,
        "batch_size": 32,
        "checkpoint_every": 6,
        "eval_every": 3,
        **overrides,
    }
    return JobSpec.model_validate(body)


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_keras_adam_state_is_about_twice_the_parameters(style: str, tmp_path: Path) -> None:
    registry = load_registry(plugin_dirs=[], styles=(style,))
    job, tracker, outcome = train(tf_spec("adam", style), registry, tmp_path)
    param_bytes = sum(np.asarray(v.numpy()).nbytes for v in job.session.build().model.trainable_variables)
    state = outcome.optimizer_state
    assert state is not None and state.param_bytes == param_bytes
    # A momentum and a velocity like each weight, and the int64 iteration counter.
    assert state.state_bytes == 2 * param_bytes + np.dtype(np.int64).itemsize
    assert state.state_to_param_ratio == pytest.approx(2.0, abs=0.01)
    assert [step for step, _ in tracker.series("optim/state_bytes")] == [1, 6]
    assert state.adapted == {}  # beta_1, beta_2, epsilon: constants, and the counter is not one
    assert tracker.keys("optim/") == {"optim/state_bytes", "optim/state_to_param_ratio"}


GROWING_D = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class GrowingD(keras.optimizers.Optimizer):
    '''SGD scaled by an estimate `d` kept in a 0-d variable that grows with the step count.'''

    def __init__(self, learning_rate=0.01, growth=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.growth = growth

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.d = self.add_variable(shape=(), initializer="ones", name="d")

    def update_step(self, gradient, variable, learning_rate):
        # The same value for every variable of a step: `iterations` advances after all of them.
        self.assign(self.d, 1.0 + self.growth * keras.ops.cast(self.iterations + 1, "float32"))
        self.assign_sub(variable, learning_rate * self.d * gradient)

    def get_config(self):
        return {**super().get_config(), "growth": self.growth}
"""


def test_a_keras_0d_variable_the_optimizer_adapts_is_logged(tmp_path: Path) -> None:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "growing_d.py").write_text(GROWING_D)
    registry = load_registry(plugin_dirs=[str(folder)], styles=("keras",))
    _, tracker, outcome = train(tf_spec("growing_d", "keras"), registry, tmp_path / "job")
    assert [step for step, _ in tracker.series("optim/d")] == [1, 3, 6]
    assert [value for _, value in tracker.series("optim/d")] == pytest.approx([1.01, 1.03, 1.06])
    assert tracker.keys("optim/") == {"optim/d", "optim/state_bytes", "optim/state_to_param_ratio"}
    assert outcome.optimizer_state is not None and outcome.optimizer_state.adapted == pytest.approx(
        {"d": 1.06}
    )
