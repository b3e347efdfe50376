"""Broken on purpose: uses the deprecated add_(Number, Tensor) overload of torch.Tensor.add_."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# A warning, not a failure: the code works today and breaks on a future torch.
EXPECTED_FAILURES: frozenset[str] = frozenset()
EXPECTED_WARNINGS = frozenset({"deprecations"})


class OldAddMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta})

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
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(1 - group["beta"], p.grad)
                p.add_(-group["lr"], state["momentum"])
        return loss
