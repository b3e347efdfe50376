"""Broken on purpose: a Python `if` on a tensor value in the update. Eagerly the tensor
has a value; inside tf.function (every real training step) it does not."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

EXPECTED_FAILURES = frozenset({"graph_mode"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class SpikeGuardSGD(keras.optimizers.Optimizer):
    """SGD that halves the step when a gradient spikes above `spike`."""

    def __init__(self, learning_rate: Any = 0.01, spike: float = 10.0, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.spike = spike

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        if ops.max(ops.abs(gradient)) > self.spike:  # a tensor as a Python bool
            lr = lr / 2
        self.assign_sub(variable, lr * gradient)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["spike"] = self.spike
        return config
