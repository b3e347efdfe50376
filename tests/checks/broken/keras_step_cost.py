"""Slow on purpose (not wrong): a full-matrix preconditioner built and solved from scratch
for every variable on every step: an n x n eigendecomposition (n = the variable's size) where a
diagonal or a factored (Shampoo-style, kept in slots) one would do."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

EXPECTED_FAILURES: frozenset[str] = frozenset()
EXPECTED_WARNINGS = frozenset({"step_cost"})


@keras.saving.register_keras_serializable(package="optlab_broken")
class FullMatrixSGD(keras.optimizers.Optimizer):
    """SGD preconditioned by (g g^T + damping I)^(-1/2), recomputed every step."""

    def __init__(self, learning_rate: Any = 0.01, damping: float = 1.0, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.damping = damping

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.reshape(ops.convert_to_tensor(gradient), (-1, 1))
        n = g.shape[0]
        statistics = ops.matmul(g, ops.transpose(g)) + self.damping * ops.eye(n, dtype=variable.dtype)
        eigenvalues, eigenvectors = ops.linalg.eigh(statistics)  # inverse square root, as Shampoo does
        inverse_root = ops.matmul(eigenvectors * ops.rsqrt(eigenvalues), ops.transpose(eigenvectors))
        direction = ops.matmul(inverse_root, g)
        self.assign_sub(variable, lr * ops.reshape(direction, variable.shape))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["damping"] = self.damping
        return config
