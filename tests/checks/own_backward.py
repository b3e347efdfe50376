"""An optimizer that runs backward itself on the loss its closure returns, as torchmin's Minimizer
(and BackPACK's and Hessian-free optimizers) do: its closure computes the loss only. Its update is
torch's plain SGD, so a job with it must end bitwise where one with SGD ends."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class OwnBackwardSGD(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        with torch.enable_grad():
            loss = closure()
            loss.backward()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        return loss.detach()
