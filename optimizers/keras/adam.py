"""Keras's own Adam (Kingma & Ba, https://arxiv.org/abs/1412.6980), registered as a baseline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras

from optimizers.hyperparams import Param, check_hyperparameters, positive, unit_interval


@keras.saving.register_keras_serializable(package="optlab")
class Adam(keras.optimizers.Adam):
    """Adam: adaptive moment estimation, keras.optimizers.Adam."""

    optlab_name = "adam"
    optlab_reference = "https://arxiv.org/abs/1412.6980"
    optlab_tunable = ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to sqrt(v) before bias correction (Keras's epsilon hat)"),
        "amsgrad": Param("amsgrad", "bool", None),
    }

    # Keras's signature and defaults, restated so the declared ranges are enforced here too.
    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(
            self.optlab_hyperparameters, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad
        )
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            **kwargs,
        )
