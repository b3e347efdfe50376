"""Generic tests written once and fanned out over every (name, style) entry of the catalogue.

The idea of torch's `common_optimizers.py` (`OptimizerInfo`, `optim_db`) across all three
styles: the table is `load_registry()` with torch, Keras 3 and legacy tf.keras loaded in
this one process, so an optimizer registered in any style (built-in, entry point or
OPTLAB_PLUGIN_DIRS plugin) is covered without editing this file. What differs between
styles lives in the framework drivers (`jobs.frameworks`), never in per-optimizer code; the
capability flags (`style`, `supports_sparse`) come from the entries themselves.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
import torch

from jobs.frameworks import driver_for
from jobs.frameworks.base import Driver, SparseRows
from optimizers.hyperparams import Param
from optimizers.registry import BUILTIN_MODULES, STYLES, Entry, load_registry

REGISTRY = load_registry()
ENTRIES = sorted(REGISTRY.entries.values(), key=lambda entry: (entry.name, STYLES.index(entry.style)))
SPARSE_ENTRIES = [entry for entry in ENTRIES if entry.supports_sparse]

# The only per-optimizer knowledge: a learning rate for the toy problem below where an entry's
# default is not meant for it, keyed by name and so the same in every style. Every built-in
# solves it with its defaults; a plugin whose default lr is far off adds one row here.
LR_OVERRIDES: dict[str, float] = {}

DESCENT_STEPS = 150
STATE_STEPS = 3


def _id(entry: Entry) -> str:
    return f"{entry.name}-{entry.style}"


def _hyperparams(entry: Entry) -> dict[str, Any]:
    return {"lr": LR_OVERRIDES[entry.name]} if entry.name in LR_OVERRIDES else {}


def _arg(entry: Entry, param: str) -> str:
    """The constructor's (and config's) name of catalogue hyperparameter `param`."""
    return entry.lr_arg if param == "lr" else param


# --- one driver per style -----------------------------------------------------------------------------
# The framework drivers of jobs/frameworks drive every style (variables, optimizer, step,
# values); what this table asserts about each style's own serialization is below them.

DRIVERS: dict[str, Driver] = {style: driver_for(style) for style in STYLES}


def _create(entry: Entry, hyperparams: Mapping[str, Any], variables: list[Any]) -> Any:
    """Through the catalogue, over `variables`, as a training job builds it."""
    driver = DRIVERS[entry.style]
    return driver.optimizer_over(lambda params: entry.create(hyperparams, model_params=params), variables)


# torch


def _torch_saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _torch_config(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # torch has no get_config: the hyperparameters live in the param groups of the state dict.
    groups = optimizer.state_dict()["param_groups"]
    assert _torch_saved(groups) == groups, "param groups do not survive torch.save/torch.load"
    return {key: value for key, value in groups[0].items() if key != "params"}


def _assert_same_torch_state(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for index, state in left["state"].items():
        other = right["state"][index]
        assert state.keys() == other.keys(), f"state[{index}]"
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == other[key].dtype, f"state[{index}][{key!r}]"
                assert torch.equal(value, other[key]), f"state[{index}][{key!r}]"
            else:
                assert value == other[key], f"state[{index}][{key!r}]"


def _torch_state_roundtrip(
    entry: Entry, hyperparams: Mapping[str, Any], optimizer: Any, variables: list[Any], tmp_path: Path
) -> tuple[Any, list[Any]]:
    driver = DRIVERS["torch"]
    loaded = _torch_saved(optimizer.state_dict())
    fresh_variables = driver.variables(driver.values(variables))
    fresh = entry.create(hyperparams, model_params=fresh_variables)
    fresh.load_state_dict(loaded)
    _assert_same_torch_state(optimizer.state_dict(), fresh.state_dict())
    return fresh, fresh_variables


# Keras 3 and legacy tf.keras


def _config_roundtrip(module: Any) -> Callable[[Any], dict[str, Any]]:
    """`module` is keras.optimizers or tf_keras.optimizers: both serialize the same way."""

    def roundtrip(optimizer: Any) -> dict[str, Any]:
        config: dict[str, Any] = optimizer.get_config()
        assert json.loads(json.dumps(config)) == config, "get_config() is not plain JSON"
        assert type(optimizer).from_config(config).get_config() == config
        restored = module.deserialize(module.serialize(optimizer))
        assert type(restored) is type(optimizer), f"deserialize gave {type(restored)}"
        assert restored.get_config() == config
        return config

    return roundtrip


def _optimizer_variables(optimizer: Any) -> list[tuple[str, np.ndarray]]:
    variables = optimizer.variables
    if callable(variables):  # legacy OptimizerV2: a method
        variables = variables()
    return [(getattr(v, "path", None) or v.name, np.array(v.numpy())) for v in variables]


def _unnamed_config(optimizer: Any) -> dict[str, Any]:
    # Keras 3 gives a second optimizer of a class a new name (`sgd_1`): not a hyperparameter.
    return {**optimizer.get_config(), "name": None}


def _checkpoint_roundtrip(style: str) -> Callable[..., tuple[Any, list[Any]]]:
    def roundtrip(
        entry: Entry, hyperparams: Mapping[str, Any], optimizer: Any, variables: list[Any], tmp_path: Path
    ) -> tuple[Any, list[Any]]:
        driver = DRIVERS[style]
        written = tf.train.Checkpoint(optimizer=optimizer, variables=variables).write(str(tmp_path / "ckpt"))
        # Fresh variables hold zeros: their values must come back from the checkpoint too.
        fresh_variables = driver.variables([np.zeros_like(value) for value in driver.values(variables)])
        fresh = _create(entry, hyperparams, fresh_variables)  # state created first, then filled by `read`
        tf.train.Checkpoint(optimizer=fresh, variables=fresh_variables).read(written).assert_consumed()

        assert int(fresh.iterations.numpy()) == int(optimizer.iterations.numpy()) == STATE_STEPS
        for index, (saved, loaded) in enumerate(
            zip(driver.values(variables), driver.values(fresh_variables), strict=True)
        ):
            assert np.array_equal(saved, loaded), f"variable {index}"
        before, after = _optimizer_variables(optimizer), _optimizer_variables(fresh)
        # Matched by position: names carry per-object suffixes (`adam_1/...`, `Adam/iter:0`).
        assert len(after) == len(before), [name for name, _ in before]
        for (name, saved), (_, loaded) in zip(before, after, strict=True):
            assert saved.dtype == loaded.dtype, f"optimizer variable {name}"
            assert np.array_equal(saved, loaded), f"optimizer variable {name}"
        assert _unnamed_config(fresh) == _unnamed_config(optimizer)
        return fresh, fresh_variables

    return roundtrip


@dataclass(frozen=True)
class RoundTrips:
    """What this table asserts about a style's own serialization, on top of its driver.

    `config` checks the style's config serialization and returns the optimizer's
    hyperparameters by constructor argument name. `state` saves the state of an optimizer
    that has taken steps, loads it into a fresh optimizer over fresh variables, asserts
    nothing was lost, and returns the two.
    """

    config: Callable[[Any], dict[str, Any]]
    state: Callable[[Entry, Mapping[str, Any], Any, list[Any], Path], tuple[Any, list[Any]]]


ROUND_TRIPS: dict[str, RoundTrips] = {
    "torch": RoundTrips(config=_torch_config, state=_torch_state_roundtrip),
    "keras": RoundTrips(config=_config_roundtrip(keras.optimizers), state=_checkpoint_roundtrip("keras")),
    "tf_legacy": RoundTrips(
        config=_config_roundtrip(tf_keras.optimizers), state=_checkpoint_roundtrip("tf_legacy")
    ),
}


def test_table_loads_all_styles_cleanly() -> None:
    assert REGISTRY.errors == [], "an optimizer on the path failed to load"
    assert set(DRIVERS) == set(ROUND_TRIPS) == set(STYLES), "a style without a driver"
    builtins = {
        (module.rsplit(".", 1)[1], style) for style, modules in BUILTIN_MODULES.items() for module in modules
    }
    assert builtins <= set(REGISTRY.entries), "a built-in is missing from the table"
    assert set(LR_OVERRIDES) <= set(REGISTRY.names()), "an override names no entry"


# --- 1. descent on least squares --------------------------------------------------------------------


class LeastSquares:
    """mean((A w + c - b)^2) in float32 with its gradients in NumPy, the same for every style.

    Well conditioned ([A, 1] has condition number about 2.4) with curvature about 8 and the
    solution about 0.02 from the start, the scale of a network's weights, so the default
    learning rates (1e-4 to 1e-2) of the built-ins all halve the loss well inside the budget.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.a = (2.0 * rng.normal(size=(32, 4))).astype(np.float32)
        self.b = (self.a @ (0.02 * rng.normal(size=4)) + 0.01).astype(np.float32)

    def initial(self) -> list[np.ndarray]:
        return [np.zeros(4, np.float32), np.zeros(1, np.float32)]

    def loss_and_gradients(self, values: Sequence[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        weight, bias = values
        residual = self.a @ weight + bias - self.b
        grads = [2.0 / len(self.b) * self.a.T @ residual, np.array([2.0 * residual.mean()])]
        return float(np.mean(residual**2)), [grad.astype(np.float32) for grad in grads]


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_loss_halves_on_least_squares(entry: Entry) -> None:
    driver = DRIVERS[entry.style]
    problem = LeastSquares()
    variables = driver.variables(problem.initial())
    optimizer = _create(entry, _hyperparams(entry), variables)
    first, grads = problem.loss_and_gradients(driver.values(variables))
    last, steps = first, 0
    while last > 0.5 * first and steps < DESCENT_STEPS:
        driver.step(optimizer, variables, grads)
        steps += 1
        last, grads = problem.loss_and_gradients(driver.values(variables))
    assert math.isfinite(last)
    assert last <= 0.5 * first, f"loss {first:.4g} -> {last:.4g} in {steps} steps"


# --- 2. out-of-range hyperparameters ----------------------------------------------------------------


@dataclass(frozen=True)
class OutOfRange:
    entry: Entry
    param: Param
    where: str  # "below" or "above", with "[i]" for one number of a pair
    value: Any

    @property
    def id(self) -> str:
        return f"{_id(self.entry)}-{self.param.name}-{self.where}"


def _just_outside(param: Param, side: str) -> float | int:
    """The bound itself when it is exclusive, else the next representable value beyond it."""
    bound, inclusive, away = (
        (param.low, param.low_inclusive, -math.inf)
        if side == "below"
        else (param.high, param.high_inclusive, math.inf)
    )
    assert bound is not None
    if param.type == "int":
        return (
            (math.floor(bound) - 1 if side == "below" else math.ceil(bound) + 1) if inclusive else int(bound)
        )
    return math.nextafter(bound, away) if inclusive else float(bound)


def _out_of_range_cases() -> list[OutOfRange]:
    cases = []
    for entry in ENTRIES:
        for param in entry.params.values():
            for side, bound in (("below", param.low), ("above", param.high)):
                if bound is None:
                    continue
                bad = _just_outside(param, side)
                if param.type in ("float_pair", "int_list", "float_list"):
                    for slot in range(len(param.default)):
                        value = list(param.default)
                        value[slot] = bad
                        cases.append(OutOfRange(entry, param, f"{side}[{slot}]", type(param.default)(value)))
                else:
                    cases.append(OutOfRange(entry, param, side, bad))
    return cases


@pytest.mark.parametrize("case", _out_of_range_cases(), ids=lambda case: case.id)
def test_out_of_range_hyperparameter_is_refused_by_name(case: OutOfRange) -> None:
    with pytest.raises(ValueError):  # the case really is outside the declaration
        case.param.check(case.value)
    driver = DRIVERS[case.entry.style]
    variables = driver.variables([np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match=rf"\b{case.param.name}\b"):
        _create(case.entry, {case.param.name: case.value}, variables)
    # The constructor enforces the same declaration: from_config and load paths skip the catalogue.
    arg = _arg(case.entry, case.param.name)
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        driver.construct(case.entry.cls, {arg: case.value})


# --- 3. config and state round trips ----------------------------------------------------------------


def _same_hyperparameter(given: Any, stored: Any) -> bool:
    """Equal, up to the float32 a TensorFlow optimizer keeps a hyperparameter in."""
    if isinstance(given, tuple | list):
        return isinstance(stored, tuple | list) and all(
            _same_hyperparameter(a, b) for a, b in zip(given, stored, strict=True)
        )
    if isinstance(given, bool) or isinstance(stored, bool):
        return given is stored
    return bool(np.float32(given) == np.float32(stored))


@pytest.mark.parametrize("entry", ENTRIES, ids=_id)
def test_config_and_state_round_trip(entry: Entry, tmp_path: Path) -> None:
    driver = DRIVERS[entry.style]
    hyperparams = _hyperparams(entry)
    rng = np.random.default_rng(1)
    shapes = [(3, 2), (2,)]
    variables = driver.variables([rng.normal(size=shape).astype(np.float32) for shape in shapes])
    optimizer = _create(entry, hyperparams, variables)

    def gradients() -> list[np.ndarray]:
        return [rng.normal(size=shape).astype(np.float32) for shape in shapes]

    for _ in range(STATE_STEPS):
        driver.step(optimizer, variables, gradients())

    # Every catalogue hyperparameter reaches the optimizer and comes back from its config.
    config = ROUND_TRIPS[entry.style].config(optimizer)
    for name, param in entry.params.items():
        given = hyperparams.get(name, param.default)
        arg = _arg(entry, name)
        assert arg in config, f"{arg!r} missing from the config"
        assert _same_hyperparameter(given, config[arg]), f"{arg}: gave {given!r}, config has {config[arg]!r}"

    fresh, fresh_variables = ROUND_TRIPS[entry.style].state(
        entry, hyperparams, optimizer, variables, tmp_path
    )
    grads = gradients()
    driver.step(optimizer, variables, grads)
    driver.step(fresh, fresh_variables, grads)
    for index, (straight, reloaded) in enumerate(
        zip(driver.values(variables), driver.values(fresh_variables), strict=True)
    ):
        assert np.array_equal(straight, reloaded), f"variable {index} differs on the step after reload"


# --- 4. sparse gradients ----------------------------------------------------------------------------

TABLE_SHAPE = (10, 3)
TOUCHED = [1, 1, 4]  # row 1 twice, as a batch repeating a token gives


@pytest.mark.parametrize("entry", SPARSE_ENTRIES, ids=_id)
def test_sparse_step_changes_only_the_touched_rows(entry: Entry) -> None:
    driver = DRIVERS[entry.style]
    hyperparams = _hyperparams(entry)
    if "weight_decay" in entry.params:  # a lazy update must not decay the untouched rows either
        hyperparams["weight_decay"] = 0.1
    rng = np.random.default_rng(2)
    variables = driver.variables([rng.normal(size=TABLE_SHAPE).astype(np.float32)])
    optimizer = _create(entry, hyperparams, variables)
    before = driver.values(variables)[0]

    values = rng.normal(size=(len(TOUCHED), TABLE_SHAPE[1])).astype(np.float32)
    driver.step(optimizer, variables, [SparseRows(TOUCHED, values, TABLE_SHAPE)])

    after = driver.values(variables)[0]
    changed = sorted(int(row) for row in np.flatnonzero((after != before).any(axis=1)))
    assert changed == sorted(set(TOUCHED))
