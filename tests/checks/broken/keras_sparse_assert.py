"""Broken on purpose: refuses sparse gradients with an `assert`, which `python -O` strips, so
there a tf.IndexedSlices runs into the dense math. A refusal counts as clear only when it is
a `raise` (the torch rule, now the rule for every style)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

EXPECTED_FAILURES = frozenset({"sparse"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class AssertDenseSGD(keras.optimizers.Optimizer):
    """Plain SGD that asserts its gradients are dense."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        assert not isinstance(gradient, tf.IndexedSlices), (
            "sparse gradients (tf.IndexedSlices) are not supported"
        )
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)
