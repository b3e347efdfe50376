"""Broken on purpose: overrides `apply_gradients` with a narrower signature than the base
class. Plain training calls it as apply_gradients(pairs) and works; the mixed-precision
LossScaleOptimizer passes `experimental_aggregate_gradients=` and gets a TypeError."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

EXPECTED_FAILURES = frozenset({"mixed_precision"})


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class GlobalClipSGD(tf_keras.optimizers.legacy.SGD):
    """Legacy SGD that clips all gradients by one global norm before applying them."""

    def __init__(
        self, learning_rate: Any = 0.01, momentum: float = 0.0, clip: float = 100.0, **kwargs: Any
    ) -> None:
        super().__init__(learning_rate=learning_rate, momentum=momentum, **kwargs)
        self.clip = clip

    def apply_gradients(self, grads_and_vars: Any, name: Any = None) -> Any:  # drops **kwargs
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        grads, _ = tf.clip_by_global_norm([g for g, _ in pairs], self.clip)
        return super().apply_gradients(zip(grads, [v for _, v in pairs], strict=True), name=name)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["clip"] = self.clip
        return config
