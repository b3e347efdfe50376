"""An optimizer that computes its own step size at its default `lr=None`, as timm's Adafactor does
(relative step, written into each group's `lr` every step); an lr given is the rate it steps at."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class RelativeStepSGD(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float | None = None, momentum: float = 0.9) -> None:
        if lr is not None and lr < 0:
            raise ValueError(f"Invalid lr: {lr}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "relative_step": lr is None})

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
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                if group["relative_step"]:  # timm's _get_lr: the step size of its own, kept in the group
                    group["lr"] = min(1e-2, state["step"] ** -0.5)
                state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


class CachedRateWhenGivenSGD(RelativeStepSGD):
    """The same, but a given lr is read once, at construction, and never from the group again: a
    schedule never reaches it."""

    def __init__(self, params: Iterable[Any], lr: float | None = None, momentum: float = 0.9) -> None:
        super().__init__(params, lr, momentum)
        self.given_rate = lr

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    rate = self.given_rate if self.given_rate is not None else 1e-2
                    p.add_(p.grad, alpha=-rate)
                    if group["relative_step"]:
                        group["lr"] = rate
        return None
