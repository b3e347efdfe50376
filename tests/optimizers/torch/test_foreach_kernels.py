"""The multi-tensor and per-tensor kernels of every torch built-in give the same training, on
model-like shapes on both sides of the measured default (`optimizers.torch.foreach_default`).

A table over the registry: every torch entry whose constructor takes `foreach` (ours and
torch's own), with weight decay on where the entry has it, so every line of each kernel runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optimizers.registry import load_registry
from optimizers.torch.foreach_default import CPU_FOREACH_MAX_MEAN_NUMEL, default_foreach

REGISTRY = load_registry(styles=("torch",))

# Model-like tensors: matrices, biases, a norm's scale, a 0-d scalar. `small` has a mean size below
# the CPU threshold (the default takes the multi-tensor kernel), `large` (one layer) above it.
SHAPES = {
    "small": [(16, 8), (16,), (8,), ()],
    "large": [(200, 400), (400,)],
}


def _accepts_foreach(name: str) -> bool:
    try:
        optimizer = REGISTRY.get(name, "torch").cls([torch.nn.Parameter(torch.zeros(1))], foreach=False)
    except TypeError:
        return False
    return "foreach" in optimizer.defaults


FOREACH_NAMES = [name for name in REGISTRY.names() if _accepts_foreach(name)]


def _hyperparams(name: str) -> dict[str, Any]:
    hyper: dict[str, Any] = {"lr": 0.01}
    if "weight_decay" in REGISTRY.get(name, "torch").params:
        hyper["weight_decay"] = 0.1
    return hyper


def _train(
    name: str, shapes: list[tuple[int, ...]], foreach: bool | None, steps: int = 3
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    optimizer = REGISTRY.build(name, params, _hyperparams(name))
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    state = [value for param in params for _, value in sorted(optimizer.state[param].items())]
    return [param.detach() for param in params] + [v for v in state if isinstance(v, torch.Tensor)]


def test_the_default_follows_the_measured_rule_on_cpu() -> None:
    small = [torch.zeros(shape) for shape in SHAPES["small"]]
    large = [torch.zeros(shape) for shape in SHAPES["large"]]
    assert sum(t.numel() for t in small) / len(small) <= CPU_FOREACH_MAX_MEAN_NUMEL
    assert sum(t.numel() for t in large) / len(large) > CPU_FOREACH_MAX_MEAN_NUMEL
    assert default_foreach(small) is True
    assert default_foreach(large) is False


@pytest.mark.parametrize("size", sorted(SHAPES))
@pytest.mark.parametrize("name", FOREACH_NAMES)
def test_multi_tensor_per_tensor_and_default_kernels_agree(name: str, size: str) -> None:
    per_tensor = _train(name, SHAPES[size], foreach=False)
    for foreach in (True, None):
        other = _train(name, SHAPES[size], foreach=foreach)
        assert len(other) == len(per_tensor)
        for index, (expected, got) in enumerate(zip(per_tensor, other, strict=True)):
            torch.testing.assert_close(
                got, expected, msg=lambda m, i=index, f=foreach: f"{name} foreach={f} tensor {i}: {m}"
            )
