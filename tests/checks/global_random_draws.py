"""An SGD whose every step draws from numpy's and Python's global random streams (as Kron and PSGD
draw from numpy's, PCGrad from `random`): legitimate, and exact across a resume when a checkpoint
saves those streams along with torch's."""

from __future__ import annotations

import random

import numpy as np
import torch


class GlobalRandomSGD(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.05) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        scale = 0.5 + np.random.random() + random.random()  # in [0.5, 2.5): every draw moves the weights
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
        return None
