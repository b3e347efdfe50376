"""Broken on purpose: SGD with momentum whose state_dict() override saves only the keys it lists,
and the momentum buffer is not among them. Every step is right; a reloaded optimizer restarts its
momentum from nothing. The checks that reload it name the key the save leaves out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact"})

SAVED_KEYS = ("step",)


class ListedStateSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["state"] = {
            index: {key: value for key, value in entry.items() if key in SAVED_KEYS}
            for index, entry in saved["state"].items()
        }
        return saved

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
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad)
                p.sub_(group["lr"] * buffer)
        return loss
