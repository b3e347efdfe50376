"""Faults and false alarms a probe of the Keras 3 and legacy tf.keras checks found (/tmp/probeB), each
as a small class here with the check that now judges it rightly, the correct pattern beside a fault
where one could be taken for the other.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import pytest
import tensorflow as tf
import tf_keras
from keras import ops

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome
from jobs.checks.runner import checks_for_style
from tests.checks.tables import target_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("keras-probe32")


def _line_of(class_name: str, method: str) -> int:
    """The line of `def method` in this file's class `class_name`."""
    return inspect.getsourcelines(getattr(globals()[class_name], method))[1]


def _run(
    check_id: str, name: str, workdir: Path, style: str | None = None, params: dict[str, Any] | None = None
) -> Outcome:
    ctx = CheckContext(target=target_of(f"{__name__}:{name}", style), params=params or {}, workdir=workdir)
    return checks_for_style(ctx.target.style)[check_id](ctx)


class SerializedInnerLookahead(keras.optimizers.Optimizer):
    """Lookahead over an inner optimizer kept serialized in its config, as Keras's LossScaleOptimizer
    keeps its own: a name or that dict given, the optimizer deserialized from it held. Correct."""

    def __init__(
        self,
        optimizer: Any = "adam",
        learning_rate: float = 1e-3,
        k: int = 5,
        alpha: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        if isinstance(optimizer, dict):
            optimizer = keras.optimizers.deserialize(optimizer)
        self._inner = keras.optimizers.get(optimizer)
        self.k, self.alpha = k, alpha

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._inner.build(var_list)
        for inner in self._inner.variables:
            self._track_variable(inner)
        self._slow = [self.add_variable_from_reference(v, "slow", initializer=v) for v in var_list]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        slow = self._slow[self._get_variable_index(variable)]
        self._inner.iterations.assign(self.iterations)
        self._inner.update_step(gradient, variable, learning_rate)
        sync = ops.equal((self.iterations + 1) % self.k, 0)
        new_slow = slow + self.alpha * (variable - slow)
        self.assign(slow, ops.where(sync, new_slow, slow))
        self.assign(variable, ops.where(sync, new_slow, variable))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(optimizer=keras.optimizers.serialize(self._inner), k=self.k, alpha=self.alpha)
        return config


class DefaultInnerLookahead(SerializedInnerLookahead):
    """The inner optimizer serialized as the default one, whichever was given: a reload steps with
    Adam where SGD was asked for."""

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["optimizer"] = keras.optimizers.serialize(keras.optimizers.Adam())
        return config


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_an_inner_optimizer_kept_serialized_passes_config_roundtrip(workdir: Path, inner: str) -> None:
    outcome = _run("config_roundtrip", "SerializedInnerLookahead", workdir, params={"optimizer": inner})
    assert outcome.status == "pass", outcome.detail


def test_an_inner_optimizer_serialized_as_another_fails_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "DefaultInnerLookahead", workdir, params={"optimizer": "sgd"})
    assert outcome.status == "fail", outcome.detail
    assert "get_config()['optimizer']" in outcome.detail and "expected 'sgd'" in outcome.detail


