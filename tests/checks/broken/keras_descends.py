"""Broken on purpose: the update adds the gradient instead of subtracting it (gradient
ascent), so the loss goes up."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"descends"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class AscendingSGD(keras.optimizers.Optimizer):
    """Plain SGD with the sign of the step flipped."""

    def __init__(self, learning_rate: Any = 0.01, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_add(variable, lr * gradient)  # should be assign_sub
