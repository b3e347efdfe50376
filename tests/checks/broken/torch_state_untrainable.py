"""Broken on purpose: no @torch.no_grad(), so weight decay folded into g gives the state a grad history."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"state_untrainable"})


class GradTrackingMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GradTrackingMomentum does not support sparse gradients")
                g = p.grad + group["weight_decay"] * p
                state = self.state[p]
                momentum = state.get("momentum", torch.zeros_like(p))
                state["momentum"] = group["beta"] * momentum + (1 - group["beta"]) * g
                p.data.add_(state["momentum"], alpha=-group["lr"])
        return loss
