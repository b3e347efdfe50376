"""Deprecated on purpose (not wrong): ported from TensorFlow 1, it turns the step count into
a float with `tf.compat.v1.to_float`, which TensorFlow logs as deprecated (use tf.cast)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

EXPECTED_FAILURES: frozenset[str] = frozenset()
EXPECTED_WARNINGS = frozenset({"deprecations"})


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class PortedEmaMomentum(tf_keras.optimizers.legacy.Optimizer):
    """Momentum as a bias-corrected moving average of gradients, legacy style."""

    def __init__(
        self, learning_rate: Any = 0.01, beta: float = 0.9, name: str = "PortedEmaMomentum", **kwargs: Any
    ) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("beta", beta)

    def _create_slots(self, var_list: list[Any]) -> None:
        for var in var_list:
            self.add_slot(var, "average")

    def _step(self, grad: Any, average: Any, var_dtype: Any) -> tuple[Any, Any]:
        beta = self._get_hyper("beta", var_dtype)
        step = tf.cast(tf.compat.v1.to_float(self.iterations + 1), var_dtype)  # TF1 habit
        new_average = beta * average + (1 - beta) * grad
        return new_average, self._decayed_lr(var_dtype) * new_average / (1 - tf.pow(beta, step))

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        average = self.get_slot(var, "average")
        new_average, update = self._step(grad, average, var.dtype.base_dtype)
        return tf.group(average.assign(new_average), var.assign_sub(update))

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        average = self.get_slot(var, "average")
        new_rows, update = self._step(grad, tf.gather(average, indices), var.dtype.base_dtype)
        return tf.group(
            average.scatter_update(tf.IndexedSlices(new_rows, indices)),
            var.scatter_sub(tf.IndexedSlices(update, indices)),
        )

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            learning_rate=self._serialize_hyperparameter("learning_rate"),
            beta=self._serialize_hyperparameter("beta"),
        )
        return config
