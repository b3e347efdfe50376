"""EMA momentum in the Keras 3 style: the seed algorithm, as `optimizers.torch.ema_momentum`.

    p <- p * (1 - lr * weight_decay)
    m <- beta * m + (1 - beta) * g
    p <- p - lr * m

Weight decay is decoupled as in AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101)
and applied here, not by the Keras base class, so the rule is the torch version's exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras
from keras import ops

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval
from optimizers.keras.sparse_rows import apply_rule


@keras.saving.register_keras_serializable(package="optlab")
class EmaMomentum(keras.optimizers.Optimizer):
    """Momentum as an exponential moving average of gradients, with decoupled weight decay.

    `weight_decay` is this optimizer's own (the base class's is left unset, so
    `exclude_from_weight_decay` still chooses the variables it applies to).
    An `Embedding`'s `tf.IndexedSlices` gradient updates only the rows it touches.
    """

    optlab_name = "ema_momentum"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size"),
        "beta": unit_interval("beta", "decay of the gradient average"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by the learning rate"),
    }

    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 1e-2,
        beta: float = 0.9,
        weight_decay: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(self.optlab_hyperparameters, beta=beta, weight_decay=weight_decay)
        super().__init__(learning_rate=learning_rate, weight_decay=None, **kwargs)
        self.beta = beta
        self.decoupled_weight_decay = weight_decay

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        beta = self.beta
        decay = self.decoupled_weight_decay if self._use_weight_decay(variable) else 0.0

        def rule(g: Any, p: Any, m: Any) -> tuple[Any, Any]:
            if decay:
                p = p * (1 - lr * decay)
            m = beta * m + (1 - beta) * g
            return p - lr * m, m

        apply_rule(self, rule, gradient, [variable, self._momentums[self._get_variable_index(variable)]])

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update({"beta": self.beta, "weight_decay": self.decoupled_weight_decay})
        return config
