"""Broken on purpose: meant to exempt biases from weight decay, it skips their update altogether."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"dense_step"})


class NoBiasUpdate(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dim() < 2:  # no weight decay on biases... nor any update
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
