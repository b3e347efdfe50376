"""Generic tests written once and fanned out over every entry of the catalogue.

The idea of torch's `common_optimizers.py` (`OptimizerInfo`, `optim_db`): the table is
`load_registry()` itself, so an optimizer registered anywhere (built-in, entry point,
plugin folder named in OPTLAB_PLUGIN_DIRS) is covered without touching this file.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from optimizers.hyperparams import Param
from optimizers.registry import Entry, load_registry

REGISTRY = load_registry(styles=("torch",))
NAMES = REGISTRY.names()

# The only per-entry knowledge: a learning rate that solves the toy problem in 100 steps,
# where the default (torch's 1e-3) is meant for networks, not for it.
LR_OVERRIDES: dict[str, float] = {"sgd": 0.05, "adam": 0.05, "adamw": 0.05}


def _entry(name: str) -> Entry:
    entry = REGISTRY.get(name)
    if entry.framework != "torch":
        pytest.skip(f"{name}: no {entry.framework} harness in this table yet")
    return entry


def _hyperparams(name: str) -> dict[str, Any]:
    return {"lr": LR_OVERRIDES[name]} if name in LR_OVERRIDES else {}


class LeastSquares:
    """mean((A w + c - b)^2), well conditioned: [A, 1] has condition number about 1.8."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.a = torch.randn(32, 4, generator=generator)
        self.b = self.a @ torch.randn(4, generator=generator) + 0.5

    def params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(1))]

    def loss(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        weight, bias = params
        return ((self.a @ weight + bias - self.b) ** 2).mean()

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> float:
        optimizer.zero_grad()
        loss = self.loss(params)
        loss.backward()
        optimizer.step()
        return loss.item()


def test_table_loads_cleanly() -> None:
    assert REGISTRY.errors == [], "a plugin on the path failed to load"
    assert {"ema_momentum", "sgd", "adam", "adamw"} <= set(NAMES)
    assert all(name in REGISTRY.entries for name in LR_OVERRIDES), "an override names no entry"


@pytest.mark.parametrize("name", NAMES)
def test_defaults_are_valid(name: str) -> None:
    entry = _entry(name)
    for param in entry.params.values():
        assert param.check(param.default) == param.default, param.name


@pytest.mark.parametrize("name", NAMES)
def test_loss_goes_down_on_least_squares(name: str) -> None:
    _entry(name)
    problem = LeastSquares()
    params = problem.params()
    optimizer = REGISTRY.build(name, params, _hyperparams(name))
    first = problem.loss(params).item()
    for _ in range(100):
        problem.step(optimizer, params)
    last = problem.loss(params).item()
    assert math.isfinite(last)
    assert last < 0.5 * first, f"{name}: loss {first:.4g} -> {last:.4g} in 100 steps"


def _assert_same_state(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for index, state in left["state"].items():
        other = right["state"][index]
        assert state.keys() == other.keys()
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key]), f"state[{index}][{key!r}]"
                assert value.dtype == other[key].dtype
            else:
                assert value == other[key], f"state[{index}][{key!r}]"


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_is_bitwise(name: str) -> None:
    _entry(name)
    problem = LeastSquares()
    params = problem.params()
    optimizer = REGISTRY.build(name, params, _hyperparams(name))
    for _ in range(5):
        problem.step(optimizer, params)

    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    fresh_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    fresh = REGISTRY.build(name, fresh_params, _hyperparams(name))
    fresh.load_state_dict(loaded)
    _assert_same_state(optimizer.state_dict(), fresh.state_dict())

    problem.step(optimizer, params)
    problem.step(fresh, fresh_params)
    for original, reloaded in zip(params, fresh_params, strict=True):
        assert torch.equal(original.detach(), reloaded.detach())
    _assert_same_state(optimizer.state_dict(), fresh.state_dict())


# --- out-of-range hyperparameters -----------------------------------------------------------------------


@dataclass(frozen=True)
class OutOfRange:
    entry: str
    param: Param
    where: str  # "below" or "above", with "[i]" for one number of a pair
    value: Any

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.param.name}-{self.where}"


def _just_outside(param: Param, side: str) -> float | int:
    """The nearest easy value outside the bound: the bound itself when it is exclusive."""
    if side == "below":
        assert param.low is not None
        if param.type == "int":
            return math.floor(param.low) if not param.low_inclusive else math.ceil(param.low) - 1
        return float(param.low) if not param.low_inclusive else param.low - 1.0
    assert param.high is not None
    if param.type == "int":
        return math.ceil(param.high) if not param.high_inclusive else math.floor(param.high) + 1
    return float(param.high) if not param.high_inclusive else param.high + 1.0


def _out_of_range_cases() -> list[OutOfRange]:
    cases = []
    for name in NAMES:
        for param in REGISTRY.get(name, "torch").params.values():
            sides = [
                side for side, bound in (("below", param.low), ("above", param.high)) if bound is not None
            ]
            for side in sides:
                bad = _just_outside(param, side)
                if param.type != "float_pair":
                    cases.append(OutOfRange(name, param, side, bad))
                    continue
                for slot in (0, 1):
                    pair = list(param.default)
                    pair[slot] = bad
                    cases.append(OutOfRange(name, param, f"{side}[{slot}]", tuple(pair)))
    return cases


OUT_OF_RANGE = _out_of_range_cases()


def _constructor_params() -> list[Any]:
    return [pytest.param(case, id=case.id) for case in OUT_OF_RANGE]


@pytest.mark.parametrize("case", _constructor_params())
def test_constructor_rejects_out_of_range_naming_it(case: OutOfRange) -> None:
    entry = _entry(case.entry)
    with pytest.raises(ValueError):  # the case really is outside the declaration
        case.param.check(case.value)
    with pytest.raises(ValueError, match=rf"\b{case.param.name}\b"):
        entry.cls([torch.nn.Parameter(torch.zeros(2))], **{case.param.name: case.value})


@pytest.mark.parametrize("case", OUT_OF_RANGE, ids=lambda case: case.id)
def test_build_rejects_out_of_range_saying_what_is_allowed(case: OutOfRange) -> None:
    _entry(case.entry)
    with pytest.raises(ValueError) as caught:
        REGISTRY.build(case.entry, [torch.nn.Parameter(torch.zeros(2))], {case.param.name: case.value})
    message = str(caught.value)
    assert message.startswith(f"{case.param.name} must be {case.param.allowed()}; received ")
