"""Keras's own AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101), a baseline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval


@keras.saving.register_keras_serializable(package="optlab")
class AdamW(keras.optimizers.AdamW):
    """AdamW: Adam with decoupled weight decay, keras.optimizers.AdamW."""

    optlab_name = "adamw"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_tunable = ("learning_rate", "weight_decay", "beta_1", "beta_2", "epsilon", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by the learning rate"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to sqrt(v) before bias correction (Keras's epsilon hat)"),
        "amsgrad": Param("amsgrad", "bool", None),
    }

    # Keras's signature and defaults, restated so the declared ranges are enforced here too.
    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(
            self.optlab_hyperparameters,
            weight_decay=weight_decay,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
        )
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            **kwargs,
        )
