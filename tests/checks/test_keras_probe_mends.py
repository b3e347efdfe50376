"""Faults a probe of the Keras 3 and legacy tf.keras checks found passed or misdiagnosed
(/tmp/probe_keras/REPORT.md: M1..M6, F1, D1..D3, C1), each as a small class here, with the check
that now catches it, and the correct pattern beside it where one could be taken for the fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome
from jobs.checks.runner import checks_for_style
from tests.checks.tables import target_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("keras-probe-mends")


def _run(check_id: str, name: str, workdir: Path, style: str | None = None) -> Outcome:
    ctx = CheckContext(target=target_of(f"{__name__}:{name}", style), params={}, workdir=workdir)
    return checks_for_style(ctx.target.style)[check_id](ctx)


class _LegacyMomentum(tf_keras.optimizers.legacy.Optimizer):
    """Legacy heavy-ball momentum, correct: the base the legacy faults below change one thing of."""

    def __init__(
        self,
        learning_rate: object = 0.01,
        momentum: float = 0.9,
        name: str = "LegacyMomentum",
        **kwargs: object,
    ) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("momentum", momentum)

    def _create_slots(self, var_list: list[tf.Variable]) -> None:
        for var in var_list:
            self.add_slot(var, "momentum")

    def _resource_apply_dense(self, grad: tf.Tensor, var: tf.Variable, apply_state: object = None) -> object:
        dtype = var.dtype.base_dtype
        slot = self.get_slot(var, "momentum")
        velocity = slot.assign(self._get_hyper("momentum", dtype) * slot + grad)
        return var.assign_sub(self._decayed_lr(dtype) * velocity)

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        config["momentum"] = self._serialize_hyperparameter("momentum")
        return config

    def _resource_apply_sparse(
        self, grad: tf.Tensor, var: tf.Variable, indices: tf.Tensor, apply_state: object = None
    ) -> object:
        dtype = var.dtype.base_dtype
        slot = self.get_slot(var, "momentum")
        rows = self._get_hyper("momentum", dtype) * tf.gather(slot, indices) + grad
        with tf.control_dependencies([self._resource_scatter_update(slot, indices, rows)]):
            return self._resource_scatter_add(var, indices, -self._decayed_lr(dtype) * rows)


class TraceCachedRateMomentum(_LegacyMomentum):
    """M1: the rate read in _create_slots, which apply_gradients runs under init_scope at every eager
    call but only once, when traced, inside a tf.function: eager steps follow a schedule, fit's do not."""

    def _create_slots(self, var_list: list[tf.Variable]) -> None:
        super()._create_slots(var_list)
        self._rate_cache = float(self._decayed_lr(tf.float32).numpy())

    def _resource_apply_dense(self, grad: tf.Tensor, var: tf.Variable, apply_state: object = None) -> object:
        dtype = var.dtype.base_dtype
        slot = self.get_slot(var, "momentum")
        velocity = slot.assign(self._get_hyper("momentum", dtype) * slot + grad)
        return var.assign_sub(tf.constant(self._rate_cache, dtype) * velocity)


# -- M1: a rate frozen when traced --------------------------------------------------------------------------


def test_a_rate_cached_when_traced_fails_graph_mode(workdir: Path) -> None:
    outcome = _run("graph_mode", "TraceCachedRateMomentum", workdir, "tf_legacy")
    assert outcome.status == "fail", outcome.detail
    assert "LearningRateSchedule" in outcome.detail and "read at trace time" in outcome.detail
    assert "test_keras_probe_mends.py:" in outcome.where


def test_a_rate_read_every_step_passes_graph_mode(workdir: Path) -> None:
    outcome = _run("graph_mode", "_LegacyMomentum", workdir, "tf_legacy")
    assert outcome.status == "pass", outcome.detail


# -- M2: a schedule stored as its current value -------------------------------------------------------------


class ValueConfigAdam(keras.optimizers.Adam):
    """M2: get_config stores the rate the schedule gives now: a reload trains at that rate for good."""

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["learning_rate"] = float(keras.ops.convert_to_numpy(self.learning_rate))
        return config


class ValueConfigMomentum(_LegacyMomentum):
    """M2, legacy: the current value of `_decayed_lr` stored where the serialized schedule belongs."""

    def get_config(self) -> dict[str, object]:
        config = super().get_config()
        config["learning_rate"] = float(self._decayed_lr(tf.float32).numpy())
        return config


