"""Lion (legacy tf.keras): p <- p * (1 - lr * wd) - lr * sign(beta_1 * m + (1 - beta_1) * g)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from optimizers.tf_legacy.lion import Lion


def test_hand_computed_steps() -> None:
    var = tf.Variable([1.0, -2.0, 0.5], dtype=tf.float64)
    optimizer = Lion(learning_rate=0.1, beta_1=0.9, beta_2=0.99, weight_decay=0.5)
    # Step 1, m = 0: c = 0.1 * g, sign(c) = [1, -1, 0] (sign(0) = 0: no move);
    # p = [1, -2, 0.5] * 0.95 - 0.1 * [1, -1, 0];  m = 0.01 * g = [0.005, -0.01, 0].
    optimizer.apply_gradients([(tf.constant([0.5, -1.0, 0.0], dtype=tf.float64), var)])
    np.testing.assert_allclose(var.numpy(), [0.85, -1.8, 0.475], rtol=1e-7)
    np.testing.assert_allclose(optimizer.get_slot(var, "momentum").numpy(), [0.005, -0.01, 0.0], rtol=1e-6)
    # Step 2, g = [-0.01, 0.01, 1]: c = 0.9 * m + 0.1 * g = [0.0035, -0.008, 0.1], so the first two
    # still follow the momentum against their gradient;  p = p * 0.95 - 0.1 * [1, -1, 1].
    optimizer.apply_gradients([(tf.constant([-0.01, 0.01, 1.0], dtype=tf.float64), var)])
    np.testing.assert_allclose(var.numpy(), [0.7075, -1.61, 0.35125], rtol=1e-7)
    # m = 0.99 * m + 0.01 * g
    np.testing.assert_allclose(
        optimizer.get_slot(var, "momentum").numpy(), [0.00485, -0.0098, 0.01], rtol=1e-6
    )


TARGET = [0.9, -1.95, 0.6, 3.1]


def _golden(
    start: list[float], *, learning_rate: float, beta_1: float, beta_2: float, weight_decay: float, steps: int
) -> list[list[float]]:
    """The update rule in plain Python floats, for loss = sum((p - TARGET) ** 2) / 2."""
    p = list(start)
    m = [0.0] * len(p)
    history = []
    for _ in range(steps):
        g = [x - t for x, t in zip(p, TARGET, strict=True)]
        c = [beta_1 * mi + (1 - beta_1) * gi for mi, gi in zip(m, g, strict=True)]
        sign = [(ci > 0) - (ci < 0) for ci in c]
        p = [x * (1 - learning_rate * weight_decay) - learning_rate * s for x, s in zip(p, sign, strict=True)]
        m = [beta_2 * mi + (1 - beta_2) * gi for mi, gi in zip(m, g, strict=True)]
        history.append(p)
    return history


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.125])
def test_golden_values_for_five_steps(compiled: bool, weight_decay: float) -> None:
    # Steps overshoot the target, so the gradient changes sign and the momentum decides.
    start = [1.0, -2.0, 0.5, 3.0]
    hyper: dict[str, Any] = {"learning_rate": 0.0625, "beta_1": 0.75, "beta_2": 0.875}
    hyper["weight_decay"] = weight_decay
    var = tf.Variable(start, dtype=tf.float64)
    optimizer = Lion(**hyper)
    target = tf.constant(TARGET, dtype=tf.float64)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((var - target) ** 2) / 2
        optimizer.apply_gradients([(tape.gradient(loss, var), var)])

    run = tf.function(step) if compiled else step
    for expected in _golden(start, steps=5, **hyper):
        run()
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-14, atol=1e-15)
