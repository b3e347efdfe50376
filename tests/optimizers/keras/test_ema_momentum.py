"""EMA momentum (Keras 3): p <- p * (1 - lr * wd);  m <- beta * m + (1 - beta) * g;  p <- p - lr * m."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from optimizers.keras.ema_momentum import EmaMomentum
from tests.optimizers.keras.helpers import apply, slots, variable64


@pytest.mark.parametrize(
    ("weight_decay", "after_one", "after_two"),
    [
        # m1 = 0.25 * g = [0.125, 0.25];  p1 = p0 - 0.5 * m1
        # m2 = 0.75 * m1 + 0.25 * g = [0.21875, 0.4375];  p2 = p1 - 0.5 * m2
        (0.0, [0.9375, -2.125], [0.828125, -2.34375]),
        # p is first scaled by 1 - lr * wd = 0.75: [0.75, -1.5] - [0.0625, 0.125]
        # then [0.6875, -1.625] * 0.75 - [0.109375, 0.21875]
        (0.5, [0.6875, -1.625], [0.40625, -1.4375]),
    ],
)
def test_hand_computed_steps(weight_decay: float, after_one: list[float], after_two: list[float]) -> None:
    variable = variable64([1.0, -2.0])
    optimizer = EmaMomentum(learning_rate=0.5, beta=0.75, weight_decay=weight_decay)
    for expected in (after_one, after_two):
        apply(optimizer, variable, [0.5, 1.0])
        np.testing.assert_array_equal(variable.numpy(), expected)
    np.testing.assert_array_equal(slots(optimizer)[0], [0.21875, 0.4375])


def test_follows_a_learning_rate_schedule_step_by_step() -> None:
    # lr = 0.5, then 0.25 (ExponentialDecay evaluated at iterations 0 and 1); g = [1]
    # m1 = 0.5, p1 = 1 - 0.5 * 0.5 = 0.75;  m2 = 0.75, p2 = 0.75 - 0.25 * 0.75 = 0.5625
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    variable = variable64([1.0])
    optimizer = EmaMomentum(learning_rate=schedule, beta=0.5)
    for expected in (0.75, 0.5625):
        apply(optimizer, variable, [1.0])
        np.testing.assert_array_equal(variable.numpy(), [expected])


def test_exclude_from_weight_decay_is_honoured() -> None:
    kernel = keras.Variable(np.ones(2), dtype="float64", name="kernel")
    bias = keras.Variable(np.ones(2), dtype="float64", name="bias")
    optimizer = EmaMomentum(learning_rate=0.5, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.apply([np.zeros(2), np.zeros(2)], [kernel, bias])  # no gradient: only decay moves p
    np.testing.assert_array_equal(kernel.numpy(), [0.75, 0.75])
    np.testing.assert_array_equal(bias.numpy(), [1.0, 1.0])