@pytest.mark.parametrize(("name", "style"), [("ValueConfigAdam", None), ("ValueConfigMomentum", "tf_legacy")])
def test_a_schedule_stored_as_its_value_fails_config_roundtrip(
    name: str, style: str | None, workdir: Path
) -> None:
    outcome = _run("config_roundtrip", name, workdir, style)
    assert outcome.status == "fail", outcome.detail
    assert "stores the schedule's current value" in outcome.detail and "constant rate" in outcome.detail
    assert "_serialize_hyperparameter" in outcome.detail
    assert "test_keras_probe_mends.py:" in outcome.where


def test_a_serialized_schedule_passes_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "_LegacyMomentum", workdir, "tf_legacy")
    assert outcome.status == "pass", outcome.detail


# -- M3: numpy noise, drawn once when traced ----------------------------------------------------------------


class NumpyNoiseSGD(keras.optimizers.Optimizer):
    """M3: SGLD noise drawn with numpy in update_step: under tf.function it is drawn once, when
    traced, and the same 'noise' is added at every step."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        noise = np.random.normal(0.0, 1e-3, size=tuple(variable.shape)).astype("float32")
        rate = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, keras.ops.multiply(gradient, rate) + noise)


class SeededSGLD(keras.optimizers.Optimizer):
    """SGLD as Keras documents random draws in layers: a SeedGenerator, keras.random in the step.
    Its generator's state is not among optimizer.variables, so a checkpoint misses it (F1)."""

    def __init__(self, learning_rate: float = 0.01, seed: int = 0, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        noise = keras.random.normal(tuple(variable.shape), stddev=1e-3, seed=self.seed_generator)
        rate = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, keras.ops.multiply(gradient, rate) + noise)

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["seed"] = self.seed
        return config


class TrackedSeedSGLD(SeededSGLD):
    """SeededSGLD with its generator's state registered, so every save holds it (F1's fix)."""

    def build(self, var_list: list[keras.Variable]) -> None:
        super().build(var_list)
        self._track_variable(self.seed_generator.state)


