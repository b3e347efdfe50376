"""Broken on purpose: normalised gradient descent that divides the gradients by their
global norm in `apply_gradients()`, before the base class sums them over replicas, so
under a distribution strategy each replica normalises its own local half. On one
device it is right. (The place for it is `_transform_gradients`, after aggregation.)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

EXPECTED_FAILURES = frozenset({"distributed"})


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class NormalizedSGD(tf_keras.optimizers.legacy.SGD):
    """Legacy SGD on the gradient scaled to unit global norm: every step has length about lr."""

    def apply_gradients(self, grads_and_vars: Any, name: Any = None, **kwargs: Any) -> Any:
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if pairs:
            norm = tf.linalg.global_norm([tf.convert_to_tensor(g) for g, _ in pairs])
            factor = 1.0 / (norm + 1e-8)
            pairs = [
                (
                    tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
                    if isinstance(g, tf.IndexedSlices)
                    else g * factor,
                    v,
                )
                for g, v in pairs
            ]
        return super().apply_gradients(pairs, name=name, **kwargs)
