"""tf_keras's own legacy SGD (with optional Nesterov momentum), registered as a baseline."""

from __future__ import annotations

from typing import Any, ClassVar

import tf_keras

from optimizers.hyperparams import Param, check_hyperparameters, positive
from optimizers.tf_legacy.plumbing import plain_config


@tf_keras.utils.register_keras_serializable(package="optlab")
class SGD(tf_keras.optimizers.legacy.SGD):
    """Stochastic gradient descent with optional (Nesterov) momentum: tf_keras.optimizers.legacy.SGD."""

    optlab_name = "sgd"
    optlab_supports_sparse = True
    optlab_tunable = ("learning_rate", "momentum", "nesterov")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size; a LearningRateSchedule is allowed"),
        "momentum": Param("momentum", "float", None, low=0.0, high=1.0, high_inclusive=False),
    }

    # tf_keras's signature and defaults, restated so the declared ranges are enforced here
    # too (tf_keras accepts learning_rate=0 and momentum=1).
    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "SGD",
        **kwargs: Any,
    ) -> None:
        learning_rate = kwargs.pop("lr", learning_rate)  # the legacy alias the base class accepts
        if isinstance(learning_rate, int | float):  # a schedule or a tensor is taken as given
            check_hyperparameters(self.optlab_hyperparameters, learning_rate=learning_rate)
        check_hyperparameters(self.optlab_hyperparameters, momentum=momentum)
        super().__init__(
            learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, name=name, **kwargs
        )

    def get_config(self) -> dict[str, Any]:
        # A hyperparameter in a variable reads back as a NumPy float32; give the plain number.
        return plain_config(super().get_config())
