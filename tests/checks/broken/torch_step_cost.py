"""Broken on purpose: per-row gradient clipping with a host sync (.item()) and a Python loop per row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# A warning, not a failure: slow is not wrong.
EXPECTED_FAILURES: frozenset[str] = frozenset()
EXPECTED_WARNINGS = frozenset({"step_cost"})


class RowClippedMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, max_row_norm: float = 1.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta, "max_row_norm": max_row_norm})

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
                    raise RuntimeError("RowClippedMomentum does not support sparse gradients")
                grad = p.grad.clone()
                for row in grad.view(grad.shape[0], -1):
                    norm = row.norm().item()
                    if norm > group["max_row_norm"]:
                        row.mul_(group["max_row_norm"] / norm)
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(grad, alpha=1 - group["beta"])
                p.add_(state["momentum"], alpha=-group["lr"])
        return loss
