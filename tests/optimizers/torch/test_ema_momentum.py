"""EMA momentum: m <- beta * m + (1 - beta) * g;  p <- p * (1 - lr * wd);  p <- p - lr * m."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from optimizers.torch import ema_momentum as module
from optimizers.torch.ema_momentum import EmaMomentum

DOUBLE = torch.float64


def _param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=DOUBLE))


@pytest.mark.parametrize(
    ("weight_decay", "after_one", "after_two"),
    [
        # m1 = 0.1 * g = [0.05, 0.1];  p1 = p0 - 0.1 * m1
        # m2 = 0.9 * m1 + 0.1 * g = [0.095, 0.19];  p2 = p1 - 0.1 * m2
        (0.0, [0.995, -2.01], [0.9855, -2.029]),
        # p is first scaled by 1 - lr * wd = 0.95: [0.95, -1.9] - [0.005, 0.01]
        # then [0.945, -1.91] * 0.95 - [0.0095, 0.019]
        (0.5, [0.945, -1.91], [0.88825, -1.8335]),
    ],
)
def test_hand_computed_steps(weight_decay: float, after_one: list[float], after_two: list[float]) -> None:
    param = _param([1.0, -2.0])
    optimizer = EmaMomentum([param], lr=0.1, beta=0.9, weight_decay=weight_decay)
    for expected in (after_one, after_two):
        param.grad = torch.tensor([0.5, 1.0], dtype=DOUBLE)
        optimizer.step()
        torch.testing.assert_close(
            param.detach(), torch.tensor(expected, dtype=DOUBLE), rtol=1e-14, atol=1e-15
        )


def _golden(
    start: list[float], *, lr: float, beta: float, weight_decay: float, steps: int
) -> list[list[float]]:
    """The update rule in plain Python floats, for loss = sum(p ** 2) / 2 (so g = p)."""
    p = list(start)
    m = [0.0] * len(p)
    history = []
    for _ in range(steps):
        g = list(p)
        p = [x * (1 - lr * weight_decay) for x in p]
        m = [beta * mi + (1 - beta) * gi for mi, gi in zip(m, g, strict=True)]
        p = [x - lr * mi for x, mi in zip(p, m, strict=True)]
        history.append(p)
    return history


# The three kernels: per-tensor, multi-tensor, torch's fused one (opt-in).
KERNELS = [{"foreach": False}, {"foreach": True}, {"fused": True}]
KERNEL_IDS = ["per-tensor", "multi-tensor", "fused"]


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_golden_values_for_five_steps(kernel: dict[str, bool], weight_decay: float) -> None:
    start = [1.0, -2.0, 0.5, 3.0]
    hyper: dict[str, Any] = {"lr": 0.3, "beta": 0.8, "weight_decay": weight_decay}
    param = _param(start)
    optimizer = EmaMomentum([param], **kernel, **hyper)
    for expected in _golden(start, steps=5, **hyper):
        optimizer.zero_grad()
        loss = (param**2).sum() / 2
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(
            param.detach(), torch.tensor(expected, dtype=DOUBLE), rtol=1e-13, atol=1e-15
        )


SHAPES = [(3,), (4, 5), (2, 3, 2), ()]


def _train_kernel(foreach: bool, steps: int = 20) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = EmaMomentum(params, lr=0.05, beta=0.9, weight_decay=0.1, foreach=foreach)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    momenta = [optimizer.state[param]["momentum"] for param in params]
    return [param.detach() for param in params], momenta


def test_foreach_and_single_tensor_kernels_agree_bitwise() -> None:
    single_params, single_momenta = _train_kernel(foreach=False)
    multi_params, multi_momenta = _train_kernel(foreach=True)
    for single, multi in zip(single_params + single_momenta, multi_params + multi_momenta, strict=True):
        assert torch.equal(single, multi)


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
    monkeypatch.setattr(module, "_multi_tensor_ema_momentum", lambda *a, **k: called.append("multi"))
    monkeypatch.setattr(module, "_single_tensor_ema_momentum", lambda *a, **k: called.append("single"))
    param = _param([1.0] * size)
    param.grad = torch.ones_like(param)
    EmaMomentum([param], foreach=foreach).step()
    assert called == [kernel]


def test_params_without_grad_are_skipped_and_get_no_state() -> None:
    used, unused = _param([1.0, 2.0]), _param([3.0])
    optimizer = EmaMomentum([used, unused], lr=0.1, weight_decay=0.5)
    used.grad = torch.ones_like(used)
    optimizer.step()
    assert used in optimizer.state
    assert unused not in optimizer.state
    assert torch.equal(unused.detach(), torch.tensor([3.0], dtype=DOUBLE))  # not even weight-decayed


def test_step_without_any_grad_is_a_no_op() -> None:
    param = _param([1.0])
    optimizer = EmaMomentum([param])
    assert optimizer.step() is None
    assert len(optimizer.state) == 0
    assert param.item() == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be a number > 0; received 0.0"),
        ({"lr": -1e-3}, "lr must be a number > 0; received -0.001"),
        ({"beta": 1.0}, "beta must be a number in [0, 1); received 1.0"),
        ({"beta": -0.1}, "beta must be a number in [0, 1); received -0.1"),
        ({"weight_decay": -0.01}, "weight_decay must be a number >= 0; received -0.01"),
        ({"lr": float("nan")}, "lr must be a number > 0; received NaN"),
    ],
)
def test_constructor_rejects_out_of_range_naming_the_argument(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        EmaMomentum([_param([1.0])], **kwargs)
    assert str(caught.value) == message


def test_constructor_accepts_the_edges() -> None:
    optimizer = EmaMomentum([_param([1.0])], lr=1e-12, beta=0.0, weight_decay=0.0)
    assert optimizer.defaults == {
        "lr": 1e-12,
        "beta": 0.0,
        "weight_decay": 0.0,
        "foreach": None,
        "fused": False,
    }


def test_step_with_closure_returns_its_loss() -> None:
    param = _param([1.0, -1.0])
    optimizer = EmaMomentum([param], lr=0.1)
    losses: list[torch.Tensor] = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (param**2).sum()
        loss.backward()  # the closure runs with grad enabled although step() is no_grad
        losses.append(loss)
        return loss

    returned = optimizer.step(closure)
    assert returned is losses[0]
    assert param.grad is not None
    assert not torch.equal(param.detach(), torch.tensor([1.0, -1.0], dtype=DOUBLE))


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
def test_step_emits_no_warnings(kernel: dict[str, bool]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = torch.nn.Linear(3, 2)
        optimizer = EmaMomentum(model.parameters(), lr=0.1, weight_decay=0.01, **kernel)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).pow(2).mean().backward()
            optimizer.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_sparse_gradients_update_only_the_touched_rows(foreach: bool) -> None:
    """nn.Embedding(sparse=True): lazy updates; duplicate rows summed, other rows and state left alone."""
    embedding = torch.nn.Embedding(4, 2, sparse=True, dtype=DOUBLE)
    with torch.no_grad():
        embedding.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=DOUBLE))
    optimizer = EmaMomentum(embedding.parameters(), lr=0.1, beta=0.9, weight_decay=0.5, foreach=foreach)

    def momentum() -> torch.Tensor:
        return optimizer.state[embedding.weight]["momentum"]

    # Step 1 looks up row 1 twice and row 3 once, so their gradients are [2, 2] and [1, 1]:
    # m = 0.1 * g;  p <- p * 0.95 - 0.1 * m.
    embedding(torch.tensor([1, 3, 1])).sum().backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse
    optimizer.step()
    expected = [
        [1.0, 2.0],
        [3.0 * 0.95 - 0.02, 4.0 * 0.95 - 0.02],
        [5.0, 6.0],
        [7.0 * 0.95 - 0.01, 8.0 * 0.95 - 0.01],
    ]
    torch.testing.assert_close(
        embedding.weight.detach(), torch.tensor(expected, dtype=DOUBLE), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(
        momentum(),
        torch.tensor([[0.0, 0.0], [0.2, 0.2], [0.0, 0.0], [0.1, 0.1]], dtype=DOUBLE),
        rtol=1e-14,
        atol=0,
    )

    # Step 2 touches row 0 only: rows 1 and 3 keep their parameters and their momentum exactly.
    weight_before, momentum_before = embedding.weight.detach().clone(), momentum().clone()
    optimizer.zero_grad()
    embedding(torch.tensor([0])).sum().backward()
    optimizer.step()
    assert torch.equal(embedding.weight.detach()[1:], weight_before[1:])
    assert torch.equal(momentum()[1:], momentum_before[1:])
    expected[0] = [1.0 * 0.95 - 0.01, 2.0 * 0.95 - 0.01]
    torch.testing.assert_close(
        embedding.weight.detach(), torch.tensor(expected, dtype=DOUBLE), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(
        momentum(),
        torch.tensor([[0.1, 0.1], [0.2, 0.2], [0.0, 0.0], [0.1, 0.1]], dtype=DOUBLE),
        rtol=1e-14,
        atol=0,
    )
