"""Broken on purpose: get_config writes `trust_coefficient` as the literal default, not
`self.trust_coefficient`. At the defaults the config looks right; a LARS built with another
coefficient is reloaded with 0.001."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"config_roundtrip"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class ConstantConfigLars(keras.optimizers.Optimizer):
    """Momentum SGD scaled by a layer-wise trust ratio (LARS)."""

    def __init__(
        self, learning_rate: Any = 0.1, momentum: float = 0.9, trust_coefficient: float = 0.001, **kwargs: Any
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum
        self.trust_coefficient = trust_coefficient

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        ops = keras.ops
        lr = ops.cast(learning_rate, variable.dtype)
        weight_norm = ops.sqrt(ops.sum(ops.square(variable)))
        grad_norm = ops.sqrt(ops.sum(ops.square(gradient)))
        ratio = ops.where(
            ops.logical_and(weight_norm > 0, grad_norm > 0),
            self.trust_coefficient * weight_norm / grad_norm,
            ops.ones_like(weight_norm),
        )
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + lr * ratio * gradient)
        self.assign_sub(variable, velocity)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update({"momentum": self.momentum, "trust_coefficient": 0.001})  # a constant, not the value
        return config
