"""EMA momentum, the seed algorithm of the catalogue, as a legacy tf.keras (OptimizerV2) optimizer.

    p <- p * (1 - lr * weight_decay)
    m <- beta * m + (1 - beta) * g
    p <- p - lr * m

Weight decay is decoupled as in AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101).
A sparse gradient updates only the rows it touches, weights and momentum alike (lazy, as
LazyAdam): an embedding row that is not looked up keeps its momentum and is not decayed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import tensorflow as tf
import tf_keras

from optimizers.hyperparams import (
    Param,
    check_hyperparameters,
    non_negative,
    positive,
    unit_interval,
)
from optimizers.tf_legacy.plumbing import (
    assign_all,
    coefficients,
    gather_rows,
    plain_config,
    scatter_rows,
)


@tf_keras.utils.register_keras_serializable(package="optlab")
class EmaMomentum(tf_keras.optimizers.legacy.Optimizer):
    """Momentum as an exponential moving average of gradients, with decoupled weight decay."""

    optlab_name = "ema_momentum"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size; a LearningRateSchedule is allowed"),
        "beta": unit_interval("beta", "decay of the gradient average"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
    }

    _HAS_AGGREGATE_GRAD = True

    def __init__(
        self,
        learning_rate: Any = 0.01,
        beta: float = 0.9,
        weight_decay: float = 0.0,
        name: str = "EmaMomentum",
        **kwargs: Any,
    ) -> None:
        learning_rate = kwargs.pop("lr", learning_rate)  # the legacy alias the base class accepts
        if isinstance(learning_rate, int | float):  # a schedule or a tensor is taken as given
            check_hyperparameters(self.optlab_hyperparameters, learning_rate=learning_rate)
        check_hyperparameters(self.optlab_hyperparameters, beta=beta, weight_decay=weight_decay)
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("beta", beta)
        self._set_hyper("weight_decay", weight_decay)

    def _create_slots(self, var_list: list[Any]) -> None:
        for var in var_list:
            self.add_slot(var, "momentum")

    def _prepare_local(self, var_device: Any, var_dtype: Any, apply_state: dict[Any, Any]) -> None:
        # Once per (device, dtype) and step: the base class puts the decayed lr in `lr_t`.
        super()._prepare_local(var_device, var_dtype, apply_state)
        coefficients = apply_state[(var_device, var_dtype)]
        beta = tf.identity(self._get_hyper("beta", var_dtype))
        weight_decay = self._get_hyper("weight_decay", var_dtype)
        coefficients.update(
            beta=beta,
            one_minus_beta=1 - beta,
            decay_factor=1 - coefficients["lr_t"] * weight_decay,
        )

    def _step(self, c: dict[str, Any], param: Any, momentum: Any, grad: Any) -> tuple[Any, Any]:
        """New weights and momentum from current ones: the same math for all rows or some."""
        new_momentum = c["beta"] * momentum + c["one_minus_beta"] * grad
        new_param = param * c["decay_factor"] - c["lr_t"] * new_momentum
        return new_param, new_momentum

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: dict[Any, Any] | None = None) -> Any:
        momentum = self.get_slot(var, "momentum")
        updated = self._step(coefficients(self, var, apply_state), var, momentum, grad)
        return assign_all(self, (var, momentum), updated)

    def _resource_apply_sparse(
        self, grad: Any, var: Any, indices: Any, apply_state: dict[Any, Any] | None = None
    ) -> Any:
        # `indices` are unique here: the base class sums duplicates before calling us.
        momentum = self.get_slot(var, "momentum")
        param_rows, momentum_rows = gather_rows((var, momentum), indices)
        updated = self._step(coefficients(self, var, apply_state), param_rows, momentum_rows, grad)
        return scatter_rows((var, momentum), indices, updated)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            {name: self._serialize_hyperparameter(name) for name in ("learning_rate", "beta", "weight_decay")}
        )
        config["decay"] = self._initial_decay
        return plain_config(config)
