"""EMA momentum (legacy tf.keras): m <- beta * m + (1 - beta) * g;  p <- p * (1 - lr * wd) - lr * m."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from optimizers.tf_legacy.ema_momentum import EmaMomentum


@pytest.mark.parametrize(
    ("weight_decay", "after_one", "after_two"),
    [
        # m1 = 0.1 * g = [0.05, 0.1];  p1 = p0 - 0.1 * m1
        # m2 = 0.9 * m1 + 0.1 * g = [0.095, 0.19];  p2 = p1 - 0.1 * m2
        (0.0, [0.995, -2.01], [0.9855, -2.029]),
        # p is first scaled by 1 - lr * wd = 0.95: [0.95, -1.9] - [0.005, 0.01]
        # then [0.945, -1.91] * 0.95 - [0.0095, 0.019]
        (0.5, [0.945, -1.91], [0.88825, -1.8335]),
    ],
)
def test_hand_computed_steps(weight_decay: float, after_one: list[float], after_two: list[float]) -> None:
    var = tf.Variable([1.0, -2.0], dtype=tf.float64)
    optimizer = EmaMomentum(learning_rate=0.1, beta=0.9, weight_decay=weight_decay)
    for expected in (after_one, after_two):
        optimizer.apply_gradients([(tf.constant([0.5, 1.0], dtype=tf.float64), var)])
        # Hyperparameters live in float32 variables: 0.1 and 0.9 are off by ~1e-8 relative.
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-7)
    assert optimizer.iterations.numpy() == 2


def _golden(
    start: list[float], *, learning_rate: float, beta: float, weight_decay: float, steps: int
) -> list[list[float]]:
    """The update rule in plain Python floats, for loss = sum(p ** 2) / 2 (so g = p)."""
    p = list(start)
    m = [0.0] * len(p)
    history = []
    for _ in range(steps):
        g = list(p)
        m = [beta * mi + (1 - beta) * gi for mi, gi in zip(m, g, strict=True)]
        p = [x * (1 - learning_rate * weight_decay) - learning_rate * mi for x, mi in zip(p, m, strict=True)]
        history.append(p)
    return history


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.125])
def test_golden_values_for_five_steps(compiled: bool, weight_decay: float) -> None:
    # Binary fractions, so the float32 hyperparameter variables hold them exactly.
    start = [1.0, -2.0, 0.5, 3.0]
    hyper: dict[str, Any] = {"learning_rate": 0.25, "beta": 0.75, "weight_decay": weight_decay}
    var = tf.Variable(start, dtype=tf.float64)
    optimizer = EmaMomentum(**hyper)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var**2) / 2
        optimizer.apply_gradients([(tape.gradient(loss, var), var)])

    run = tf.function(step) if compiled else step
    for expected in _golden(start, steps=5, **hyper):
        run()
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-14, atol=1e-15)
