"""AdamW by hand, in torch.optim.AdamW's convention (https://arxiv.org/abs/1711.05101):
p <- p * (1 - lr * wd);  m, v <- EMAs of g and g^2;
p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from optimizers.torch import adamw_ref as module
from optimizers.torch.adamw_ref import AdamWRef

DOUBLE = torch.float64
CLOSE = {"rtol": 1e-12, "atol": 1e-15}


def _param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=DOUBLE))


def _tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=DOUBLE)


def test_hand_computed_steps() -> None:
    """lr=0.1, beta_1=0.9, beta_2=0.999, a large epsilon=0.1 so that it shows, weight_decay=0.5."""
    param = _param([1.0, -2.0])
    optimizer = AdamWRef([param], lr=0.1, beta_1=0.9, beta_2=0.999, epsilon=0.1, weight_decay=0.5)

    # Step 1, g = [0.5, -1]: the bias-corrected moments are g and g^2, so the step is
    # lr * g / (|g| + eps) after decaying p by 1 - lr * wd = 0.95.
    param.grad = _tensor([0.5, -1.0])
    optimizer.step()
    after_one = [0.95 - 0.1 * 0.5 / 0.6, -1.9 + 0.1 * 1.0 / 1.1]
    torch.testing.assert_close(param.detach(), _tensor(after_one), **CLOSE)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], _tensor([0.05, -0.1]), **CLOSE)
    torch.testing.assert_close(optimizer.state[param]["exp_avg_sq"], _tensor([0.00025, 0.001]), **CLOSE)
    assert optimizer.state[param]["step"] == 1

    # Step 2, g = [0.5, 0]: m = [0.095, -0.09], v = [0.00049975, 0.000999];
    # 1 - b1^2 = 0.19, 1 - b2^2 = 0.001999, so v-hat = [0.25, 0.999 / 1.999].
    param.grad = _tensor([0.5, 0.0])
    optimizer.step()
    after_two = [
        after_one[0] * 0.95 - 0.1 / 0.19 * 0.095 / (0.5 + 0.1),
        after_one[1] * 0.95 + 0.1 / 0.19 * 0.09 / (math.sqrt(0.999 / 1.999) + 0.1),
    ]
    torch.testing.assert_close(param.detach(), _tensor(after_two), **CLOSE)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], _tensor([0.095, -0.09]), **CLOSE)
    torch.testing.assert_close(optimizer.state[param]["exp_avg_sq"], _tensor([0.00049975, 0.000999]), **CLOSE)
    assert optimizer.state[param]["step"] == 2


# Computed with plain Python floats from the update rule, for loss = sum(p ** 2) / 2 (so g = p),
# from p0 = [1, -2, 0.25, 3] with lr=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-8.
GOLDEN: dict[float, list[list[float]]] = {
    0.0: [
        [0.900000001, -1.9000000005, 0.15000000399999983, 2.9000000003333333],
        [0.8004122297123382, -1.8001664866210927, 0.05425099068645388, 2.800102707750552],
        [0.701586274504415, -1.7006233928121137, -0.030208319266330552, 2.7003815239578244],
        [0.603939062682108, -1.6015048963195329, -0.09313811840327843, 2.6009135317361514],
        [0.507963661927221, -1.5029557825929858, -0.1276039284021469, 2.50177945708264],
    ],
    0.1: [
        [0.890000001, -1.8800000005, 0.14750000399999982, 2.870000000333333],
        [0.7815718569541611, -1.7614089510885826, 0.050495147121814576, 2.741439941242406],
        [0.6751012231892008, -1.6443686843220089, -0.03371780537854877, 2.614405617785441],
        [0.5710475992066123, -1.5290327122896108, -0.09488709706073559, 2.4889870944342856],
        [0.46995265961880694, -1.4155664812286117, -0.12679264556914965, 2.3652785740874225],
    ],
}


# The three kernels: per-tensor, multi-tensor, torch's fused one (opt-in).
KERNELS = [{"foreach": False}, {"foreach": True}, {"fused": True}]
KERNEL_IDS = ["per-tensor", "multi-tensor", "fused"]


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("weight_decay", sorted(GOLDEN))
def test_golden_values_for_five_steps(kernel: dict[str, bool], weight_decay: float) -> None:
    param = _param([1.0, -2.0, 0.25, 3.0])
    optimizer = AdamWRef(
        [param], lr=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=weight_decay, **kernel
    )
    for expected in GOLDEN[weight_decay]:
        optimizer.zero_grad()
        (param**2).sum().div(2).backward()
        optimizer.step()
        torch.testing.assert_close(param.detach(), _tensor(expected), **CLOSE)


SHAPES = [(3,), (4, 5), (2, 3, 2), ()]


@pytest.mark.parametrize("kernel", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize(
    "hyper",
    [
        {"lr": 1e-2, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8, "weight_decay": 1e-2},
        {"lr": 3e-2, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-3, "weight_decay": 0.2},
        {"lr": 1e-3, "beta_1": 0.0, "beta_2": 0.5, "epsilon": 1e-6, "weight_decay": 0.0},
    ],
    ids=["defaults", "strong-decay", "no-momentum"],
)
def test_matches_torch_adamw_after_50_steps(kernel: dict[str, bool], hyper: dict[str, float]) -> None:
    """Each kernel against torch's of the same kind (for-loop, foreach, fused)."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in SHAPES]
    ours = [torch.nn.Parameter(tensor.clone()) for tensor in start]
    theirs = [torch.nn.Parameter(tensor.clone()) for tensor in start]
    optimizer = AdamWRef(ours, **kernel, **hyper)
    reference = torch.optim.AdamW(
        theirs,
        lr=hyper["lr"],
        betas=(hyper["beta_1"], hyper["beta_2"]),
        eps=hyper["epsilon"],
        weight_decay=hyper["weight_decay"],
        **kernel,
    )
    for _ in range(50):
        for mine, other in zip(ours, theirs, strict=True):
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, other.grad = grad, grad.clone()
        optimizer.step()
        reference.step()
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.detach(), other.detach(), rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                optimizer.state[mine][key], reference.state[other][key], rtol=0, atol=1e-6
            )
        assert optimizer.state[mine]["step"] == int(reference.state[other]["step"]) == 50


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
    monkeypatch.setattr(module, "_multi_tensor_adamw_ref", lambda *a, **k: called.append("multi"))
    monkeypatch.setattr(module, "_single_tensor_adamw_ref", lambda *a, **k: called.append("single"))
    param = _param([1.0] * size)
    param.grad = torch.ones_like(param)
    AdamWRef([param], foreach=foreach).step()
    assert called == [kernel]


def test_defaults_are_torch_adamws() -> None:
    optimizer = AdamWRef([_param([1.0])])
    assert optimizer.defaults == {
        "lr": 1e-3,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-8,
        "weight_decay": 1e-2,
        "foreach": None,
        "fused": False,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be a number > 0; received 0.0"),
        ({"lr": float("nan")}, "lr must be a number > 0; received NaN"),
        ({"beta_1": 1.0}, "beta_1 must be a number in [0, 1); received 1.0"),
        ({"beta_2": -0.5}, "beta_2 must be a number in [0, 1); received -0.5"),
        ({"beta_2": 1.0}, "beta_2 must be a number in [0, 1); received 1.0"),
        ({"epsilon": 0.0}, "epsilon must be a number > 0; received 0.0"),
        ({"weight_decay": -1e-2}, "weight_decay must be a number >= 0; received -0.01"),
        ({"epsilon": None}, "epsilon must be a number > 0; received null"),
    ],
)
def test_constructor_rejects_out_of_range_naming_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        AdamWRef([_param([1.0])], **kwargs)
    assert str(caught.value) == message
