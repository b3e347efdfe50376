"""Keras's own SGD (with optional momentum), registered as a baseline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras

from optimizers.hyperparams import Param, check_hyperparameters, positive


@keras.saving.register_keras_serializable(package="optlab")
class SGD(keras.optimizers.SGD):
    """Stochastic gradient descent with optional (Nesterov) momentum: keras.optimizers.SGD."""

    optlab_name = "sgd"
    optlab_tunable = ("learning_rate", "momentum", "nesterov")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate"),
        "momentum": Param("momentum", "float", None, low=0.0, high=1.0, high_inclusive=False),
        "nesterov": Param("nesterov", "bool", None),
    }

    # Keras's signature and defaults, restated so the declared ranges are enforced here too
    # (Keras accepts momentum=1 and any truthy nesterov, and refuses momentum=0 as an int).
    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(self.optlab_hyperparameters, momentum=momentum, nesterov=nesterov)
        super().__init__(learning_rate=learning_rate, momentum=float(momentum), nesterov=nesterov, **kwargs)
