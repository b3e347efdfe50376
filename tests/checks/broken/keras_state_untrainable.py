"""Broken on purpose: slots made with keras.Variable directly, which is trainable unless
told otherwise, instead of add_variable / add_optimizer_variables."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"state_untrainable"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class TrainableSlotMomentum(keras.optimizers.Optimizer):
    """Heavy-ball momentum whose velocity variables are created by hand."""

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = [
            keras.Variable(keras.ops.zeros(v.shape, dtype=v.dtype), name=f"velocity_{i}")  # trainable=True
            for i, v in enumerate(var_list)
        ]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        self.assign_sub(variable, lr * velocity)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["momentum"] = self.momentum
        return config
