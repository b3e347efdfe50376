"""Broken on purpose: its default `betas` is one number where the constructor unpacks a pair, so
the class cannot be built with its own defaults (TypeError: cannot unpack non-iterable float)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"construct"})


class UnpackingMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, betas: Any = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        beta, dampening = betas  # the default is one number, not the pair this unpacks
        super().__init__(params, {"lr": lr, "beta": beta, "dampening": dampening})

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
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["dampening"])
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
