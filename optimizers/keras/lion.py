"""Lion, evolved sign momentum (Chen et al. 2023, https://arxiv.org/abs/2302.06675), Keras 3 style.

    c <- beta_1 * m + (1 - beta_1) * g
    p <- p * (1 - lr * weight_decay)
    p <- p - lr * sign(c)
    m <- beta_2 * m + (1 - beta_2) * g

Unlike `keras.optimizers.Lion`, weight decay is the paper's (decoupled, scaled by lr),
applied here rather than by the Keras base class, and sparse gradients update lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras
from keras import ops

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval
from optimizers.keras.sparse_rows import apply_rule


@keras.saving.register_keras_serializable(package="optlab")
class Lion(keras.optimizers.Optimizer):
    """Lion: the sign of an interpolated momentum as the step, with decoupled weight decay.

    The update has unit size per coordinate, so lr is typically 3-10x smaller than AdamW's
    and weight_decay 3-10x larger. An `Embedding`'s `tf.IndexedSlices` gradient updates
    only the rows it touches.
    """

    optlab_name = "lion"
    optlab_reference = "https://arxiv.org/abs/2302.06675"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size"),
        "beta_1": unit_interval("beta_1", "weight of the momentum in the update direction"),
        "beta_2": unit_interval("beta_2", "decay of the momentum"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by the learning rate"),
    }

    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 1e-4,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        weight_decay: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(
            self.optlab_hyperparameters, beta_1=beta_1, beta_2=beta_2, weight_decay=weight_decay
        )
        super().__init__(learning_rate=learning_rate, weight_decay=None, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.decoupled_weight_decay = weight_decay

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        beta_1, beta_2 = self.beta_1, self.beta_2
        decay = self.decoupled_weight_decay if self._use_weight_decay(variable) else 0.0

        def rule(g: Any, p: Any, m: Any) -> tuple[Any, Any]:
            direction = ops.sign(beta_1 * m + (1 - beta_1) * g)
            if decay:
                p = p * (1 - lr * decay)
            return p - lr * direction, beta_2 * m + (1 - beta_2) * g

        apply_rule(self, rule, gradient, [variable, self._momentums[self._get_variable_index(variable)]])

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            {"beta_1": self.beta_1, "beta_2": self.beta_2, "weight_decay": self.decoupled_weight_decay}
        )
        return config
