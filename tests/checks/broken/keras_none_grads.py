"""Broken on purpose: per-variable gradient clipping in an overridden `apply` that forgets
frozen variables have no gradient (None), so the step crashes when one layer is frozen."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

EXPECTED_FAILURES = frozenset({"none_grads"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class ClippedSGD(keras.optimizers.Optimizer):
    """SGD that clips each gradient to `max_norm` before the base class applies it."""

    def __init__(self, learning_rate: Any = 0.01, max_norm: float = 100.0, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.max_norm = max_norm

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        clipped = [tf.clip_by_norm(g, self.max_norm) for g in grads]  # None for a frozen variable
        return super().apply(clipped, trainable_variables)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["max_norm"] = self.max_norm
        return config
