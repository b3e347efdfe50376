"""AdamW as torch computes it (Keras 3), checked by hand and against Keras's and torch's AdamW."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
import torch

from optimizers.keras.adamw_ref import AdamWRef
from tests.optimizers.keras.helpers import apply, slots, variable64


def test_hand_computed_step() -> None:
    variable = variable64([1.0, -2.0])
    optimizer = AdamWRef(learning_rate=0.5, beta_1=0.5, beta_2=0.75, epsilon=0.5, weight_decay=0.5)
    apply(optimizer, variable, [0.5, -2.0])
    # p * (1 - 0.25) = [0.75, -1.5];  m = 0.5 * g = [0.25, -1];  v = 0.25 * g^2 = [0.0625, 1]
    # t = 1: lr / (1 - 0.5) = 1;  sqrt(v) / sqrt(1 - 0.75) + 0.5 = [1, 2.5]
    # p = [0.75 - 0.25 / 1, -1.5 + 1 / 2.5]
    np.testing.assert_allclose(variable.numpy(), [0.5, -1.1], rtol=0, atol=1e-15)
    momentum, velocity = slots(optimizer)
    np.testing.assert_array_equal(momentum, [0.25, -1.0])
    np.testing.assert_array_equal(velocity, [0.0625, 1.0])


SHAPES = [(4, 5), (3,)]
HYPER = {"learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8, "weight_decay": 0.1}


def _keras_run(optimizer: Any, start: list[np.ndarray], grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    variables = [keras.Variable(value) for value in start]
    for step in grads:
        optimizer.apply([tf.constant(g) for g in step], variables)
    return [variable.numpy() for variable in variables]


def test_matches_keras_and_torch_adamw_after_50_steps() -> None:
    rng = np.random.default_rng(0)
    # Small parameters keep float32 rounding (about 1 ulp a step, in each framework) well below 1e-6.
    start = [rng.normal(scale=0.2, size=shape).astype(np.float32) for shape in SHAPES]
    grads = [[rng.normal(size=shape).astype(np.float32) for shape in SHAPES] for _ in range(50)]

    ours = _keras_run(AdamWRef(**HYPER), start, grads)
    # Keras adds epsilon before the bias correction of sqrt(v): with 1e-8 that is far below 1e-6.
    keras_adamw = _keras_run(keras.optimizers.AdamW(**HYPER), start, grads)

    params = [torch.nn.Parameter(torch.tensor(value)) for value in start]
    torch_adamw = torch.optim.AdamW(
        params,
        lr=HYPER["learning_rate"],
        betas=(HYPER["beta_1"], HYPER["beta_2"]),
        eps=HYPER["epsilon"],
        weight_decay=HYPER["weight_decay"],
    )
    for step in grads:
        for param, g in zip(params, step, strict=True):
            param.grad = torch.tensor(g)
        torch_adamw.step()

    for mine, first, from_keras, param in zip(ours, start, keras_adamw, params, strict=True):
        assert np.abs(mine - first).max() > 1e-2  # it moved 10^4 times the tolerance
        np.testing.assert_allclose(mine, from_keras, rtol=0, atol=1e-6)
        np.testing.assert_allclose(mine, param.detach().numpy(), rtol=0, atol=1e-6)
