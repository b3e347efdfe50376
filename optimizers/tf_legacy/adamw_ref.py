"""AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101) for legacy tf.keras, as torch writes it.

    p <- p * (1 - lr * weight_decay)
    m <- beta_1 * m + (1 - beta_1) * g
    v <- beta_2 * v + (1 - beta_2) * g^2
    p <- p - (lr / (1 - beta_1^t)) * m / (sqrt(v) / sqrt(1 - beta_2^t) + epsilon)

A reference implementation: it follows torch.optim.AdamW step for step (epsilon added
after the bias correction of v, decay scaled by lr), so the three styles of the catalogue
can be checked against one another and against torch itself. A sparse gradient updates
only the rows it touches (lazy, as LazyAdam); the step count t is global.
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
class AdamWRef(tf_keras.optimizers.legacy.Optimizer):
    """AdamW with torch.optim.AdamW's exact update rule: Adam with decoupled weight decay."""

    optlab_name = "adamw_ref"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size; a LearningRateSchedule is allowed"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to the bias-corrected sqrt(v)"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
    }

    _HAS_AGGREGATE_GRAD = True

    def __init__(
        self,
        learning_rate: Any = 1e-3,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 1e-2,
        name: str = "AdamWRef",
        **kwargs: Any,
    ) -> None:
        learning_rate = kwargs.pop("lr", learning_rate)  # the legacy alias the base class accepts
        if isinstance(learning_rate, int | float):  # a schedule or a tensor is taken as given
            check_hyperparameters(self.optlab_hyperparameters, learning_rate=learning_rate)
        check_hyperparameters(
            self.optlab_hyperparameters,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            weight_decay=weight_decay,
        )
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("beta_1", beta_1)
        self._set_hyper("beta_2", beta_2)
        self._set_hyper("epsilon", epsilon)
        self._set_hyper("weight_decay", weight_decay)

    def _create_slots(self, var_list: list[Any]) -> None:
        # One loop per slot, as tf_keras's Adam: checkpoints list all m before all v.
        for var in var_list:
            self.add_slot(var, "m")
        for var in var_list:
            self.add_slot(var, "v")

    def _prepare_local(self, var_device: Any, var_dtype: Any, apply_state: dict[Any, Any]) -> None:
        # Once per (device, dtype) and step: the base class puts the decayed lr in `lr_t`.
        super()._prepare_local(var_device, var_dtype, apply_state)
        coefficients = apply_state[(var_device, var_dtype)]
        t = tf.cast(self.iterations + 1, var_dtype)
        beta_1 = tf.identity(self._get_hyper("beta_1", var_dtype))
        beta_2 = tf.identity(self._get_hyper("beta_2", var_dtype))
        lr = coefficients["lr_t"]
        weight_decay = self._get_hyper("weight_decay", var_dtype)
        coefficients.update(
            beta_1=beta_1,
            one_minus_beta_1=1 - beta_1,
            beta_2=beta_2,
            one_minus_beta_2=1 - beta_2,
            epsilon=tf.identity(self._get_hyper("epsilon", var_dtype)),
            step_size=lr / (1 - tf.pow(beta_1, t)),
            bias_correction_2_sqrt=tf.sqrt(1 - tf.pow(beta_2, t)),
            decay_factor=1 - lr * weight_decay,
        )

    def _step(self, c: dict[str, Any], param: Any, m: Any, v: Any, grad: Any) -> tuple[Any, Any, Any]:
        """New weights and moments from current ones: the same math for all rows or some."""
        new_m = c["beta_1"] * m + c["one_minus_beta_1"] * grad
        new_v = c["beta_2"] * v + c["one_minus_beta_2"] * tf.square(grad)
        denominator = tf.sqrt(new_v) / c["bias_correction_2_sqrt"] + c["epsilon"]
        new_param = param * c["decay_factor"] - c["step_size"] * new_m / denominator
        return new_param, new_m, new_v

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: dict[Any, Any] | None = None) -> Any:
        m = self.get_slot(var, "m")
        v = self.get_slot(var, "v")
        updated = self._step(coefficients(self, var, apply_state), var, m, v, grad)
        return assign_all(self, (var, m, v), updated)

    def _resource_apply_sparse(
        self, grad: Any, var: Any, indices: Any, apply_state: dict[Any, Any] | None = None
    ) -> Any:
        # `indices` are unique here: the base class sums duplicates before calling us.
        m = self.get_slot(var, "m")
        v = self.get_slot(var, "v")
        param_rows, m_rows, v_rows = gather_rows((var, m, v), indices)
        updated = self._step(coefficients(self, var, apply_state), param_rows, m_rows, v_rows, grad)
        return scatter_rows((var, m, v), indices, updated)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            {
                name: self._serialize_hyperparameter(name)
                for name in ("learning_rate", "beta_1", "beta_2", "epsilon", "weight_decay")
            }
        )
        config["decay"] = self._initial_decay
        return plain_config(config)
