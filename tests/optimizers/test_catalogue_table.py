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
# Lion's sign update moves every coordinate by lr, so it wants a smaller step than AdamW's.
LR_OVERRIDES: dict[str, float] = {"sgd": 0.05, "adam": 0.05, "adamw": 0.05, "adamw_ref": 0.05, "lion": 0.01}


def _entry(name: str) -> Entry:
    entry = REGISTRY.get(name, "torch")
    if entry.framework != "torch":
        pytest.skip(f"{name}: no {entry.framework} harness in this table yet")
    return entry


def _hyperparams(name: str) -> dict[str, Any]:
    return {"lr": LR_OVERRIDES[name]} if name in LR_OVERRIDES else {}


def _accepts_foreach(entry: Entry) -> bool:
    """Whether the constructor takes torch's `foreach` switch, which then lives in the param groups."""
    try:
        optimizer = entry.cls([torch.nn.Parameter(torch.zeros(1))], foreach=False)
    except TypeError:
        return False
    return "foreach" in optimizer.defaults


# Capability flags, as in torch's `OptimizerInfo`: from the catalogue, not written per optimizer.
FOREACH_NAMES = [name for name in NAMES if _accepts_foreach(REGISTRY.get(name, "torch"))]
SPARSE_NAMES = [name for name in NAMES if REGISTRY.get(name, "torch").supports_sparse]
# Each sparse entry under each of its kernels (None: the constructor has no `foreach`).
SPARSE_CASES = [
    pytest.param(name, foreach, id=f"{name}-foreach={foreach}")
    for name in SPARSE_NAMES
    for foreach in ((False, True) if name in FOREACH_NAMES else (None,))
]


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
    assert {"ema_momentum", "sgd", "adam", "adamw", "lion", "adamw_ref"} <= set(NAMES)
    assert {style for _, style in REGISTRY.entries} == {"torch"}
    assert set(LR_OVERRIDES) <= set(NAMES), "an override names no entry"
    # The capability flags found what the built-ins declare.
    assert {"ema_momentum", "lion", "adamw_ref"} <= set(SPARSE_NAMES)
    assert {"ema_momentum", "lion", "adamw_ref", "sgd", "adam", "adamw"} <= set(FOREACH_NAMES)


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


# --- foreach (multi-tensor) and per-tensor kernels ------------------------------------------------------

SHAPES = [(3,), (4, 5), (2, 3, 2), ()]


