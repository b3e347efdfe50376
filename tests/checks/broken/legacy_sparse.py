"""Broken on purpose: the sparse path treats the touched rows' values as if they were the
whole dense gradient, which fails as soon as an Embedding hands it a tf.IndexedSlices."""

from __future__ import annotations

from typing import Any

import tf_keras

EXPECTED_FAILURES = frozenset({"sparse"})


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class DenseMindedSGD(tf_keras.optimizers.legacy.Optimizer):
    """Plain SGD, legacy style, with a copy-pasted sparse path."""

    def __init__(self, learning_rate: Any = 0.01, name: str = "DenseMindedSGD", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
        lr = self._decayed_lr(var.dtype.base_dtype)
        return var.assign_sub(lr * grad, read_value=False)

    def _resource_apply_sparse(self, grad: Any, var: Any, indices: Any, apply_state: Any = None) -> Any:
        lr = self._decayed_lr(var.dtype.base_dtype)
        return var.assign_sub(lr * grad, read_value=False)  # `grad` holds only the touched rows

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        return config
