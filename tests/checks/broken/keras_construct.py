"""Broken on purpose: declares its ranges but never checks them, so beta=1.5 is accepted
and the momentum grows without bound instead of averaging."""

from __future__ import annotations

from typing import Any, ClassVar

import keras

from optimizers.hyperparams import Param, positive, unit_interval

EXPECTED_FAILURES = frozenset({"construct"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class TrustingMomentum(keras.optimizers.Optimizer):
    """Heavy-ball momentum whose constructor trusts its arguments."""

    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size"),
        "beta": unit_interval("beta", "momentum decay"),
    }

    def __init__(self, learning_rate: Any = 0.01, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = beta  # the declared range is published, but nothing here enforces it

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = keras.ops.cast(learning_rate, variable.dtype)
        momentum = self._momentums[self._get_variable_index(variable)]
        self.assign(momentum, self.beta * momentum + gradient)
        self.assign_sub(variable, lr * momentum)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["beta"] = self.beta
        return config
