"""Broken on purpose: normalised gradient descent that divides the gradients by their
global norm in `apply()`. Under a distribution strategy `apply()` runs on each replica
with that replica's LOCAL gradients, before they are summed, so each replica
normalises its own half and the sum is not the normalised full gradient. On one
device it is right. (The place for it is after aggregation, e.g. in update_step.)
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

EXPECTED_FAILURES = frozenset({"distributed"})


def _squared_norm(gradient: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):  # repeated rows add up before squaring
        rows = tf.math.unsorted_segment_sum(gradient.values, gradient.indices, gradient.dense_shape[0])
        return tf.reduce_sum(tf.square(rows))
    return tf.reduce_sum(tf.square(gradient))


def _scaled(gradient: Any, factor: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


@keras.saving.register_keras_serializable(package="optlab_broken")
class NormalizedSGD(keras.optimizers.SGD):
    """SGD on the gradient scaled to unit global norm: every step has length about lr."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        present = [g for g in grads if g is not None]
        if present:
            norm = tf.sqrt(tf.add_n([_squared_norm(g) for g in present]))
            factor = 1.0 / (norm + 1e-8)
            grads = [None if g is None else _scaled(g, tf.cast(factor, g.dtype)) for g in grads]
        return super().apply(grads, trainable_variables)
