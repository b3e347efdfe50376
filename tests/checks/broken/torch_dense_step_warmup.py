"""Broken on purpose: a warm-up meant to skip the first update only, but the step count lives in a
local variable, so every step is "the first" and the parameters never move."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"dense_step"})  # the checks that need movement skip


class EndlessWarmup(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.999, eps: float = 1e-8) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta, "eps": eps})

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
                    raise RuntimeError("EndlessWarmup does not support sparse gradients")
                state = self.state[p]
                step = 0  # meant to be state["step"]
                if "exp_avg_sq" not in state:
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg_sq"].mul_(group["beta"]).addcmul_(p.grad, p.grad, value=1 - group["beta"])
                step += 1
                if step == 1:  # the first step only gathers the second moment (as ADOPT does)
                    continue
                p.addcdiv_(p.grad, state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])
        return loss
