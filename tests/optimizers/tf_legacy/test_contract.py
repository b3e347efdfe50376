"""What the registry and the trainer rely on, written once and run over every legacy tf.keras built-in."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Case:
    cls: Any
    # Every constructor argument set away from its default, for the config round trip.
    config: dict[str, Any]
    # Settings under which the step is proportional to lr for a constant gradient.
    proportional: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case(
        EmaMomentum,
        {"learning_rate": 0.05, "beta": 0.8, "weight_decay": 0.1},
        proportional={"weight_decay": 0.0},
        defaults={"learning_rate": 0.01, "beta": 0.9, "weight_decay": 0.0},
    ),
    Case(
        Lion,
        {"learning_rate": 3e-4, "beta_1": 0.8, "beta_2": 0.95, "weight_decay": 0.1},
        proportional={"weight_decay": 0.0},
        defaults={"learning_rate": 1e-4, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.0},
    ),
    Case(
        AdamWRef,
        {"learning_rate": 3e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "weight_decay": 0.05},
        proportional={"weight_decay": 0.0},
        defaults={
            "learning_rate": 1e-3,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-8,
            "weight_decay": 1e-2,
        },
    ),
    Case(SGD, {"learning_rate": 0.05, "momentum": 0.5, "nesterov": True}, proportional={"momentum": 0.0}),
    Case(Adam, {"learning_rate": 3e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "amsgrad": True}),
]
IDS = [case.cls.optlab_name for case in CASES]


def _variables() -> list[tf.Variable]:
    return [
        tf.Variable([[1.0, -2.0, 0.5], [0.25, 3.0, -1.5]], dtype=tf.float64),
        tf.Variable([0.5, -0.75], dtype=tf.float64),
    ]


def _gradients() -> list[tf.Tensor]:
    return [
        tf.constant([[0.5, -1.0, 0.25], [2.0, -0.5, 1.0]], dtype=tf.float64),
        tf.constant([-0.3, 0.7], dtype=tf.float64),
    ]


def _arguments(cls: type) -> list[str]:
    return [
        arg.name
        for arg in inspect.signature(cls).parameters.values()
        if arg.kind not in (arg.VAR_KEYWORD, arg.VAR_POSITIONAL)
    ]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_class_follows_the_catalogue_contract(case: Case) -> None:
    cls: Any = case.cls
    assert issubclass(cls, tf_keras.optimizers.legacy.Optimizer)
    assert (inspect.getdoc(cls) or "").splitlines()[0].strip()
    assert cls.optlab_supports_sparse is True
    assert tf_keras.utils.get_registered_name(cls) == f"optlab>{cls.__name__}"
    assert tf_keras.utils.get_registered_object(f"optlab>{cls.__name__}") is cls
    arguments = _arguments(cls)
    assert arguments[0] == "learning_rate"
    assert set(cls.optlab_hyperparameters) <= set(arguments)
    assert set(getattr(cls, "optlab_tunable", arguments)) <= set(arguments)
    assert "learning_rate" in cls.optlab_hyperparameters
    signature = inspect.signature(cls).parameters
    assert signature["name"].default == cls.__name__
    for name, default in case.defaults.items():
        assert signature[name].default == default


@pytest.mark.parametrize("cls", [SGD, Adam], ids=["sgd", "adam"])
def test_baselines_restate_tf_keras_signature(cls: type) -> None:
    (parent,) = cls.__bases__
    ours = {name: arg.default for name, arg in inspect.signature(cls).parameters.items()}
    theirs = {name: arg.default for name, arg in inspect.signature(parent).parameters.items()}
    assert ours == theirs


@pytest.mark.parametrize("after_a_step", [False, True], ids=["fresh", "after_a_step"])
@pytest.mark.parametrize("schedule", [False, True], ids=["number", "schedule"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_config_round_trip(case: Case, schedule: bool, after_a_step: bool) -> None:
    arguments = dict(case.config)
    if schedule:
        arguments["learning_rate"] = tf_keras.optimizers.schedules.ExponentialDecay(
            arguments["learning_rate"], decay_steps=10, decay_rate=0.5
        )
    optimizer = case.cls(**arguments)
    if after_a_step:  # hyperparameters then live in variables and read back as NumPy scalars
        optimizer.apply_gradients(zip(_gradients(), _variables(), strict=True))
    config = optimizer.get_config()

    assert set(_arguments(case.cls)) <= set(config)
    for name, value in case.config.items():
        if not (schedule and name == "learning_rate"):
            assert config[name] == value, name
    as_json = json.loads(json.dumps(config))
    assert as_json == config
    restored = case.cls.from_config(as_json)
    assert type(restored) is case.cls
    assert restored.get_config() == config
    # By its registered name, as tf_keras itself stores an optimizer in a model file.
    revived = tf_keras.optimizers.deserialize(
        json.loads(json.dumps(tf_keras.optimizers.serialize(optimizer)))
    )
    assert type(revived) is case.cls
    assert revived.get_config() == config


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_legacy_lr_alias_is_honoured(case: Case) -> None:
    assert case.cls(lr=0.125).get_config()["learning_rate"] == 0.125


def _steps(optimizer: Any, count: int, change: Any = None) -> list[np.ndarray]:
    """Displacements of the weights over `count` steps of the same gradient, in a tf.function."""
    variables = _variables()
    grads = _gradients()

    @tf.function
    def step() -> None:
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    moves = []
    for index in range(count):
        if change is not None:
            change(optimizer, index)
        before = np.concatenate([v.numpy().ravel() for v in variables])
        step()
        moves.append(np.concatenate([v.numpy().ravel() for v in variables]) - before)
    return moves


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_learning_rate_schedule_is_honoured(case: Case) -> None:
    """With a constant gradient the state does not depend on lr, so each step scales with it."""
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    scheduled = _steps(case.cls(learning_rate=schedule, **case.proportional), 4)
    constant = _steps(case.cls(learning_rate=0.5, **case.proportional), 4)
    for step, (move, reference) in enumerate(zip(scheduled, constant, strict=True)):
        assert np.all(reference != 0)
        np.testing.assert_allclose(move, reference * 0.5**step, rtol=1e-12, err_msg=f"step {step}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_changing_a_hyperparameter_takes_effect_without_retracing(case: Case) -> None:
    def halve_at_step_two(optimizer: Any, index: int) -> None:
        if index == 2:
            optimizer.learning_rate = 0.25  # OptimizerV2 assigns the variable behind it

    changed = _steps(case.cls(learning_rate=0.5, **case.proportional), 3, change=halve_at_step_two)
    constant = _steps(case.cls(learning_rate=0.5, **case.proportional), 3)
    np.testing.assert_array_equal(changed[1], constant[1])
    np.testing.assert_allclose(changed[2], constant[2] * 0.5, rtol=1e-12)


ERRORS = [
    (EmaMomentum, {"learning_rate": 0.0}, "learning_rate must be a number > 0; received 0.0"),
    (EmaMomentum, {"learning_rate": True}, "learning_rate must be a number > 0; received true"),
    (EmaMomentum, {"lr": -1.0}, "learning_rate must be a number > 0; received -1.0"),
    (EmaMomentum, {"beta": 1.5}, "beta must be a number in [0, 1); received 1.5"),
    (EmaMomentum, {"weight_decay": -0.1}, "weight_decay must be a number >= 0; received -0.1"),
    (Lion, {"beta_1": 1.0}, "beta_1 must be a number in [0, 1); received 1.0"),
    (Lion, {"beta_2": -0.5}, "beta_2 must be a number in [0, 1); received -0.5"),
    (Lion, {"weight_decay": "0.1"}, 'weight_decay must be a number >= 0; received "0.1"'),
    (AdamWRef, {"beta_1": 1.5}, "beta_1 must be a number in [0, 1); received 1.5"),
    (AdamWRef, {"epsilon": 0.0}, "epsilon must be a number > 0; received 0.0"),
    (AdamWRef, {"weight_decay": float("nan")}, "weight_decay must be a number >= 0; received NaN"),
    (SGD, {"learning_rate": 0}, "learning_rate must be a number > 0; received 0"),
    (SGD, {"momentum": 1.0}, "momentum must be a number in [0, 1); received 1.0"),
    (Adam, {"beta_2": 1.0}, "beta_2 must be a number in [0, 1); received 1.0"),
    (Adam, {"epsilon": 0}, "epsilon must be a number > 0; received 0"),
]


@pytest.mark.parametrize(
    ("cls", "arguments", "message"), ERRORS, ids=[f"{c.__name__}-{m.split()[0]}" for c, _, m in ERRORS]
)
def test_constructor_errors_name_the_argument_and_the_value(
    cls: type, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cls(**arguments)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_schedule_is_not_range_checked_as_a_number(case: Case) -> None:
    schedule = tf_keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.1, 0.01])
    assert case.cls(learning_rate=schedule)._get_hyper("learning_rate") is schedule
