"""Broken on purpose: the update's clamp sits behind `if not torch.compiler.is_compiling()`,
written to keep its host sync (`.item()`) out of compiled steps, so a compiled step takes
another step than an eager one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# graph_mode only warns for torch: a step that does not compile alike is a hazard, not wrong eagerly.
EXPECTED_FAILURES: frozenset[str] = frozenset()
EXPECTED_WARNINGS = frozenset({"graph_mode"})


class ClampedSGD(torch.optim.Optimizer):
    """SGD whose update is scaled down so that no element moves by more than `max_update`."""

    def __init__(self, params: Any, lr: float = 1e-2, max_update: float = 1e-3) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        if not max_update > 0:
            raise ValueError(f"max_update must be > 0; received {max_update}")
        super().__init__(params, {"lr": lr, "max_update": max_update})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ClampedSGD does not support sparse gradients")
                update = p.grad * group["lr"]
                if not torch.compiler.is_compiling():  # the bug: the clamp is math, not logging
                    largest = update.abs().max().item()
                    if largest > group["max_update"]:
                        update.mul_(group["max_update"] / largest)
                p.sub_(update)
        return loss
