"""Optimizers with closure contracts beyond torch's convention, which optlab's loops serve.

`OwnBackwardSGD` runs backward itself on the loss its closure returns, as torchmin's Minimizer and
SLS do: its closure computes the loss only. Its update is torch's plain SGD, so a job with it must
end bitwise where one with SGD ends. `LossOnlyLineSearch` asks for the loss alone,
`closure(backward=False)`, with the gradients left be, as line-search and trust-region optimizers
do."""

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


class LossOnlyLineSearch(torch.optim.Optimizer):
    """Backtracks on `closure(backward=False)`, the loss alone with the gradients left be: a
    convention of line-search and trust-region optimizers. The trial steps read `p.grad`."""

    def __init__(self, params: Iterable[Any], lr: float = 1.0, shrink: float = 0.5) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "shrink": shrink})

    @torch.no_grad()
    def step(self, closure: Any) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            loss = float(closure())
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            start = [p.clone() for p in params]
            slope = sum(float((p.grad * p.grad).sum()) for p in params)
            rate = group["lr"]
            for _ in range(20):
                for param, begin in zip(params, start, strict=True):
                    param.copy_(begin - rate * param.grad)
                with torch.enable_grad():
                    trial = float(closure(backward=False))
                if trial <= loss - 1e-4 * rate * slope:
                    break
                rate *= group["shrink"]
        return torch.tensor(loss)
