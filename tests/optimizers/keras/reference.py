"""The update rules in plain float64 numpy, written from the formulas, for golden values.

Each takes the gradient, the parameter and its slots (arrays of matching shape) and
returns the new parameter and slots; `t` is the optimizer's step counter, from 1.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


def ema_momentum(
    g: Array, p: Array, m: Array, *, t: int, learning_rate: float, beta: float, weight_decay: float
) -> tuple[Array, Array]:
    p = p * (1 - learning_rate * weight_decay)
    m = beta * m + (1 - beta) * g
    return p - learning_rate * m, m


def lion(
    g: Array,
    p: Array,
    m: Array,
    *,
    t: int,
    learning_rate: float,
    beta_1: float,
    beta_2: float,
    weight_decay: float,
) -> tuple[Array, Array]:
    direction = np.sign(beta_1 * m + (1 - beta_1) * g)
    p = p * (1 - learning_rate * weight_decay)
    return p - learning_rate * direction, beta_2 * m + (1 - beta_2) * g


def adamw_ref(
    g: Array,
    p: Array,
    m: Array,
    v: Array,
    *,
    t: int,
    learning_rate: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
) -> tuple[Array, Array, Array]:
    p = p * (1 - learning_rate * weight_decay)
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g**2
    step = learning_rate / (1 - beta_1**t)
    return p - step * m / (np.sqrt(v) / np.sqrt(1 - beta_2**t) + epsilon), m, v
