"""Optimizers whose step count lives outside their instances, in their module: one value every
instance (and every replica of a distribution strategy) shares and no save holds. Their runs differ
from one another, as a random class's do, but no random number is drawn: a fault, not a design."""

from __future__ import annotations

from typing import Any

import torch

STEPS = torch.zeros(())  # one counter for every instance


class SharedCounterSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.05) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        STEPS.add_(1)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / float(STEPS.sqrt()))
