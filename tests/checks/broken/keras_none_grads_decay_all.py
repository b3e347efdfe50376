"""Broken on purpose: decays every momentum buffer in one pass before the step, also the buffer of
a variable that has no gradient this step (a frozen layer), so its state drifts while frozen.

A variable that never had a gradient has a zero buffer and shows nothing: only one frozen
after training does. The Keras checks used to freeze a variable from the start only; now
every style's none_grads freezes one after a step too, as the torch check did."""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"none_grads"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class DecayAllMomentum(keras.optimizers.Optimizer):
    """Heavy-ball momentum, m = beta * m + g, with the decay done for all buffers at once."""

    def __init__(self, learning_rate: Any = 0.01, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = beta

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if self.built:
            for momentum in self._momentums:  # every buffer, with or without a gradient this step
                momentum.assign(momentum * self.beta)
        return super().apply(grads, trainable_variables)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        momentum = self._momentums[self._get_variable_index(variable)]
        self.assign_add(momentum, gradient)
        self.assign_sub(variable, lr * momentum)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["beta"] = self.beta
        return config
