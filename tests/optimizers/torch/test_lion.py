"""Lion (https://arxiv.org/abs/2302.06675):
c = b1 * m + (1 - b1) * g;  p <- p * (1 - lr * wd) - lr * sign(c);  m <- b2 * m + (1 - b2) * g."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optimizers.torch import lion as module
from optimizers.torch.lion import Lion

DOUBLE = torch.float64
EXACT = {"rtol": 1e-14, "atol": 1e-15}


def _param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=DOUBLE))


def _tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=DOUBLE)


@pytest.mark.parametrize(
    ("weight_decay", "after_one", "after_two"),
    [
        # Step 1, m = 0: c = 0.1 * g1, so sign(c) = sign(g1) = [1, -1, 1, 0]; p1 = p0 - 0.1 * sign(c).
        # Step 2: c = 0.9 * m1 + 0.1 * g2 = [0.0045 - 0.001, -0.009 + 0.05, 0.018, 0] -> signs [1, 1, 1, 0]:
        # the momentum outvotes a small gradient (first) and moves a coordinate with none (third).
        (0.0, [0.9, -1.9, 0.4, 3.0], [0.8, -2.0, 0.3, 3.0]),
        # p is first scaled by 1 - lr * wd = 0.95: [0.95, -1.9, 0.475, 2.85] - 0.1 * [1, -1, 1, 0],
        # then [0.85, -1.8, 0.375, 2.85] * 0.95 - 0.1 * [1, 1, 1, 0].
        (0.5, [0.85, -1.8, 0.375, 2.85], [0.7075, -1.81, 0.25625, 2.7075]),
    ],
)
def test_hand_computed_steps(weight_decay: float, after_one: list[float], after_two: list[float]) -> None:
    param = _param([1.0, -2.0, 0.5, 3.0])
    optimizer = Lion([param], lr=0.1, beta_1=0.9, beta_2=0.99, weight_decay=weight_decay)
    gradients = ([0.5, -1.0, 2.0, 0.0], [-0.01, 0.5, 0.0, 0.0])
    # m1 = 0.01 * g1;  m2 = 0.99 * m1 + 0.01 * g2: the momentum ignores weight decay.
    momenta = ([0.005, -0.01, 0.02, 0.0], [0.00485, -0.0049, 0.0198, 0.0])
    for grad, expected, momentum in zip(gradients, (after_one, after_two), momenta, strict=True):
        param.grad = _tensor(grad)
        optimizer.step()
        torch.testing.assert_close(param.detach(), _tensor(expected), **EXACT)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], _tensor(momentum), **EXACT)


# Computed with plain Python floats from the update rule, for loss = sum(p ** 2) / 2 (so g = p),
# from p0 = [1, -2, 0.25, 3] with lr=0.1, beta_1=0.9, beta_2=0.99. The third coordinate crosses
# zero and is brought back by the sign of the interpolated momentum.
GOLDEN: dict[float, list[list[float]]] = {
    0.0: [
        [0.9, -1.9, 0.15, 2.9],
        [0.8, -1.7999999999999998, 0.04999999999999999, 2.8],
        [0.7000000000000001, -1.6999999999999997, -0.05000000000000002, 2.6999999999999997],
        [0.6000000000000001, -1.5999999999999996, 0.04999999999999999, 2.5999999999999996],
        [0.5000000000000001, -1.4999999999999996, -0.05000000000000002, 2.4999999999999996],
    ],
    0.1: [
        [0.89, -1.88, 0.1475, 2.8699999999999997],
        [0.7811, -1.7611999999999999, 0.04602499999999998, 2.7412999999999994],
        [0.673289, -1.6435879999999998, -0.054435250000000025, 2.613886999999999],
        [0.5665561100000001, -1.5271521199999998, 0.04610910249999998, 2.487748129999999],
        [0.46089054890000003, -1.4118805987999996, -0.054351988525000026, 2.362870648699999],
    ],
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", sorted(GOLDEN))
def test_golden_values_for_five_steps(foreach: bool, weight_decay: float) -> None:
    param = _param([1.0, -2.0, 0.25, 3.0])
    optimizer = Lion([param], lr=0.1, beta_1=0.9, beta_2=0.99, weight_decay=weight_decay, foreach=foreach)
    for expected in GOLDEN[weight_decay]:
        optimizer.zero_grad()
        (param**2).sum().div(2).backward()
        optimizer.step()
        torch.testing.assert_close(param.detach(), _tensor(expected), rtol=1e-13, atol=1e-15)


def test_sparse_duplicate_rows_are_summed_before_the_sign() -> None:
    """Row 1 is looked up twice with gradients +0.3 and -0.5: one step along -sign(-0.2)."""
    embedding = torch.nn.Embedding(3, 1, sparse=True, dtype=DOUBLE)
    with torch.no_grad():
        embedding.weight.copy_(_tensor([[1.0], [2.0], [3.0]]))
    optimizer = Lion(embedding.parameters(), lr=0.1, weight_decay=0.5)
    (embedding(torch.tensor([1, 1])).squeeze(1) * _tensor([0.3, -0.5])).sum().backward()
    optimizer.step()
    # Row 1: 2 * (1 - 0.05) + 0.1; rows 0 and 2 untouched, not even weight-decayed.
    torch.testing.assert_close(
        embedding.weight.detach(), _tensor([[1.0], [2.0 * 0.95 + 0.1], [3.0]]), **EXACT
    )
    momentum = optimizer.state[embedding.weight]["exp_avg"]
    torch.testing.assert_close(momentum, _tensor([[0.0], [0.01 * -0.2], [0.0]]), **EXACT)


# None on CPU: the multi-tensor kernel for small tensors, the per-tensor one for large ones
# (optimizers.torch.foreach_default, measured in benchmarks/optimizer_step.py).
@pytest.mark.parametrize(
    ("foreach", "size", "kernel"),
    [(True, 1, "multi"), (False, 1, "single"), (None, 1, "multi"), (None, 40_000, "single")],
)
def test_foreach_flag_picks_the_kernel(
    foreach: bool | None, size: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    called: list[str] = []
    monkeypatch.setattr(module, "_multi_tensor_lion", lambda *a, **k: called.append("multi"))
    monkeypatch.setattr(module, "_single_tensor_lion", lambda *a, **k: called.append("single"))
    param = _param([1.0] * size)
    param.grad = torch.ones_like(param)
    Lion([param], foreach=foreach).step()
    assert called == [kernel]


def test_defaults_are_the_papers() -> None:
    optimizer = Lion([_param([1.0])])
    assert optimizer.defaults == {
        "lr": 1e-4,
        "beta_1": 0.9,
        "beta_2": 0.99,
        "weight_decay": 0.0,
        "foreach": None,
        "fused": False,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be a number > 0; received 0.0"),
        ({"lr": -1e-4}, "lr must be a number > 0; received -0.0001"),
        ({"lr": float("inf")}, "lr must be a number > 0; received Infinity"),
        ({"beta_1": 1.0}, "beta_1 must be a number in [0, 1); received 1.0"),
        ({"beta_1": -0.1}, "beta_1 must be a number in [0, 1); received -0.1"),
        ({"beta_2": 1.5}, "beta_2 must be a number in [0, 1); received 1.5"),
        ({"weight_decay": -0.01}, "weight_decay must be a number >= 0; received -0.01"),
        ({"beta_2": "0.9"}, 'beta_2 must be a number in [0, 1); received "0.9"'),
    ],
)
def test_constructor_rejects_out_of_range_naming_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        Lion([_param([1.0])], **kwargs)
    assert str(caught.value) == message
