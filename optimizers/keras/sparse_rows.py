"""Dense or touched-rows updates for the Keras 3 optimizers, written once.

With the TensorFlow backend an `Embedding` hands `update_step` a `tf.IndexedSlices`;
the rule is applied to the rows it touches only (LazyAdam semantics), never to a
densified table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops


def apply_rule(
    optimizer: Any, rule: Callable[..., Sequence[Any]], gradient: Any, state: Sequence[Any]
) -> None:
    """Assign `rule(gradient, *state)` to `state` (the variable first, then its slots).

    A dense gradient updates the whole tensors. A `tf.IndexedSlices` gradient (what an
    `Embedding` hands the TensorFlow backend) updates only the rows it touches, lazily
    as LazyAdam does: repeated indices are summed first, untouched rows and their slots
    keep their values, and the table is never densified (gather rows, scatter them back).
    """
    dtype = state[0].dtype
    if not isinstance(gradient, tf.IndexedSlices):
        new = rule(ops.cast(gradient, dtype), *state)
        for target, value in zip(state, new, strict=True):
            optimizer.assign(target, value)
        return
    rows, position = tf.unique(gradient.indices)
    summed = tf.math.unsorted_segment_sum(tf.cast(gradient.values, dtype), position, tf.size(rows))
    new = rule(summed, *(tf.gather(_native(x), rows) for x in state))
    for target, value in zip(state, new, strict=True):
        optimizer.assign(target, tf.IndexedSlices(value, rows))


def _native(variable: Any) -> Any:
    # A keras.Variable's tf.Variable: `tf.gather` on it reads only the rows asked for.
    return variable.value if isinstance(variable, keras.Variable) else variable
