"""Broken on purpose: Adam whose state_dict() override "saves space" by popping the second moment
from what super().state_dict() returns, as a SPAM port did. Those dicts are self.state[p] itself, not
copies: every save also wipes the second moment training goes on with, and the step starts both
moments afresh. A save and a reload agree with each other (both lack it); the checks that save compare
the live state before and after the call, and name the override."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact"})


class SpaceSavingAdam(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": 1e-8})

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("exp_avg_sq", None)  # "cheap to re-estimate"
        return saved

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SpaceSavingAdam does not support sparse gradients")
                state = self.state[p]
                if "exp_avg_sq" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                corrected = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                step_size = group["lr"] / (1 - beta1 ** state["step"])
                p.addcdiv_(state["exp_avg"], corrected.sqrt().add_(group["eps"]), value=-step_size)
        return loss
