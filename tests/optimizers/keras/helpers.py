"""Small builders shared by the Keras optimizer tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf


def variable64(values: Any) -> Any:
    """A float64 keras.Variable: with dyadic hyperparameters the steps are exact."""
    return keras.Variable(np.asarray(values, dtype=np.float64), dtype="float64")


def apply(optimizer: Any, variable: Any, gradient: Sequence[float] | np.ndarray) -> None:
    """One optimizer step with a dense gradient."""
    optimizer.apply([tf.constant(gradient, dtype=variable.dtype)], [variable])


def slots(optimizer: Any) -> list[np.ndarray]:
    """The optimizer's per-variable state, built on one variable: all but iteration and learning rate."""
    return [variable.numpy() for variable in optimizer.variables[2:]]
