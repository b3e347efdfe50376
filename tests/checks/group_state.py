"""What classes keep in their param groups besides hyperparameters.

`GroupStateSGD`: per-parameter state keyed by the parameters themselves, as grokadamw's GrokAdamW
keeps it (group['state'][p]): a true fault, which torch's save and load carry as a group value, not
per parameter. The checks must name it briefly (a repr of every tensor had made messages of
thousands of characters) with the fix that fits.

`PrivateDefaultSGD`: a private group value its state_dict() drops with every `_` key, as heavyball's
does, read with a default (`group.get`), so a reloaded optimizer steps on without it, silently
otherwise: config_roundtrip lets a private key go, and resume_exact must still catch it."""

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


class PrivateDefaultSGD(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "_decay": 0.05})

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for group in saved["param_groups"]:
            for key in [k for k in group if k.startswith("_")]:
                del group[key]
        return saved

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.mul_(1 - group.get("_decay", 0.0)).sub_(group["lr"] * p.grad)
        return loss
