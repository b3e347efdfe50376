"""Broken on purpose: momentum buffers live in a Python dict attribute, so state_dict() does not save them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# resume_exact (save, reload in a fresh process, continue) catches the same fault.
EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact"})


class DictStateMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta})
        self.momenta: dict[torch.Tensor, torch.Tensor] = {}

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
                if p not in self.momenta:
                    self.momenta[p] = torch.zeros_like(p)
                momentum = self.momenta[p]
                momentum.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(momentum, alpha=-group["lr"])
        return loss