def test_numpy_noise_frozen_when_traced_fails_graph_mode(workdir: Path) -> None:
    outcome = _run("graph_mode", "NumpyNoiseSGD", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "runs no random op" in outcome.detail and "keras.random" in outcome.detail


def test_keras_random_noise_stays_an_inconclusive_graph_mode(workdir: Path) -> None:
    outcome = _run("graph_mode", "SeededSGLD", workdir)
    assert outcome.status == "skip", outcome.detail


# -- M6: a legacy override that skips the base class's summing of repeated ids ------------------------------


class UnsummedSparseMomentum(_LegacyMomentum):
    """M6: repeated ids go straight to the gather / scatter_update path: all but one of their rows
    are lost in the momentum. tf.keras's base class sums them first for every built-in."""

    def _resource_apply_sparse_duplicate_indices(
        self, grad: tf.Tensor, handle: tf.Variable, indices: tf.Tensor, **kwargs: object
    ) -> object:
        return self._resource_apply_sparse(grad, handle, indices, **kwargs)


def test_a_legacy_override_that_skips_summing_repeated_ids_fails_sparse(workdir: Path) -> None:
    outcome = _run("sparse", "UnsummedSparseMomentum", workdir, "tf_legacy")
    assert outcome.status == "fail", outcome.detail
    assert "_resource_apply_sparse_duplicate_indices" in outcome.detail and "skips that" in outcome.detail
    assert "test_keras_probe_mends.py:" in outcome.where


def test_a_legacy_sparse_update_the_base_sums_repeats_for_passes_sparse(workdir: Path) -> None:
    outcome = _run("sparse", "_LegacyMomentum", workdir, "tf_legacy")
    assert outcome.status == "pass", outcome.detail


# -- F1: a Keras SeedGenerator a save does not hold ---------------------------------------------------------


def test_an_untracked_seed_generator_is_named_with_the_keras_fix(workdir: Path) -> None:
    outcome = _run("state_roundtrip", "SeededSGLD", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "self.seed_generator is a random number generator (keras.SeedGenerator)" in outcome.detail
    assert "Fix: " in outcome.detail
    fix = outcome.detail.split("Fix: ", 1)[1]
    assert "self._track_variable(self.seed_generator.state)" in fix and "torch" not in fix


def test_a_tracked_seed_generator_passes_state_roundtrip(workdir: Path) -> None:
    outcome = _run("state_roundtrip", "TrackedSeedSGLD", workdir)
    assert outcome.status == "pass", outcome.detail


# -- M4: a from_config that drops a switch ------------------------------------------------------------------


class WhitelistAdam(keras.optimizers.Adam):
    """M4: from_config keeps the keys written before amsgrad was added: a reload turns AMSGrad off."""

    @classmethod
    def from_config(cls, config: dict[str, object], custom_objects: object = None) -> WhitelistAdam:
        kept = ("learning_rate", "beta_1", "beta_2", "epsilon", "name")
        return cls(**{key: config[key] for key in kept if key in config})  # type: ignore[arg-type]


def test_a_from_config_that_drops_a_switch_fails_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "WhitelistAdam", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "amsgrad built as True comes back from from_config() as False" in outcome.detail
    assert "test_keras_probe_mends.py:" in outcome.where


def test_keras_s_own_from_config_keeps_every_switch(workdir: Path) -> None:
    ctx = CheckContext(target=target_of("keras.optimizers:Adam"), params={}, workdir=workdir)
    outcome = checks_for_style(ctx.target.style)["config_roundtrip"](ctx)
    assert outcome.status == "pass", outcome.detail


# -- C1: a Keras 3 update that crashes on tf.IndexedSlices is offered the one-line dense fix -----------------


class ScaledSGD(keras.optimizers.Optimizer):
    """SGD whose math (a Python float times the gradient) raises on tf.IndexedSlices."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        self.assign_sub(variable, 0.5 * gradient * keras.ops.cast(learning_rate, variable.dtype))  # type: ignore[operator]


class DensifiedScaledSGD(ScaledSGD):
    """ScaledSGD with its gradient made dense first, the fix offered."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        super().update_step(tf.convert_to_tensor(gradient), variable, learning_rate)


def test_a_sparse_crash_is_offered_to_make_the_gradient_dense(workdir: Path) -> None:
    outcome = _run("sparse", "ScaledSGD", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "gradient = tf.convert_to_tensor(gradient)" in outcome.detail


def test_a_gradient_made_dense_passes_sparse(workdir: Path) -> None:
    """Plain SGD moves no row the gradient did not touch, dense or not."""
    outcome = _run("sparse", "DensifiedScaledSGD", workdir)
    assert outcome.status == "pass", outcome.detail


# -- M5: a rate never cast to the variable's dtype ----------------------------------------------------------


class UncastRateSGD(keras.optimizers.Optimizer):
    """M5: the float32 rate mixed with the variable uncast: fine under mixed_float16 (float32
    variables), raises on bfloat16 ones."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        variable.assign(variable - learning_rate * gradient)  # type: ignore[operator]


def test_a_rate_never_cast_fails_mixed_precision_on_bfloat16_variables(workdir: Path) -> None:
    outcome = _run("mixed_precision", "UncastRateSGD", workdir)
    assert outcome.status == "fail", outcome.detail
    assert (
        "bfloat16 variables" in outcome.detail and "ops.cast(learning_rate, variable.dtype)" in outcome.detail
    )
    assert "test_keras_probe_mends.py:" in outcome.where


def test_a_rate_cast_passes_mixed_precision(workdir: Path) -> None:
    outcome = _run("mixed_precision", "ScaledSGD", workdir)
    assert outcome.status == "pass", outcome.detail


# -- D2: none_grads points at the class's own apply() override --------------------------------------------


class ZeroFillAdam(keras.optimizers.Adam):
    """D2: apply() replaces None gradients by zeros, so a frozen variable moves on its momentum."""

    def apply(self, grads: list[object], trainable_variables: object = None) -> object:
        if trainable_variables is not None:
            grads = [
                keras.ops.zeros_like(v) if g is None else g
                for g, v in zip(grads, trainable_variables, strict=True)  # type: ignore[call-overload]
            ]
        return super().apply(grads, trainable_variables)  # type: ignore[arg-type]


def test_none_grads_points_at_the_apply_override_that_fills_them(workdir: Path) -> None:
    outcome = _run("none_grads", "ZeroFillAdam", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "the class's own apply() override" in outcome.detail
    line = int(outcome.where.rsplit(":", 1)[1])
    source = Path(__file__).read_text().splitlines()
    assert "def apply(" in source[line - 1]


# -- D1: self.iterations written by the class --------------------------------------------------------------


class CountingSGD(keras.optimizers.Optimizer):
    """D1: increments self.iterations in update_step, which Keras already does once per apply()."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        self.assign_sub(variable, keras.ops.multiply(gradient, keras.ops.cast(learning_rate, variable.dtype)))
        self.iterations.assign_add(1)


def test_iterations_counted_by_hand_fails_schedule_at_that_line(workdir: Path) -> None:
    outcome = _run("schedule", "CountingSGD", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "self.iterations is" in outcome.detail and "never assign to self.iterations" in outcome.detail
    line = int(outcome.where.rsplit(":", 1)[1])
    assert "self.iterations.assign_add(1)" in Path(__file__).read_text().splitlines()[line - 1]
