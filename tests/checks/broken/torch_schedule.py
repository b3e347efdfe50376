"""Broken on purpose: a built-in warm-up keeps the first lr it saw, so a scheduler is ignored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"schedule"})


class WarmupMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, warmup_steps: int = 0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta, "warmup_steps": warmup_steps})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            base_lr = group.setdefault("base_lr", group["lr"])
            group["steps"] = group.get("steps", 0) + 1
            warmup = min(1.0, group["steps"] / group["warmup_steps"]) if group["warmup_steps"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-base_lr * warmup)
        return loss
