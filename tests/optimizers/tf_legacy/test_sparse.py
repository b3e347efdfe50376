"""Sparse gradients (tf.IndexedSlices, as from an embedding lookup): lazy updates of the touched rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from optimizers.tf_legacy.adam import Adam
from optimizers.tf_legacy.adamw_ref import AdamWRef
from optimizers.tf_legacy.ema_momentum import EmaMomentum
from optimizers.tf_legacy.lion import Lion
from optimizers.tf_legacy.sgd import SGD

LAZY: list[tuple[Any, dict[str, Any]]] = [
    (EmaMomentum, {"learning_rate": 0.1, "beta": 0.8, "weight_decay": 0.5}),
    (Lion, {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.9, "weight_decay": 0.5}),
    (AdamWRef, {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.9, "epsilon": 1e-6, "weight_decay": 0.5}),
]
LAZY_IDS = [cls.optlab_name for cls, _ in LAZY]

RNG = np.random.default_rng(3)
START = RNG.normal(size=(6, 3))
FIRST = RNG.normal(size=(6, 3))  # a dense step first, so that every slot row is non-zero
INDICES = np.array([4, 1, 4])  # row 4 twice: its two gradients must be summed
VALUES = RNG.normal(size=(3, 3))
TOUCHED = [1, 4]
UNTOUCHED = [0, 2, 3, 5]
SUMMED = np.stack([VALUES[1], VALUES[0] + VALUES[2]])  # the gradient of rows 1 and 4


def _slots(optimizer: Any, var: tf.Variable) -> dict[str, np.ndarray]:
    return {name: optimizer.get_slot(var, name).numpy() for name in optimizer.get_slot_names()}


def _sparse(values: np.ndarray, indices: np.ndarray) -> tf.IndexedSlices:
    return tf.IndexedSlices(
        tf.constant(values), tf.constant(indices, dtype=tf.int64), tf.constant(START.shape, dtype=tf.int64)
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize(("cls", "hyper"), LAZY, ids=LAZY_IDS)
def test_sparse_step_updates_only_the_touched_rows(cls: type, hyper: dict[str, Any], compiled: bool) -> None:
    table = tf.Variable(START)
    optimizer: Any = cls(**hyper)
    optimizer.apply_gradients([(tf.constant(FIRST), table)])
    table_before, slots_before = table.numpy(), _slots(optimizer, table)

    def sparse_step() -> None:
        optimizer.apply_gradients([(_sparse(VALUES, INDICES), table)])

    step: Any = tf.function(sparse_step) if compiled else sparse_step
    step()

    # The same two steps, dense, on a table of the touched rows alone (every rule is elementwise).
    rows = tf.Variable(START[TOUCHED])
    reference: Any = cls(**hyper)
    reference.apply_gradients([(tf.constant(FIRST[TOUCHED]), rows)])
    reference.apply_gradients([(tf.constant(SUMMED), rows)])

    assert optimizer.iterations.numpy() == reference.iterations.numpy() == 2
    after = table.numpy()
    np.testing.assert_allclose(after[TOUCHED], rows.numpy(), rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(after[UNTOUCHED], table_before[UNTOUCHED])
    assert not np.any(after[TOUCHED] == table_before[TOUCHED])
    for name, slot in _slots(optimizer, table).items():
        np.testing.assert_allclose(
            slot[TOUCHED], reference.get_slot(rows, name).numpy(), rtol=1e-14, atol=1e-15
        )
        np.testing.assert_array_equal(slot[UNTOUCHED], slots_before[name][UNTOUCHED], err_msg=name)

    if compiled:
        # Scatter updates only: nothing writes the whole table or a whole slot.
        ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
        assert "ResourceScatterUpdate" in ops
        assert "UnsortedSegmentSum" in ops  # OptimizerV2 sums the duplicate indices for us
        assert "AssignVariableOp" not in ops


@pytest.mark.parametrize(("cls", "hyper"), LAZY, ids=LAZY_IDS)
def test_rows_never_looked_up_keep_their_state_over_many_steps(cls: type, hyper: dict[str, Any]) -> None:
    table = tf.Variable(START)
    optimizer: Any = cls(**hyper)

    @tf.function
    def step(values: tf.Tensor, indices: tf.Tensor) -> None:
        optimizer.apply_gradients([(tf.IndexedSlices(values, indices, tf.shape(table, tf.int64)), table)])

    for index in range(4):
        step(tf.constant(VALUES[:2] * (index + 1)), tf.constant([1, 4], dtype=tf.int64))
    np.testing.assert_array_equal(table.numpy()[UNTOUCHED], START[UNTOUCHED])
    for slot in _slots(optimizer, table).values():
        assert not np.any(slot[UNTOUCHED])
        assert np.all(slot[TOUCHED] != 0)


@pytest.mark.parametrize(
    ("cls", "hyper"),
    [(SGD, {"learning_rate": 0.1, "momentum": 0.5}), (Adam, {"learning_rate": 0.1})],
    ids=["sgd", "adam"],
)
def test_baselines_take_sparse_gradients(cls: type, hyper: dict[str, Any]) -> None:
    """From a fresh state tf_keras's sparse step equals the dense step of the summed gradient."""
    sparse_table, dense_table = tf.Variable(START), tf.Variable(START)
    cls(**hyper).apply_gradients([(_sparse(VALUES, INDICES), sparse_table)])
    dense = np.zeros_like(START)
    np.add.at(dense, INDICES, VALUES)
    cls(**hyper).apply_gradients([(tf.constant(dense), dense_table)])
    np.testing.assert_allclose(sparse_table.numpy(), dense_table.numpy(), rtol=1e-12, atol=1e-15)
    assert not np.array_equal(sparse_table.numpy(), START)
