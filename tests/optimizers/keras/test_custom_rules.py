"""The three custom Keras optimizers against their float64 reference rules: five golden
steps on dense gradients, and lazy row updates on `tf.IndexedSlices` (an Embedding's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from optimizers.keras.adamw_ref import AdamWRef
from optimizers.keras.ema_momentum import EmaMomentum
from optimizers.keras.lion import Lion
from tests.optimizers.keras import reference
from tests.optimizers.keras.helpers import apply, slots, variable64

# (class, reference rule, hyperparameters, number of slots); learning rates are dyadic
# so the float32 learning-rate variable holds them exactly.
CUSTOM: list[tuple[Any, Callable[..., Any], dict[str, Any], int]] = [
    (EmaMomentum, reference.ema_momentum, {"learning_rate": 0.25, "beta": 0.8, "weight_decay": 0.1}, 1),
    (
        Lion,
        reference.lion,
        {"learning_rate": 0.125, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.5},
        1,
    ),
    (
        AdamWRef,
        reference.adamw_ref,
        {"learning_rate": 0.25, "beta_1": 0.8, "beta_2": 0.9, "epsilon": 1e-3, "weight_decay": 0.1},
        2,
    ),
]
IDS = [cls.optlab_name for cls, *_ in CUSTOM]


@pytest.mark.parametrize("no_decay", [False, True], ids=["decay", "no_decay"])
@pytest.mark.parametrize(("cls", "rule", "hyper", "n_slots"), CUSTOM, ids=IDS)
def test_golden_values_for_five_steps(
    cls: type, rule: Callable[..., Any], hyper: dict[str, Any], n_slots: int, no_decay: bool
) -> None:
    hyper = {**hyper, "weight_decay": 0.0} if no_decay else hyper
    p = np.array([1.0, -2.0, 0.5, 3.0])
    state = [np.zeros_like(p) for _ in range(n_slots)]
    variable = variable64(p)
    optimizer = cls(**hyper)
    for t in range(1, 6):
        g = variable.numpy()  # loss = sum(p ** 2) / 2
        apply(optimizer, variable, g)
        p, *state = rule(g, p, *state, t=t, **hyper)
        np.testing.assert_allclose(variable.numpy(), p, rtol=1e-13, atol=1e-15)
    for got, expected in zip(slots(optimizer), state, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-15)


ROWS, WIDTH = 6, 3
# (indices, step); row 0 appears twice in the first step, row 2 in both steps.
SPARSE_STEPS = [[0, 2, 0], [4, 2]]


def _run_sparse(optimizer: Any, table: Any, steps: list[tuple[list[int], np.ndarray]], mode: str) -> None:
    def step(values: Any, indices: Any) -> None:
        gradient = tf.IndexedSlices(values, indices, dense_shape=tf.constant([ROWS, WIDTH]))
        optimizer.apply([gradient], [table])

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "jit_compile")
    for indices, values in steps:
        step(tf.constant(values), tf.constant(indices))


@pytest.mark.parametrize("mode", ["eager", "tf.function", "jit_compile"])
@pytest.mark.parametrize(("cls", "rule", "hyper", "n_slots"), CUSTOM, ids=IDS)
def test_sparse_gradients_update_only_the_rows_they_touch(
    cls: type, rule: Callable[..., Any], hyper: dict[str, Any], n_slots: int, mode: str
) -> None:
    rng = np.random.default_rng(1)
    start = rng.normal(size=(ROWS, WIDTH))
    steps = [(indices, rng.normal(size=(len(indices), WIDTH))) for indices in SPARSE_STEPS]
    table = variable64(start)
    optimizer = cls(**hyper)
    _run_sparse(optimizer, table, steps, mode)

    # The dense rule on the touched rows only, duplicates summed; t counts every step.
    p, state = start.copy(), [np.zeros_like(start) for _ in range(n_slots)]
    for t, (indices, values) in enumerate(steps, start=1):
        rows = sorted(set(indices))
        g = np.stack([values[[i for i, index in enumerate(indices) if index == row]].sum(0) for row in rows])
        new = rule(g, p[rows], *(s[rows] for s in state), t=t, **hyper)
        for array, value in zip([p, *state], new, strict=True):
            array[rows] = value
    np.testing.assert_allclose(table.numpy(), p, rtol=1e-13, atol=1e-15)
    for got, expected in zip(slots(optimizer), state, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-15)

    untouched = [1, 3, 5]  # never written: bit for bit as they were, slots still zero
    np.testing.assert_array_equal(table.numpy()[untouched], start[untouched])
    for got in slots(optimizer):
        np.testing.assert_array_equal(got[untouched], 0.0)
    assert int(optimizer.iterations.numpy()) == len(steps)


@pytest.mark.parametrize(("cls", "rule", "hyper", "n_slots"), CUSTOM, ids=IDS)
def test_an_embedding_trained_by_fit_keeps_unseen_rows(
    cls: type, rule: Callable[..., Any], hyper: dict[str, Any], n_slots: int
) -> None:
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(8, 2)
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), embedding, keras.layers.Flatten(), keras.layers.Dense(1)]
    )
    model.compile(cls(**hyper), "mse")
    start = embedding.embeddings.numpy()
    x, y = np.array([[1, 1, 2], [5, 2, 1]]), np.ones((2, 1))
    for _ in range(3):
        model.train_on_batch(x, y)

    seen, unseen = [1, 2, 5], [0, 3, 4, 6, 7]
    after = embedding.embeddings.numpy()
    assert not np.any(after[seen] == start[seen])
    # With weight decay > 0 a dense update would have shrunk these rows too.
    np.testing.assert_array_equal(after[unseen], start[unseen])
    embedding_slots = [v.numpy() for v in model.optimizer.variables if "embedding" in v.path]
    assert len(embedding_slots) == n_slots
    for slot in embedding_slots:
        np.testing.assert_array_equal(slot[unseen], 0.0)
