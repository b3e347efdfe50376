"""Broken on purpose: `nesterov` is a constructor argument but get_config leaves it out, so
a reloaded optimizer silently runs plain momentum."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"config_roundtrip"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class ForgetfulNesterov(keras.optimizers.Optimizer):
    """Momentum SGD with an optional Nesterov look-ahead."""

    def __init__(
        self, learning_rate: Any = 0.01, momentum: float = 0.9, nesterov: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum
        self.nesterov = nesterov

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        step = gradient + self.momentum * velocity if self.nesterov else velocity
        self.assign_sub(variable, lr * step)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["momentum"] = self.momentum  # nesterov forgotten
        return config
