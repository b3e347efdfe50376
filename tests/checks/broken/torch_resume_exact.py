"""Broken on purpose: the gentle first step is remembered in a module global.

A module global is shared by every instance in a process, so any reload inside the
process keeps it and looks fine; a run resumed in a NEW process starts it at False
again and takes a second "first" step at a tenth of the learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"resume_exact"})

_warmed_up = False  # meant as "this training run has taken its first step"


class GentleStartSGD(torch.optim.Optimizer):
    """Heavy-ball momentum whose very first step is taken at a tenth of the learning rate."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1); received {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        global _warmed_up
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = 1.0 if _warmed_up else 0.1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GentleStartSGD does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad)
                p.add_(buffer, alpha=-group["lr"] * scale)
        _warmed_up = True
        return loss
