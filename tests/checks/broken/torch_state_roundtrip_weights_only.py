"""Broken on purpose: a deque of gradient norms in the state, refused by torch.load(weights_only=True)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

# resume_exact loads checkpoints with weights_only=True as well.
EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact"})


class NormHistoryMomentum(torch.optim.Optimizer):
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
                    state["norms"] = deque(maxlen=10)  # for adaptive clipping, some day
                state["norms"].append(p.grad.norm())
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
