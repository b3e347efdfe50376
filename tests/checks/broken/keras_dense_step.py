"""Broken on purpose: meant to exempt biases from weight decay, it exempts them from the
whole update, so every 1-D variable (biases, norm scales) stays at its initial value."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"dense_step"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class BiasForgettingSGD(keras.optimizers.Optimizer):
    """SGD with decoupled weight decay that returns early for 1-D variables."""

    def __init__(self, learning_rate: Any = 0.01, decay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.decay = decay

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        if len(variable.shape) == 1:
            return  # "no weight decay on biases" -- but this skips their gradient step too
        lr = keras.ops.cast(learning_rate, variable.dtype)
        self.assign(variable, variable * (1 - lr * self.decay) - lr * gradient)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["decay"] = self.decay
        return config
