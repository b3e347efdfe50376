"""Keras optimizers that take no learning rate, written correctly: their step size is their own (as
A2Grad's, AliG's and tensorflow-addons' COCOB are). The catalogue had given every such class an
`lr` that its build then passed on, so `construct` failed every one of them with a TypeError (and
every job of them): a false alarm. `GivesItsRateBack` returns the base's `learning_rate` from
get_config, which its constructor fills itself: it cannot be rebuilt from its config (a true fault).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
import tf_keras
from keras import ops


@keras.saving.register_keras_serializable(package="tests")
class SignStep(keras.optimizers.Optimizer):
    """Moves every variable by `size` against its gradient's sign; the base's rate is fixed at 1."""

    def __init__(self, size: float = 0.01, name: str = "sign_step", **kwargs: Any) -> None:
        super().__init__(learning_rate=1.0, name=name, **kwargs)
        self.size = size

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        if isinstance(gradient, tf.IndexedSlices):
            raise ValueError("SignStep takes dense gradients only")
        self.assign_sub(variable, ops.sign(gradient) * self.size)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("learning_rate", None)  # its own, not an argument
        config.update({"size": self.size})
        return config


@keras.saving.register_keras_serializable(package="tests")
class GivesItsRateBack(SignStep):
    """SignStep whose config keeps the base's `learning_rate`: from_config gives it twice."""

    def get_config(self) -> dict[str, Any]:
        config = keras.optimizers.Optimizer.get_config(self)
        config.update({"size": self.size})
        return config


@tf_keras.utils.register_keras_serializable(package="tests")
class LegacySignStep(tf_keras.optimizers.legacy.Optimizer):
    """The same in legacy tf.keras, whose base takes no learning rate at all."""

    def __init__(self, size: float = 0.01, name: str = "LegacySignStep", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("size", size)

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        return var.assign_sub(tf.sign(grad) * self._get_hyper("size", var.dtype.base_dtype))

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        size = self._get_hyper("size", var.dtype.base_dtype)
        return self._resource_scatter_add(var, indices, -tf.sign(grad) * size)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"size": self._serialize_hyperparameter("size")})
        return config