def _state_tensors(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [
        value
        for param in params
        for _, value in sorted(optimizer.state[param].items())
        if isinstance(value, torch.Tensor)
    ]


def _train_random_gradients(
    name: str, foreach: bool, steps: int = 20
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = REGISTRY.build(name, params, _hyperparams(name))
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [param.detach() for param in params], _state_tensors(optimizer, params)


@pytest.mark.parametrize("name", FOREACH_NAMES)
def test_foreach_and_per_tensor_kernels_agree_bitwise(name: str) -> None:
    _entry(name)
    single_params, single_state = _train_random_gradients(name, foreach=False)
    multi_params, multi_state = _train_random_gradients(name, foreach=True)
    for index, (single, multi) in enumerate(zip(single_params, multi_params, strict=True)):
        assert torch.equal(single, multi), f"param {index} (shape {SHAPES[index]})"
    assert len(single_state) == len(multi_state)
    for index, (single, multi) in enumerate(zip(single_state, multi_state, strict=True)):
        assert torch.equal(single, multi), f"state tensor {index}"


# --- sparse gradients (nn.Embedding(sparse=True)): lazy updates of the touched rows ---------------------

ROWS, DIM = 8, 3
FIRST_BATCH = [1, 3, 3, 6]  # row 3 twice: its two gradient rows are summed
SECOND_BATCH = [0, 3]
DOUBLE = torch.float64


def _sparse_hyperparams(name: str) -> dict[str, Any]:
    """With weight decay where there is one: lazy updates must not decay untouched rows either."""
    hyper = _hyperparams(name)
    if "weight_decay" in REGISTRY.get(name, "torch").params:
        hyper["weight_decay"] = 0.1
    return hyper


def _sparse_optimizer(name: str, params: Any, foreach: bool | None) -> torch.optim.Optimizer:
    optimizer = REGISTRY.build(name, params, _sparse_hyperparams(name))
    if foreach is not None:
        for group in optimizer.param_groups:
            group["foreach"] = foreach
    return optimizer


def _embedding(seed: int = 0) -> torch.nn.Embedding:
    embedding = torch.nn.Embedding(ROWS, DIM, sparse=True, dtype=DOUBLE)
    with torch.no_grad():
        embedding.weight.copy_(
            torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)
        )
    return embedding


def _sparse_backward(embedding: torch.nn.Embedding, rows: list[int], seed: int) -> torch.Tensor:
    """A random linear loss of the looked-up rows; returns the (uncoalesced) sparse gradient."""
    embedding.zero_grad()
    weights = torch.randn(len(rows), DIM, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)
    (embedding(torch.tensor(rows)) * weights).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse
    return grad


def _row_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of the state tensors kept per row of `param` (shaped like it)."""
    return {
        key: value.detach().clone()
        for key, value in optimizer.state[param].items()
        if isinstance(value, torch.Tensor) and value.shape == param.shape
    }


def _untouched(rows: list[int]) -> list[int]:
    return [row for row in range(ROWS) if row not in rows]


@pytest.mark.parametrize(("name", "foreach"), SPARSE_CASES)
def test_sparse_step_changes_only_the_touched_rows(name: str, foreach: bool | None) -> None:
    _entry(name)
    embedding = _embedding()
    weight = embedding.weight
    optimizer = _sparse_optimizer(name, embedding.parameters(), foreach)

    before = weight.detach().clone()
    assert not _sparse_backward(embedding, FIRST_BATCH, seed=1).is_coalesced()  # duplicates present
    optimizer.step()
    untouched = _untouched(FIRST_BATCH)
    assert torch.equal(weight.detach()[untouched], before[untouched]), "an untouched row moved"
    for row in sorted(set(FIRST_BATCH)):
        assert not torch.equal(weight.detach()[row], before[row]), f"touched row {row} did not move"

    # A second step touching other rows: rows 1 and 6 keep their parameters and their state
    # (no decay of their moments, no weight decay), exactly.
    before = weight.detach().clone()
    state_before = _row_state(optimizer, weight)
    _sparse_backward(embedding, SECOND_BATCH, seed=2)
    optimizer.step()
    untouched = _untouched(SECOND_BATCH)
    assert torch.equal(weight.detach()[untouched], before[untouched]), "an untouched row moved"
    state_after = _row_state(optimizer, weight)
    assert state_after.keys() == state_before.keys()
    for key, value in state_after.items():
        assert torch.equal(value[untouched], state_before[key][untouched]), (
            f"state {key!r} of an untouched row"
        )


@pytest.mark.parametrize(("name", "foreach"), SPARSE_CASES)
def test_sparse_step_from_zero_state_equals_a_dense_step_on_the_touched_rows(
    name: str, foreach: bool | None
) -> None:
    _entry(name)
    embedding = _embedding()
    dense = torch.nn.Parameter(embedding.weight.detach().clone())
    sparse_optimizer = _sparse_optimizer(name, embedding.parameters(), foreach)
    dense_optimizer = _sparse_optimizer(name, [dense], foreach)

    grad = _sparse_backward(embedding, FIRST_BATCH, seed=1)
    dense.grad = grad.to_dense()  # duplicate rows summed
    sparse_optimizer.step()
    dense_optimizer.step()

    touched = sorted(set(FIRST_BATCH))
    exact = {"rtol": 1e-13, "atol": 1e-15}  # the same float64 arithmetic, up to rounding
    torch.testing.assert_close(embedding.weight.detach()[touched], dense.detach()[touched], **exact)
    sparse_state = _row_state(sparse_optimizer, embedding.weight)
    dense_state = _row_state(dense_optimizer, dense)
    assert sparse_state.keys() == dense_state.keys()
    for key, value in sparse_state.items():
        torch.testing.assert_close(value[touched], dense_state[key][touched], **exact, msg=f"state {key!r}")


@pytest.mark.parametrize("name", [name for name in SPARSE_NAMES if name in FOREACH_NAMES])
def test_sparse_and_dense_params_in_one_group_agree_across_kernels(name: str) -> None:
    """An embedding beside a dense layer: foreach=True must still handle the sparse gradient."""
    _entry(name)

    def train(foreach: bool) -> list[torch.Tensor]:
        embedding = _embedding()
        linear = torch.nn.Linear(DIM, 2, dtype=DOUBLE)
        with torch.no_grad():
            linear.weight.fill_(0.5)
            linear.bias.fill_(-0.25)
        optimizer = _sparse_optimizer(name, [*embedding.parameters(), *linear.parameters()], foreach)
        generator = torch.Generator().manual_seed(3)
        for _ in range(20):
            optimizer.zero_grad()
            rows = torch.randint(0, ROWS, (5,), generator=generator)
            linear(embedding(rows)).pow(2).mean().backward()
            optimizer.step()
        params = [embedding.weight, linear.weight, linear.bias]
        return [param.detach() for param in params] + _state_tensors(optimizer, params)

    for index, (single, multi) in enumerate(zip(train(False), train(True), strict=True)):
        assert torch.equal(single, multi), f"tensor {index}"