class MaskedMomentum(keras.optimizers.Optimizer):
    """Momentum kept only where the gradient is non-zero (lazy by design), its sparse path as lazy:
    the gathered rows updated, the rest left. Correct."""

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        velocity = self._velocities[self._get_variable_index(variable)]
        lr = ops.cast(learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            self._sparse_step(gradient, variable, velocity, lr)
            return
        touched = ops.cast(ops.not_equal(gradient, 0), variable.dtype)
        self.assign(velocity, touched * (self.momentum * velocity + gradient) + (1 - touched) * velocity)
        self.assign_sub(variable, lr * touched * velocity)

    def _sparse_step(self, gradient: Any, variable: Any, velocity: Any, lr: Any) -> None:
        rows, position = tf.unique(gradient.indices)
        summed = tf.math.unsorted_segment_sum(gradient.values, position, tf.size(rows))
        new_rows = self.momentum * tf.gather(velocity.value, rows) + summed
        self.assign(velocity, tf.IndexedSlices(new_rows, rows))
        self.assign_sub(variable, tf.IndexedSlices(lr * new_rows, rows))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["momentum"] = self.momentum
        return config


class DecayAllRowsMomentum(MaskedMomentum):
    """The sparse path decays every row's momentum and steps every row with it; the dense path, on a
    zero-padded gradient, leaves the untouched rows still."""

    def _sparse_step(self, gradient: Any, variable: Any, velocity: Any, lr: Any) -> None:
        self.assign(velocity, self.momentum * velocity)
        self.assign_add(velocity, gradient)
        self.assign_sub(variable, lr * velocity)


class LegacyDecayAllRowsMomentum(tf_keras.optimizers.legacy.Optimizer):
    """The same fault in tf.keras's legacy API: masked momentum in _resource_apply_dense, every row
    decayed and stepped in _resource_apply_sparse."""

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.9, name: str = "Decay", **kwargs: Any):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("momentum", momentum)

    def _create_slots(self, var_list: list[Any]) -> None:
        for var in var_list:
            self.add_slot(var, "momentum")

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        dtype = var.dtype.base_dtype
        slot = self.get_slot(var, "momentum")
        touched = tf.cast(tf.not_equal(grad, 0), dtype)
        velocity = touched * (self._get_hyper("momentum", dtype) * slot + grad) + (1 - touched) * slot
        return tf.group(slot.assign(velocity), var.assign_sub(self._decayed_lr(dtype) * touched * velocity))

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        slot = self.get_slot(var, "momentum")
        decayed = slot.assign(self._get_hyper("momentum", var.dtype.base_dtype) * slot)
        with tf.control_dependencies([decayed]):
            added = slot.scatter_add(tf.IndexedSlices(grad, indices))
        with tf.control_dependencies([added]):
            return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * slot)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        config["momentum"] = self._serialize_hyperparameter("momentum")
        return config


@pytest.mark.parametrize(
    ("name", "style", "method"),
    [
        ("DecayAllRowsMomentum", None, "the sparse branch of update_step"),
        ("LegacyDecayAllRowsMomentum", "tf_legacy", "_resource_apply_sparse"),
    ],
)
def test_a_sparse_path_moving_rows_the_dense_path_keeps_still_fails_sparse(
    workdir: Path, name: str, style: str | None, method: str
) -> None:
    outcome = _run("sparse", name, workdir, style)
    assert outcome.status == "fail", outcome.detail
    assert "other math than the dense path on rows the gradient did not touch" in outcome.detail
    assert f"Fix: make {method} leave the rows the gradient did not touch" in outcome.detail
    assert outcome.where.endswith(f"test_keras_probe32.py:{_line_of(name, method.split()[-1])}")


def test_untouched_rows_the_dense_path_moves_too_stay_a_densify_warn(workdir: Path) -> None:
    ctx = CheckContext(target=target_of("keras.optimizers:Adam"), params={}, workdir=workdir)
    outcome = checks_for_style(ctx.target.style)["sparse"](ctx)
    assert outcome.status == "warn" and "densifies: 2 of 10 rows" in outcome.detail, outcome.detail


def test_a_lazy_sparse_path_beside_a_masked_dense_one_passes_sparse(workdir: Path) -> None:
    outcome = _run("sparse", "MaskedMomentum", workdir)
    assert outcome.status == "pass", outcome.detail


class CentredMomentum(MaskedMomentum):
    """Gradient centralisation in apply(), which then hands the centred gradients to the base's own
    apply(): Keras's clipping, weight decay and EMA run. Correct."""

    def apply(self, grads: list[Any], trainable_variables: Any = None) -> Any:
        return super().apply([_centred(g) for g in grads], trainable_variables)


