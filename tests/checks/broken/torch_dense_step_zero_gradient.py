"""Broken on purpose: a normalized-gradient SGD with momentum that divides by the gradient's norm
without an epsilon. Every step with a gradient passes; a parameter whose gradient is zeros (unused
in a forward pass, under zero_grad(set_to_none=False)) becomes NaN, and so does its momentum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"dense_step"})


class NormalizedMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

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
                    raise RuntimeError("NormalizedMomentum does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                direction = p.grad / p.grad.norm()  # no epsilon: 0 / 0 for a zero gradient
                state["momentum"].mul_(group["momentum"]).add_(direction)
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
