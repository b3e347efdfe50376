"""Broken on purpose: keeps its accumulators in a dict of tf.Variables of its own instead
of slots. A legacy optimizer does not track attributes, so no checkpoint saves them: a
restored optimizer restarts from zero accumulators."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

# A run resumed in a fresh process starts from zero accumulators too, and under a
# MirroredStrategy the per-replica copy of a variable is not a key of the dict.
EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact", "distributed"})


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class HandRolledAdagrad(tf_keras.optimizers.legacy.Optimizer):
    """Adagrad whose squared-gradient sums live in `self._sums`, not in add_slot."""

    def __init__(
        self, learning_rate: Any = 0.1, epsilon: float = 1e-7, name: str = "HandRolledAdagrad", **kwargs: Any
    ) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self.epsilon = epsilon
        self._sums: dict[Any, Any] = {}

    def _create_slots(self, var_list: list[Any]) -> None:
        for var in var_list:
            if var.ref() not in self._sums:
                self._sums[var.ref()] = tf.Variable(tf.zeros_like(var), trainable=False)

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        lr = self._decayed_lr(var.dtype.base_dtype)
        total = self._sums[var.ref()]
        new_total = total.assign_add(tf.square(grad))
        return var.assign_sub(lr * grad / (tf.sqrt(new_total) + self.epsilon), read_value=False)

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        lr = self._decayed_lr(var.dtype.base_dtype)
        total = self._sums[var.ref()]
        rows = tf.gather(total, indices) + tf.square(grad)
        update_total = total.scatter_update(tf.IndexedSlices(rows, indices))
        with tf.control_dependencies([update_total]):
            step = lr * grad / (tf.sqrt(rows) + self.epsilon)
            return var.scatter_sub(tf.IndexedSlices(step, indices))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"), epsilon=self.epsilon)
        return config
