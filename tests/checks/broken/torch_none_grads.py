"""Broken on purpose: reads p.grad without checking for None (a frozen parameter crashes it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"none_grads"})


class NoneUnaware(torch.optim.Optimizer):
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
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("NoneUnaware does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
