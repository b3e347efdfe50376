"""A Keras 3 momentum whose bias correction counts steps in a module-level variable (kept in a
registry dict): every instance, and every replica of a MirroredStrategy, moves the one count."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

_SHARED: dict[str, Any] = {}


@keras.saving.register_keras_serializable(package="tests")
class SharedStepMomentum(keras.optimizers.Optimizer):
    def __init__(self, learning_rate: Any = 0.01, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = beta

    def build(self, var_list: Any) -> None:
        if self.built:
            return
        super().build(var_list)
        self._m = self.add_optimizer_variables(var_list, "m")
        if "t" not in _SHARED:
            with tf.init_scope():
                _SHARED["t"] = tf.Variable(0.0, trainable=False)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        rate = ops.cast(learning_rate, variable.dtype)
        index = self._get_variable_index(variable)
        steps = _SHARED["t"]
        if index == 0:
            steps.assign_add(1.0)
        m = self._m[index]
        self.assign(m, self.beta * m + (1 - self.beta) * gradient)
        self.assign_sub(variable, rate * m / (1 - ops.power(self.beta, steps)))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "beta": self.beta}
