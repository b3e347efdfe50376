"""The same optimizer in three styles computes the same thing.

Same initial parameters, same sequence of gradients (dense, and sparse rows as an
Embedding produces them, duplicates included), built through the registry with the
same hyperparameters: after 20 steps torch, Keras 3 and legacy tf.keras agree within
1e-5. This is what lets users compare optimizers across frameworks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from optimizers.registry import load_registry

STEPS = 20
ROWS, WIDTH = 12, 4
HYPER: dict[str, dict[str, Any]] = {
    "ema_momentum": {"lr": 0.05, "beta": 0.8, "weight_decay": 0.01},
    "lion": {"lr": 0.003, "beta_1": 0.9, "beta_2": 0.95, "weight_decay": 0.1},
    "adamw_ref": {"lr": 0.01, "beta_1": 0.85, "beta_2": 0.99, "epsilon": 1e-7, "weight_decay": 0.05},
}


def problem(sparse: bool) -> tuple[list[np.ndarray], list[list[Any]]]:
    """Initial values and, per step, one gradient per variable (dense array or (rows, values))."""
    rng = np.random.default_rng(7)
    initial = [
        rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        rng.normal(size=(WIDTH,)).astype(np.float32),
    ]
    steps = []
    for _ in range(STEPS):
        if sparse:
            rows = rng.integers(0, ROWS, size=5)
            rows[1] = rows[0]  # a duplicated row, as a batch repeating a token gives
            table_grad: Any = (rows.astype(np.int64), rng.normal(size=(5, WIDTH)).astype(np.float32))
        else:
            table_grad = rng.normal(size=(ROWS, WIDTH)).astype(np.float32)
        steps.append([table_grad, rng.normal(size=(WIDTH,)).astype(np.float32)])
    return initial, steps


def run_torch(name: str, sparse: bool, **switches: Any) -> list[np.ndarray]:
    import torch

    initial, steps = problem(sparse)
    params = [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in initial]
    optimizer = (
        load_registry(plugin_dirs=[], styles=("torch",))
        .get(name, "torch")
        .create({**HYPER[name], **switches}, model_params=params)
    )
    for grads in steps:
        for param, grad in zip(params, grads, strict=True):
            if isinstance(grad, tuple):
                rows, values = grad
                param.grad = torch.sparse_coo_tensor(
                    torch.from_numpy(rows)[None], torch.from_numpy(values), (ROWS, WIDTH)
                )
            else:
                param.grad = torch.from_numpy(grad)
        optimizer.step()
    return [param.detach().numpy().copy() for param in params]


def _tf_gradient(grad: Any) -> Any:
    import tensorflow as tf

    if isinstance(grad, tuple):
        rows, values = grad
        return tf.IndexedSlices(
            tf.constant(values), tf.constant(rows), dense_shape=tf.constant([ROWS, WIDTH])
        )
    return tf.constant(grad)


def run_keras(name: str, sparse: bool) -> list[np.ndarray]:
    import keras

    initial, steps = problem(sparse)
    variables = [keras.Variable(value.copy()) for value in initial]
    optimizer = load_registry(plugin_dirs=[], styles=("keras",)).get(name, "keras").create(HYPER[name])
    for grads in steps:
        optimizer.apply([_tf_gradient(grad) for grad in grads], variables)
    return [np.asarray(variable.numpy()) for variable in variables]


def run_legacy(name: str, sparse: bool) -> list[np.ndarray]:
    import tensorflow as tf

    initial, steps = problem(sparse)
    variables = [tf.Variable(value.copy()) for value in initial]
    optimizer = (
        load_registry(plugin_dirs=[], styles=("tf_legacy",)).get(name, "tf_legacy").create(HYPER[name])
    )
    for grads in steps:
        optimizer.apply_gradients(zip([_tf_gradient(grad) for grad in grads], variables, strict=True))
    return [variable.numpy() for variable in variables]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", sorted(HYPER))
def test_torch_keras_and_legacy_agree(name: str, sparse: bool) -> None:
    reference = run_torch(name, sparse)
    initial = problem(sparse)[0]
    moved = max(float(np.abs(after - before).max()) for after, before in zip(reference, initial, strict=True))
    assert moved > 1e-3, "the problem is too small to tell implementations apart"
    for style, run in (("keras", run_keras), ("tf_legacy", run_legacy)):
        for index, (expected, got) in enumerate(zip(reference, run(name, sparse), strict=True)):
            np.testing.assert_allclose(
                got, expected, rtol=0, atol=1e-5, err_msg=f"{name} {style} variable {index}"
            )


@pytest.mark.parametrize("name", ["adamw_ref", "ema_momentum"])
def test_torchs_fused_kernel_agrees_with_keras(name: str) -> None:
    """torch's `fused=True` (its fused SGD / AdamW kernel) computes what Keras computes too."""
    fused = run_torch(name, sparse=False, fused=True)
    for index, (expected, got) in enumerate(zip(run_keras(name, sparse=False), fused, strict=True)):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=f"{name} fused variable {index}")
