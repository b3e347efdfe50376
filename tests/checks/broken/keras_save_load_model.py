"""Broken on purpose: a correct optimizer that was never registered as serializable, so
`load_model` of a model compiled with it cannot find the class by name."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"save_load_model"})


class UnregisteredMomentum(keras.optimizers.Optimizer):  # no @keras.saving.register_keras_serializable
    """Heavy-ball momentum SGD."""

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        self.assign_sub(variable, lr * velocity)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["momentum"] = self.momentum
        return config
