"""Broken on purpose: step(closure) re-evaluates the loss through the closure, then drops it.

Like SAM and LBFGS, the class requires step(closure) and takes its gradients from the closure
it calls, not from whatever .grad holds; it returns None where the closure's loss belongs, so a
loop written `loss = opt.step(closure)` gets None. torch declares step() -> float | None and
optlab's jobs ignore what it returns, so this is a `warn`, not a fail (published SAMs do it).
(Not a full SAM: gradients at a perturbed point couple the param groups through the model, which
param_groups compares group by group; this entry is about the closure alone.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset()
EXPECTED_WARNINGS = frozenset({"closure"})


class RecomputingMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum on the gradients of a closure the caller must pass."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1); received {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any]) -> None:  # type: ignore[override]
        with torch.enable_grad():
            closure()  # the loss it returns is dropped: what the warn names
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("RecomputingMomentum does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad)
                p.add_(buffer, alpha=-group["lr"])
