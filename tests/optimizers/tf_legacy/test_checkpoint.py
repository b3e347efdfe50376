"""Optimizer state survives a checkpoint: iterations, every slot, every hyperparameter variable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from optimizers.tf_legacy.adam import Adam
from optimizers.tf_legacy.adamw_ref import AdamWRef
from optimizers.tf_legacy.ema_momentum import EmaMomentum
from optimizers.tf_legacy.lion import Lion
from optimizers.tf_legacy.sgd import SGD

CASES: list[tuple[Any, dict[str, Any]]] = [
    (EmaMomentum, {"learning_rate": 0.05, "weight_decay": 0.1}),
    (Lion, {"learning_rate": 1e-3, "weight_decay": 0.1}),
    (AdamWRef, {"learning_rate": 1e-2}),
    (SGD, {"learning_rate": 0.05, "momentum": 0.9}),
    (Adam, {"learning_rate": 1e-2, "amsgrad": True}),
]
IDS = [cls.optlab_name for cls, _ in CASES]

RNG = np.random.default_rng(11)
X = RNG.normal(size=(16, 4)).astype(np.float32)
Y = RNG.normal(size=(16, 2)).astype(np.float32)


def _model(seed: int) -> Any:
    init = tf_keras.initializers.GlorotUniform(seed=seed)
    return tf_keras.Sequential(
        [
            tf_keras.layers.Dense(3, activation="tanh", kernel_initializer=init, input_shape=(4,)),
            tf_keras.layers.Dense(2, kernel_initializer=init, bias_initializer="ones"),
        ]
    )


def _trainer(model: Any, optimizer: Any) -> Any:
    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    return step


def _state(model: Any, optimizer: Any) -> dict[str, np.ndarray]:
    state = {f"weight/{i}": var.numpy() for i, var in enumerate(model.trainable_variables)}
    state["iterations"] = optimizer.iterations.numpy()
    slots = set()
    for i, var in enumerate(model.trainable_variables):
        for name in optimizer.get_slot_names():
            slot = optimizer.get_slot(var, name)
            state[f"slot/{i}/{name}"] = slot.numpy()
            slots.add(id(slot))
    for weight in optimizer.weights:  # the rest: iterations and the hyperparameter variables
        if id(weight) not in slots:
            state[f"optimizer/{weight.name.split('/')[-1]}"] = weight.numpy()
    return state


def _assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)


@pytest.mark.parametrize("slots_first", [True, False], ids=["slots_created_first", "slots_restored_lazily"])
@pytest.mark.parametrize(("cls", "hyper"), CASES, ids=IDS)
def test_checkpoint_restores_into_fresh_objects(
    cls: Any, hyper: dict[str, Any], slots_first: bool, tmp_path: Path
) -> None:
    model, optimizer = _model(seed=1), cls(**hyper)
    step = _trainer(model, optimizer)
    for start in (0, 8, 0):
        step(X[start : start + 8], Y[start : start + 8])
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))
    saved = _state(model, optimizer)
    assert saved["iterations"] == 3

    fresh_model, fresh_optimizer = _model(seed=2), cls(**hyper)
    if slots_first:
        # OptimizerV2 has no public build(): this is what apply_gradients does first.
        fresh_optimizer._create_all_weights(fresh_model.trainable_variables)
    status = tf.train.Checkpoint(model=fresh_model, optimizer=fresh_optimizer).read(path)
    if slots_first:
        status.assert_consumed()
        _assert_same(_state(fresh_model, fresh_optimizer), saved)
    else:
        status.assert_existing_objects_matched()

    # Continuing from the reload is bitwise the same as continuing from the original.
    fresh_step = _trainer(fresh_model, fresh_optimizer)
    for start in (8, 0):
        step(X[start : start + 8], Y[start : start + 8])
        fresh_step(X[start : start + 8], Y[start : start + 8])
    _assert_same(_state(fresh_model, fresh_optimizer), _state(model, optimizer))
    assert fresh_optimizer.iterations.numpy() == 5


@pytest.mark.parametrize(("cls", "hyper"), CASES[:3], ids=IDS[:3])
def test_h5_model_file_brings_the_optimizer_back(cls: Any, hyper: dict[str, Any], tmp_path: Path) -> None:
    """`model.save(...h5)` keeps the optimizer; load_model revives it by registered name alone.

    (A SavedModel directory or a `.keras` file does not: load_model gives iterations == 0
    and no slots, for tf_keras's own legacy optimizers too.)
    """
    model, optimizer = _model(seed=1), cls(**hyper)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "model.h5"
    with pytest.warns(UserWarning, match="HDF5"):
        model.save(path)
    loaded = tf_keras.models.load_model(path)
    assert type(loaded.optimizer) is cls
    assert loaded.optimizer.get_config() == optimizer.get_config()
    _assert_same(_state(loaded, loaded.optimizer), _state(model, optimizer))
