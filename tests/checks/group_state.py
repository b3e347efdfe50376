"""Per-parameter state kept in a param group, keyed by the parameters themselves, as grokadamw's
GrokAdamW keeps it (group['state'][p]): a true fault, which torch's save and load carry as a group
value, not per parameter. The checks must name it briefly (a repr of every tensor had made messages
of thousands of characters) with the fix that fits."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class GroupStateSGD(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                buffer = group.setdefault("state", {}).setdefault(p, torch.zeros_like(p))
                buffer.mul_(0.9).add_(p.grad)
                p.sub_(group["lr"] * buffer)
        return loss
