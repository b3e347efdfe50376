"""AdamW written out as torch.optim.AdamW computes it (https://arxiv.org/abs/1711.05101), Keras 3 style.

    p <- p * (1 - lr * weight_decay)
    m <- beta_1 * m + (1 - beta_1) * g
    v <- beta_2 * v + (1 - beta_2) * g^2
    p <- p - lr / (1 - beta_1^t) * m / (sqrt(v) / sqrt(1 - beta_2^t) + epsilon)

A reference to compare the frameworks against: `keras.optimizers.AdamW` adds epsilon to
sqrt(v) before bias correction ("epsilon hat"), torch after; this follows torch, so the
same hyperparameters give the same trajectory in both frameworks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import keras
from keras import ops

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval
from optimizers.keras.sparse_rows import apply_rule


@keras.saving.register_keras_serializable(package="optlab")
class AdamWRef(keras.optimizers.Optimizer):
    """AdamW with torch.optim.AdamW's epsilon placement and decoupled weight decay.

    An `Embedding`'s `tf.IndexedSlices` gradient updates only the rows it touches;
    the bias correction still counts every step (t is the optimizer's, not the row's).
    """

    optlab_name = "adamw_ref"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to the bias-corrected sqrt(v)"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by the learning rate"),
    }

    def __init__(
        self,
        learning_rate: float | Callable[..., Any] = 1e-3,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        if not callable(learning_rate):  # a schedule or a callable is Keras's to check
            learning_rate = self.optlab_hyperparameters["learning_rate"].check(learning_rate)
        check_hyperparameters(
            self.optlab_hyperparameters,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            weight_decay=weight_decay,
        )
        super().__init__(learning_rate=learning_rate, weight_decay=None, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.decoupled_weight_decay = weight_decay

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(var_list, ["momentum", "velocity"])

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        t = ops.cast(self.iterations + 1, dtype)
        beta_1, beta_2, epsilon = self.beta_1, self.beta_2, self.epsilon
        # convert_to_tensor, not cast: casting a Python float goes through float32 first.
        step_size = lr / (1 - ops.power(ops.convert_to_tensor(beta_1, dtype), t))
        sqrt_correction = ops.sqrt(1 - ops.power(ops.convert_to_tensor(beta_2, dtype), t))
        decay = self.decoupled_weight_decay if self._use_weight_decay(variable) else 0.0

        def rule(g: Any, p: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            if decay:
                p = p * (1 - lr * decay)
            m = beta_1 * m + (1 - beta_1) * g
            v = beta_2 * v + (1 - beta_2) * ops.square(g)
            return p - step_size * m / (ops.sqrt(v) / sqrt_correction + epsilon), m, v

        index = self._get_variable_index(variable)
        apply_rule(self, rule, gradient, [variable, self._momentums[index], self._velocities[index]])

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "epsilon": self.epsilon,
                "weight_decay": self.decoupled_weight_decay,
            }
        )
        return config
