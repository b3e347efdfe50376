"""What the registry and the checkpoint round trip rely on, for every Keras 3 built-in:
catalogue attributes, constructor validation, config round trip, `.keras` save and reload."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from optimizers.keras.adam import Adam
from optimizers.keras.adamw import AdamW
from optimizers.keras.adamw_ref import AdamWRef
from optimizers.keras.ema_momentum import EmaMomentum
from optimizers.keras.lion import Lion
from optimizers.keras.sgd import SGD

# (class, registry key, non-default hyperparameters); the first three are optlab's own.
ALL: list[tuple[type, str, dict[str, Any]]] = [
    (EmaMomentum, "ema_momentum", {"learning_rate": 0.03, "beta": 0.8, "weight_decay": 0.1}),
    (Lion, "lion", {"learning_rate": 3e-4, "beta_1": 0.95, "beta_2": 0.98, "weight_decay": 0.5}),
    (
        AdamWRef,
        "adamw_ref",
        {"learning_rate": 3e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "weight_decay": 0.05},
    ),
    (SGD, "sgd", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
    (Adam, "adam", {"learning_rate": 3e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6, "amsgrad": True}),
    (
        AdamW,
        "adamw",
        {
            "learning_rate": 3e-3,
            "weight_decay": 0.05,
            "beta_1": 0.8,
            "beta_2": 0.99,
            "epsilon": 1e-6,
            "amsgrad": True,
        },
    ),
]
CUSTOM = (EmaMomentum, Lion, AdamWRef)
IDS = [key for _, key, _ in ALL]


@pytest.mark.parametrize(("cls", "key", "hyper"), ALL, ids=IDS)
def test_catalogue_attributes(cls: Any, key: str, hyper: dict[str, Any]) -> None:
    assert cls.optlab_name == key
    assert cls.__doc__ and "__doc__" in vars(cls)  # its own, not Keras's
    assert inspect.cleandoc(cls.__doc__).splitlines()[0].endswith(".")
    signature = inspect.signature(cls).parameters
    assert set(cls.optlab_hyperparameters) <= set(signature)
    assert set(hyper) <= set(cls.optlab_hyperparameters)
    assert "learning_rate" in cls.optlab_hyperparameters
    assert getattr(cls, "optlab_supports_sparse", False) is (cls in CUSTOM)
    if cls not in CUSTOM:
        assert set(cls.optlab_tunable) == set(cls.optlab_hyperparameters)
    assert keras.saving.get_registered_name(cls) == f"optlab>{cls.__name__}"


def test_custom_defaults_are_the_shared_ones() -> None:
    def defaults(cls: Any) -> dict[str, Any]:
        return {
            name: arg.default
            for name, arg in inspect.signature(cls).parameters.items()
            if arg.kind is arg.POSITIONAL_OR_KEYWORD
        }

    assert defaults(EmaMomentum) == {"learning_rate": 0.01, "beta": 0.9, "weight_decay": 0.0}
    assert defaults(Lion) == {"learning_rate": 1e-4, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.0}
    assert defaults(AdamWRef) == {
        "learning_rate": 1e-3,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-8,
        "weight_decay": 1e-2,
    }


@pytest.mark.parametrize(("cls", "key", "hyper"), ALL, ids=IDS)
def test_config_round_trip(cls: Any, key: str, hyper: dict[str, Any]) -> None:
    optimizer = cls(**hyper, clipnorm=1.0, name="mine")
    config = optimizer.get_config()
    json.dumps(config)
    for name, value in hyper.items():
        assert config[name] == pytest.approx(value, rel=1e-7)  # learning_rate went through float32
    assert (config["clipnorm"], config["name"]) == (1.0, "mine")
    again = cls.from_config(copy.deepcopy(config))
    assert type(again) is cls
    assert again.get_config() == config


@pytest.mark.parametrize(("cls", "key", "hyper"), ALL, ids=IDS)
def test_config_round_trip_with_a_schedule(cls: Any, key: str, hyper: dict[str, Any]) -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    optimizer = cls(**{**hyper, "learning_rate": schedule})
    config = optimizer.get_config()
    json.dumps(config)
    assert config["learning_rate"]["class_name"] == "ExponentialDecay"
    again = cls.from_config(copy.deepcopy(config))
    assert again.get_config() == config
    assert isinstance(again.learning_rate, type(optimizer.learning_rate))  # evaluated, not a variable
    assert float(again.learning_rate) == pytest.approx(0.1)


ERRORS: list[tuple[type, dict[str, Any], str]] = [
    (EmaMomentum, {"learning_rate": 0.0}, "learning_rate must be a number > 0; received 0.0"),
    (EmaMomentum, {"learning_rate": True}, "learning_rate must be a number > 0; received true"),
    (EmaMomentum, {"beta": 1.0}, "beta must be a number in [0, 1); received 1.0"),
    (EmaMomentum, {"weight_decay": -0.1}, "weight_decay must be a number >= 0; received -0.1"),
    (Lion, {"beta_1": 1.5}, "beta_1 must be a number in [0, 1); received 1.5"),
    (Lion, {"beta_2": "0.9"}, 'beta_2 must be a number in [0, 1); received "0.9"'),
    (AdamWRef, {"epsilon": 0}, "epsilon must be a number > 0; received 0"),
    (AdamWRef, {"learning_rate": float("nan")}, "learning_rate must be a number > 0; received NaN"),
    (SGD, {"momentum": 1.0}, "momentum must be a number in [0, 1); received 1.0"),
    (SGD, {"nesterov": 1}, "nesterov must be true or false; received 1"),
    (Adam, {"beta_2": -0.5}, "beta_2 must be a number in [0, 1); received -0.5"),
    (Adam, {"amsgrad": "yes"}, 'amsgrad must be true or false; received "yes"'),
    (AdamW, {"weight_decay": -1}, "weight_decay must be a number >= 0; received -1"),
    (AdamW, {"learning_rate": -3e-4}, "learning_rate must be a number > 0; received -0.0003"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), ERRORS)
def test_constructor_errors_name_the_argument_and_the_value(
    cls: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        cls(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize(("cls", "key", "hyper"), ALL, ids=IDS)
def test_integer_hyperparameters_are_accepted(cls: Any, key: str, hyper: dict[str, Any]) -> None:
    # JSON has no float type of its own: `1` and `0` must work where Keras insists on floats.
    ints = {name: int(value) for name, value in hyper.items() if name in ("learning_rate", "momentum")}
    ints["learning_rate"] = 1
    assert cls(**ints).get_config()["learning_rate"] == 1.0


def _tiny_model(optimizer: Any) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer, "mse")
    return model


# Keras's own saving code calls np.array on its variables; numpy 2 warns about that, not about us.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
@pytest.mark.parametrize(("cls", "key", "hyper"), ALL, ids=IDS)
def test_saved_model_reloads_without_custom_objects(
    cls: Any, key: str, hyper: dict[str, Any], tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)), rng.normal(size=(8, 1))
    model = _tiny_model(cls(**hyper))
    for _ in range(3):
        model.train_on_batch(x, y)
    model.save(tmp_path / "m.keras")

    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is cls
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == 3
    saved, reloaded = model.optimizer.variables, loaded.optimizer.variables
    assert len(reloaded) == len(saved)  # paths differ: the reloaded layers get fresh auto-names
    assert len(saved) > 2  # iteration, learning rate and the slots
    for before, after in zip(saved, reloaded, strict=True):
        np.testing.assert_array_equal(after.numpy(), before.numpy())

    # And the reloaded optimizer carries on exactly where the original would have.
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    for before, after in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(after.numpy(), before.numpy())
