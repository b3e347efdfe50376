"""AdamW reference (legacy tf.keras): torch.optim.AdamW's update, step for step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import torch

from optimizers.tf_legacy.adamw_ref import AdamWRef


def test_hand_computed_step() -> None:
    var = tf.Variable([1.0, -2.0], dtype=tf.float64)
    optimizer = AdamWRef(learning_rate=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.5)
    optimizer.apply_gradients([(tf.constant([0.5, 1.0], dtype=tf.float64), var)])
    # p * (1 - 0.1 * 0.5) = [0.95, -1.9];  m = 0.1 * g;  v = 0.001 * g^2.
    # At t = 1 the bias corrections undo the averages: m / (1 - 0.9) = g, sqrt(v / (1 - 0.999)) = |g|,
    # so the step is lr * g / (|g| + eps) = lr * sign(g) (up to eps / |g|).
    np.testing.assert_allclose(var.numpy(), [0.85, -2.0], rtol=1e-7)
    np.testing.assert_allclose(optimizer.get_slot(var, "m").numpy(), [0.05, 0.1], rtol=1e-6)
    # float32(0.999) is 0.99900001287, so 1 - beta_2 is off by 1.3e-5 relative; p is not
    # affected because sqrt(1 - beta_2^t) divides it out with the same value.
    np.testing.assert_allclose(optimizer.get_slot(var, "v").numpy(), [0.00025, 0.001], rtol=2e-5)


def _golden(
    start: list[float],
    *,
    learning_rate: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
    steps: int,
) -> list[list[float]]:
    """torch.optim.AdamW's rule in plain Python floats, for loss = sum(p ** 2) / 2 (so g = p)."""
    p = list(start)
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    history = []
    for t in range(1, steps + 1):
        g = list(p)
        p = [x * (1 - learning_rate * weight_decay) for x in p]
        m = [beta_1 * mi + (1 - beta_1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [beta_2 * vi + (1 - beta_2) * gi * gi for vi, gi in zip(v, g, strict=True)]
        step_size = learning_rate / (1 - beta_1**t)
        correction = math.sqrt(1 - beta_2**t)
        p = [
            x - step_size * mi / (math.sqrt(vi) / correction + epsilon)
            for x, mi, vi in zip(p, m, v, strict=True)
        ]
        history.append(p)
    return history


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.125])
def test_golden_values_for_five_steps(compiled: bool, weight_decay: float) -> None:
    # Binary fractions, so the float32 hyperparameter variables hold them exactly.
    start = [1.0, -2.0, 0.5, 3.0]
    hyper: dict[str, Any] = {"learning_rate": 0.25, "beta_1": 0.75, "beta_2": 0.875, "epsilon": 2.0**-20}
    hyper["weight_decay"] = weight_decay
    var = tf.Variable(start, dtype=tf.float64)
    optimizer = AdamWRef(**hyper)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var**2) / 2
        optimizer.apply_gradients([(tape.gradient(loss, var), var)])

    run = tf.function(step) if compiled else step
    for expected in _golden(start, steps=5, **hyper):
        run()
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-14, atol=1e-15)


def test_matches_torch_adamw_for_fifty_steps() -> None:
    """Same float32 weights, same loss, same hyperparameters: the trajectories agree to 1e-6."""
    rng = np.random.default_rng(7)
    shapes = [(4, 3), (3,), (5,)]
    starts = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    targets = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    scales = [rng.uniform(0.1, 3.0, size=shape).astype(np.float32) for shape in shapes]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}

    torch_params = [torch.nn.Parameter(torch.tensor(start)) for start in starts]
    torch_optimizer = torch.optim.AdamW(torch_params, **hyper)  # type: ignore[arg-type]
    tf_vars = [tf.Variable(start) for start in starts]
    tf_optimizer = AdamWRef(learning_rate=1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.1)

    @tf.function
    def tf_step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [
                    tf.reduce_sum(scale * (var - target) ** 2)
                    for var, target, scale in zip(tf_vars, targets, scales, strict=True)
                ]
            )
        tf_optimizer.apply_gradients(zip(tape.gradient(loss, tf_vars), tf_vars, strict=True))

    torch_targets = [torch.tensor(target) for target in targets]
    torch_scales = [torch.tensor(scale) for scale in scales]
    for _ in range(50):
        torch_optimizer.zero_grad()
        loss = sum(
            (scale * (param - target) ** 2).sum()
            for param, target, scale in zip(torch_params, torch_targets, torch_scales, strict=True)
        )
        loss.backward()  # type: ignore[union-attr]
        torch_optimizer.step()
        tf_step()

    for param, var, start in zip(torch_params, tf_vars, starts, strict=True):
        np.testing.assert_allclose(var.numpy(), param.detach().numpy(), rtol=0, atol=1e-6)
        assert np.abs(var.numpy() - start).max() > 0.1  # it did move
