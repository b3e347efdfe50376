"""Broken on purpose: reads the learning rate once, when the optimizer is built, and uses
that number for every later step, so a LearningRateSchedule is silently frozen."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"schedule"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class FrozenRateMomentum(keras.optimizers.Optimizer):
    """Momentum SGD that caches the learning rate in build()."""

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._velocities = self.add_optimizer_variables(var_list, "velocity")
        # "One lookup instead of one per variable": for a schedule, its value at step 0, for good.
        self._rate = keras.ops.convert_to_tensor(self.learning_rate)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        self.assign_sub(variable, keras.ops.cast(self._rate, variable.dtype) * velocity)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["momentum"] = self.momentum
        return config
