"""Optimizers that keep an enum of their own in param_groups, as Distributed Shampoo keeps its
`WeightDecayType` and config dataclasses. torch.load(weights_only=True), torch's default, refuses such
a type unless it is allowed (`torch.serialization.add_safe_globals`); one class here allows its own
where it is defined, as torch advises, and the other does not."""

from __future__ import annotations

import enum
from typing import Any

import torch


class DecayKind(enum.Enum):
    COUPLED = "coupled"
    DECOUPLED = "decoupled"


class AllowedDecayKind(enum.Enum):
    COUPLED = "coupled"
    DECOUPLED = "decoupled"


torch.serialization.add_safe_globals([AllowedDecayKind])


class _EnumDecaySGD(torch.optim.Optimizer):
    kinds: type[enum.Enum] = DecayKind

    def __init__(self, params: Any, lr: float = 0.1, weight_decay: float = 0.01) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "decay": self.kinds("decoupled")})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if group["decay"] is self.kinds.DECOUPLED:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                else:
                    grad = grad.add(param, alpha=group["weight_decay"])
                param.add_(grad, alpha=-group["lr"])
        return loss


class EnumDecaySGD(_EnumDecaySGD):
    kinds = DecayKind


class AllowedEnumDecaySGD(_EnumDecaySGD):
    kinds = AllowedDecayKind


class KindDecaySGD(_EnumDecaySGD):
    """Takes its decay rule as a member of an enum, as Distributed Shampoo takes `weight_decay_type`:
    catalogued as a choice of the members' names, and built with the member."""

    kinds = AllowedDecayKind

    def __init__(
        self,
        params: Any,
        lr: float = 0.1,
        weight_decay: float = 0.01,
        decay: AllowedDecayKind = AllowedDecayKind.DECOUPLED,
    ) -> None:
        if not isinstance(decay, AllowedDecayKind):  # first: a name instead of the member is refused
            raise TypeError(f"decay must be an AllowedDecayKind; received {decay!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "weight_decay": weight_decay, "decay": decay})
