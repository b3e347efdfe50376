"""Generic tests written once and fanned out over every (name, style) entry of the catalogue.

The idea of torch's `common_optimizers.py` (`OptimizerInfo`, `optim_db`) across all three
styles: the table is `load_registry()` with torch, Keras 3 and legacy tf.keras loaded in
this one process, so an optimizer registered in any style (built-in, entry point or
OPTLAB_PLUGIN_DIRS plugin) is covered without editing this file. What differs between
styles lives in one small `StyleDriver` per style, never in per-optimizer code; the
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


# --- gradients both frameworks understand -----------------------------------------------------------


@dataclass(frozen=True)
class SparseRows:
    """A row-sparse gradient, as an Embedding produces it: repeated rows are summed."""

    rows: list[int]
    values: np.ndarray
    shape: tuple[int, ...]


Gradient = np.ndarray | SparseRows


def _torch_gradient(grad: Gradient) -> torch.Tensor:
    if isinstance(grad, SparseRows):
        indices = torch.tensor([grad.rows], dtype=torch.int64)
        values = torch.from_numpy(grad.values.copy())
        return torch.sparse_coo_tensor(indices, values, grad.shape, check_invariants=True)
    return torch.from_numpy(grad.copy())


def _tf_gradient(grad: Gradient) -> Any:
    if isinstance(grad, SparseRows):
        return tf.IndexedSlices(
            tf.constant(grad.values), tf.constant(grad.rows, dtype=tf.int64), tf.constant(grad.shape)
        )
    return tf.constant(grad)


# --- one adapter per style --------------------------------------------------------------------------


@dataclass(frozen=True)
class StyleDriver:
    """How to drive one style; everything else in this module is written once for all styles.

    `config_roundtrip` checks the style's own serialization and returns the optimizer's
    hyperparameters by constructor argument name. `state_roundtrip` saves the state of an
    optimizer that has taken steps, loads it into a fresh optimizer over fresh variables,
    asserts nothing was lost, and returns the two.
    """

    make_variables: Callable[[Sequence[np.ndarray]], list[Any]]
    create: Callable[[Entry, Mapping[str, Any], list[Any]], Any]  # through the catalogue
    construct: Callable[[type, Mapping[str, Any], list[Any]], Any]  # the class itself, as from_config
    step: Callable[[Any, list[Any], Sequence[Gradient]], None]
    values: Callable[[list[Any]], list[np.ndarray]]
    config_roundtrip: Callable[[Any], dict[str, Any]]
    state_roundtrip: Callable[[Entry, Mapping[str, Any], Any, list[Any], Path], tuple[Any, list[Any]]]


# torch


def _torch_variables(values: Sequence[np.ndarray]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in values]


def _torch_step(optimizer: torch.optim.Optimizer, variables: list[Any], grads: Sequence[Gradient]) -> None:
    for param, grad in zip(variables, grads, strict=True):
        param.grad = _torch_gradient(grad)
    optimizer.step()


def _torch_values(variables: list[Any]) -> list[np.ndarray]:
    return [param.detach().numpy().copy() for param in variables]


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
    loaded = _torch_saved(optimizer.state_dict())
    fresh_variables = _torch_variables(_torch_values(variables))
    fresh = entry.create(hyperparams, model_params=fresh_variables)
    fresh.load_state_dict(loaded)
    _assert_same_torch_state(optimizer.state_dict(), fresh.state_dict())
    return fresh, fresh_variables


# Keras 3 and legacy tf.keras


def _tf_values(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(variable.numpy()) for variable in variables]


def _keras_step(optimizer: Any, variables: list[Any], grads: Sequence[Gradient]) -> None:
    optimizer.apply([_tf_gradient(grad) for grad in grads], variables)


def _legacy_step(optimizer: Any, variables: list[Any], grads: Sequence[Gradient]) -> None:
    optimizer.apply_gradients(zip([_tf_gradient(grad) for grad in grads], variables, strict=True))


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


def _checkpoint_roundtrip(
    make_variables: Callable[[Sequence[np.ndarray]], list[Any]],
    create_state: Callable[[Any, list[Any]], None],
) -> Callable[..., tuple[Any, list[Any]]]:
    def roundtrip(
        entry: Entry, hyperparams: Mapping[str, Any], optimizer: Any, variables: list[Any], tmp_path: Path
    ) -> tuple[Any, list[Any]]:
        written = tf.train.Checkpoint(optimizer=optimizer, variables=variables).write(str(tmp_path / "ckpt"))
        # Fresh variables hold zeros: their values must come back from the checkpoint too.
        fresh_variables = make_variables([np.zeros_like(value) for value in _tf_values(variables)])
        fresh = entry.create(hyperparams)
        create_state(fresh, fresh_variables)  # variables created first, then filled by `read`
        tf.train.Checkpoint(optimizer=fresh, variables=fresh_variables).read(written).assert_consumed()

        assert int(fresh.iterations.numpy()) == int(optimizer.iterations.numpy()) == STATE_STEPS
        for index, (saved, loaded) in enumerate(
            zip(_tf_values(variables), _tf_values(fresh_variables), strict=True)
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


def _keras_variables(values: Sequence[np.ndarray]) -> list[Any]:
    return [keras.Variable(value.copy()) for value in values]


def _legacy_variables(values: Sequence[np.ndarray]) -> list[Any]:
    return [tf.Variable(value.copy()) for value in values]


def _keras_create_state(optimizer: Any, variables: list[Any]) -> None:
    optimizer.build(variables)


def _legacy_create_state(optimizer: Any, variables: list[Any]) -> None:
    optimizer._create_all_weights(variables)  # the legacy API's only way to make slots up front


DRIVERS: dict[str, StyleDriver] = {
    "torch": StyleDriver(
        make_variables=_torch_variables,
        create=lambda entry, hyperparams, variables: entry.create(hyperparams, model_params=variables),
        construct=lambda cls, kwargs, variables: cls(variables, **kwargs),
        step=_torch_step,
        values=_torch_values,
        config_roundtrip=_torch_config,
        state_roundtrip=_torch_state_roundtrip,
    ),
    "keras": StyleDriver(
        make_variables=_keras_variables,
        create=lambda entry, hyperparams, variables: entry.create(hyperparams),
        construct=lambda cls, kwargs, variables: cls(**kwargs),
        step=_keras_step,
        values=_tf_values,
        config_roundtrip=_config_roundtrip(keras.optimizers),
        state_roundtrip=_checkpoint_roundtrip(_keras_variables, _keras_create_state),
    ),
    "tf_legacy": StyleDriver(
        make_variables=_legacy_variables,
        create=lambda entry, hyperparams, variables: entry.create(hyperparams),
        construct=lambda cls, kwargs, variables: cls(**kwargs),
        step=_legacy_step,
        values=_tf_values,
        config_roundtrip=_config_roundtrip(tf_keras.optimizers),
        state_roundtrip=_checkpoint_roundtrip(_legacy_variables, _legacy_create_state),
    ),
}


def test_table_loads_all_styles_cleanly() -> None:
    assert REGISTRY.errors == [], "an optimizer on the path failed to load"
    assert set(DRIVERS) == set(STYLES), "a style without a driver"
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
    variables = driver.make_variables(problem.initial())
    optimizer = driver.create(entry, _hyperparams(entry), variables)
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
    variables = driver.make_variables([np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match=rf"\b{case.param.name}\b"):
        driver.create(case.entry, {case.param.name: case.value}, variables)
    # The constructor enforces the same declaration: from_config and load paths skip the catalogue.
    arg = _arg(case.entry, case.param.name)
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        driver.construct(case.entry.cls, {arg: case.value}, variables)


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
    variables = driver.make_variables([rng.normal(size=shape).astype(np.float32) for shape in shapes])
    optimizer = driver.create(entry, hyperparams, variables)

    def gradients() -> list[np.ndarray]:
        return [rng.normal(size=shape).astype(np.float32) for shape in shapes]

    for _ in range(STATE_STEPS):
        driver.step(optimizer, variables, gradients())

    # Every catalogue hyperparameter reaches the optimizer and comes back from its config.
    config = driver.config_roundtrip(optimizer)
    for name, param in entry.params.items():
        given = hyperparams.get(name, param.default)
        arg = _arg(entry, name)
        assert arg in config, f"{arg!r} missing from the config"
        assert _same_hyperparameter(given, config[arg]), f"{arg}: gave {given!r}, config has {config[arg]!r}"

    fresh, fresh_variables = driver.state_roundtrip(entry, hyperparams, optimizer, variables, tmp_path)
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
    variables = driver.make_variables([rng.normal(size=TABLE_SHAPE).astype(np.float32)])
    optimizer = driver.create(entry, hyperparams, variables)
    before = driver.values(variables)[0]

    values = rng.normal(size=(len(TOUCHED), TABLE_SHAPE[1])).astype(np.float32)
    driver.step(optimizer, variables, [SparseRows(TOUCHED, values, TABLE_SHAPE)])

    after = driver.values(variables)[0]
    changed = sorted(int(row) for row in np.flatnonzero((after != before).any(axis=1)))
    assert changed == sorted(set(TOUCHED))