class CliplessMomentum(MaskedMomentum):
    """apply() overridden with a loop of its own over update_step: the base's apply(), which clips the
    gradients (clipnorm), decays the weights and keeps the EMA, never runs."""

    def apply(self, grads: list[Any], trainable_variables: Any = None) -> Any:
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        if not self.built:
            self.build(variables)
        rate = self._get_current_learning_rate()
        for gradient, variable in zip(grads, variables, strict=True):
            if gradient is not None:
                self.update_step(_centred(gradient), variable, rate)
        self.iterations.assign_add(1)
        return self.iterations


class SignSGD(keras.optimizers.Optimizer):
    """Stateless sign descent with an apply() that hands on to the base's: a clipped gradient steps as
    the unclipped one (its sign is the same), which is no sign that clipping was skipped. Correct."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * ops.sign(gradient))

    def apply(self, grads: list[Any], trainable_variables: Any = None) -> Any:
        return super().apply(grads, trainable_variables)


class HelperWrapper(keras.optimizers.Optimizer):
    """A wrapper shaped as Keras's LossScaleOptimizer: apply() hands on to a helper, which calls the
    inner optimizer's apply (apply -> _common_apply -> inner_optimizer.apply). Its own clipnorm is not
    applied, as Keras's LossScaleOptimizer's is not: clipping is the inner optimizer's. Correct."""

    def __init__(self, inner_optimizer: Any = "adam", learning_rate: Any = None, **kwargs: Any) -> None:
        inner = keras.optimizers.get(inner_optimizer)
        if learning_rate is not None:
            inner.learning_rate = learning_rate
        super().__init__(learning_rate=0.0, **kwargs)
        self.inner_optimizer = inner

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    def apply(self, grads: list[Any], trainable_variables: Any = None) -> None:
        if not self.built:
            self.build(trainable_variables)
        self._common_apply(grads, trainable_variables)

    def _common_apply(self, grads: list[Any], trainable_variables: Any) -> None:
        self.inner_optimizer.apply(grads, trainable_variables)
        self._iterations.assign_add(1)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        del config["learning_rate"]
        return {**config, "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> HelperWrapper:
        config = dict(config)
        inner = keras.optimizers.deserialize(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner_optimizer=inner, **config)


def _centred(gradient: Any) -> Any:
    if len(gradient.shape) < 2:
        return gradient
    return gradient - ops.mean(gradient, axis=tuple(range(len(gradient.shape) - 1)), keepdims=True)


def test_an_apply_override_that_never_runs_the_base_s_fails_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "CliplessMomentum", workdir)
    assert outcome.status == "fail", outcome.detail
    assert (
        "apply() override never runs the base class's apply(), so Keras 3's gradient clipping"
        in outcome.detail
    )
    assert "Fix: override update_step" in outcome.detail and "super().apply(...)" in outcome.detail
    assert outcome.where.endswith(f"test_keras_probe32.py:{_line_of('CliplessMomentum', 'apply')}")


@pytest.mark.parametrize("name", ["CentredMomentum", "SignSGD"])
def test_an_apply_override_handing_on_to_the_base_passes_config_roundtrip(workdir: Path, name: str) -> None:
    outcome = _run("config_roundtrip", name, workdir)
    assert outcome.status == "pass", outcome.detail


def test_a_wrapper_calling_its_inner_apply_from_a_helper_passes_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "HelperWrapper", workdir)
    assert outcome.status == "pass", outcome.detail


