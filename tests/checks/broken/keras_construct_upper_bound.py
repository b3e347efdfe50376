"""Broken on purpose: declares beta in [0, 1) but validates only its lower bound, so beta=1
is accepted and the momentum never forgets a gradient (with beta > 1 it grows without bound).

The Keras checks used to probe one side of a declared range only; both sides are probed now,
as for torch classes."""

from __future__ import annotations

from typing import Any, ClassVar

import keras

from optimizers.hyperparams import Param, positive, unit_interval

EXPECTED_FAILURES = frozenset({"construct"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class HalfCheckedMomentum(keras.optimizers.Optimizer):
    """Heavy-ball momentum whose constructor checks beta >= 0 and forgets beta < 1."""

    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size"),
        "beta": unit_interval("beta", "momentum decay"),
    }

    def __init__(self, learning_rate: Any = 0.01, beta: float = 0.9, **kwargs: Any) -> None:
        if isinstance(learning_rate, int | float) and not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0; received {learning_rate}")
        if beta < 0:  # the upper bound (beta < 1) is never checked
            raise ValueError(f"beta must be in [0, 1); received {beta}")
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = beta

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
