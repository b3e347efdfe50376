"""Broken on purpose: step() ignores its closure and returns None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"closure"})


class NoClosure(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-group["lr"])