def test_distributed_names_the_apply_override_that_bypasses_the_merge(workdir: Path) -> None:
    outcome = _run("distributed", "CliplessMomentum", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "the class overrides apply, where Keras merges the replicas' update" in outcome.detail
    assert outcome.where.endswith(f"test_keras_probe32.py:{_line_of('CliplessMomentum', 'apply')}")


class RequiredMomentum(MaskedMomentum):
    """`momentum` has no default and get_config leaves it out: a reload raises TypeError."""

    def __init__(self, momentum: float, learning_rate: float = 0.01, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, momentum=momentum, **kwargs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        del config["momentum"]
        return config


def test_a_required_argument_left_out_of_the_config_is_said_to_make_the_reload_raise(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "RequiredMomentum", workdir, params={"momentum": 0.9})
    assert outcome.status == "fail", outcome.detail
    assert (
        "'momentum' is not in get_config() after construction; the constructor requires it" in outcome.detail
    )
    assert "a reload raises TypeError for the missing argument" in outcome.detail
    assert "silently use its default" not in outcome.detail


class LegacyRawHyperMomentum(LegacyDecayAllRowsMomentum):
    """get_config returns the hyperparameter's variable, `self._get_hyper("momentum")`, not its value."""

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["momentum"] = self._get_hyper("momentum")
        return config


def test_a_variable_in_a_legacy_config_is_named_at_get_config_with_its_serialized_fix(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "LegacyRawHyperMomentum", workdir, "tf_legacy")
    assert outcome.status == "fail", outcome.detail
    assert "get_config() is not JSON-serializable (its 'momentum' holds a" in outcome.detail
    assert 'Fix: store the serialized value, not the hyperparameter\'s variable: config["momentum"] = ' in (
        outcome.detail
    )
    assert 'self._serialize_hyperparameter("momentum")' in outcome.detail
    assert outcome.where.endswith(f"test_keras_probe32.py:{_line_of('LegacyRawHyperMomentum', 'get_config')}")


class NoSuperBuildMomentum(MaskedMomentum):
    """build() makes the slots without super().build(var_list): Keras's apply() knows no variable."""

    def build(self, var_list: list[Any]) -> None:
        self._velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]


def test_a_build_without_super_build_is_told_to_call_it(workdir: Path) -> None:
    outcome = _run("dense_step", "NoSuperBuildMomentum", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "Fix: call super().build(var_list) at the start of the class's build()" in outcome.detail


class AddingSparseMomentum(MaskedMomentum):
    """The sparse branch adds the step to the touched rows (assign_add where assign_sub belongs)."""

    def _sparse_step(self, gradient: Any, variable: Any, velocity: Any, lr: Any) -> None:
        rows, position = tf.unique(gradient.indices)
        summed = tf.math.unsorted_segment_sum(gradient.values, position, tf.size(rows))
        new_rows = self.momentum * tf.gather(velocity.value, rows) + summed
        self.assign(velocity, tf.IndexedSlices(new_rows, rows))
        self.assign_add(variable, tf.IndexedSlices(lr * new_rows, rows))


def test_a_sparse_branch_whose_values_differ_is_told_to_mend_its_math(workdir: Path) -> None:
    outcome = _run("sparse", "AddingSparseMomentum", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "differ by up to" in outcome.detail
    assert "Fix: make the sparse branch of update_step compute on the touched rows what its dense path" in (
        outcome.detail
    )


class OpsDenseRMSprop(keras.optimizers.Optimizer):
    """Takes `keras.ops.convert_to_tensor(gradient, sparse=False)` for densifying, which on TensorFlow
    leaves a tf.IndexedSlices as it is: the math then crashes on it."""

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._squares = self.add_optimizer_variables(var_list, "square")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        gradient = ops.convert_to_tensor(gradient, sparse=False)
        square = self._squares[self._get_variable_index(variable)]
        self.assign(square, 0.9 * square + 0.1 * gradient * gradient)
        step = ops.cast(learning_rate, variable.dtype) * gradient / (ops.sqrt(square) + 1e-7)
        self.assign_sub(variable, step)


def test_a_sparse_crash_says_that_sparse_false_keeps_the_gradient_sparse(workdir: Path) -> None:
    outcome = _run("sparse", "OpsDenseRMSprop", workdir)
    assert outcome.status == "fail", outcome.detail
    assert "keras.ops.convert_to_tensor, with sparse=False too, and ops.cast keep it sparse" in outcome.detail
