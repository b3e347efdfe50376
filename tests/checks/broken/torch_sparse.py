"""Broken on purpose: a hand-written Adam whose dense-only ops crash on sparse gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"sparse"})


class DenseOnlyAdam(torch.optim.Optimizer):
    def __init__(
        self, params: Any, lr: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999, eps: float = 1e-8
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta_1": beta_1, "beta_2": beta_2, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["beta_1"], group["beta_2"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])
        return loss
