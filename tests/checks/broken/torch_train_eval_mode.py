"""Broken on purpose: a schedule-free optimizer keeps its train/eval mode in a Python attribute.

eval() and train() move the parameters relative to where they are (from the training point to
the averaged one and back), so they must know the mode they start from. A job saves in eval
mode; state_dict() does not carry the attribute, so a reloaded optimizer believes it is still
training: its eval() moves the already-averaged parameters again, and its train() does not move
them back before the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Both checks save in eval mode, as a job does: in-process and in a fresh process the attribute is lost alike.
EXPECTED_FAILURES = frozenset({"state_roundtrip", "resume_exact"})


class ScheduleFreeMomentum(torch.optim.Optimizer):
    """Schedule-free SGD (Defazio et al. 2024, https://arxiv.org/abs/2405.15682).

    z takes plain SGD steps, x is their average weighted by the rate (what to evaluate), and the
    gradient is taken at y = (1 - momentum) * z + momentum * x. p holds y while training and x
    after eval(); only z is stored, x follows from y and z.
    """

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if not 0 < momentum < 1:
            raise ValueError(f"momentum must be a number in (0, 1); received {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.training = True  # the fault: group["train_mode"] would be saved with the param groups

    @torch.no_grad()
    def eval(self) -> None:
        """Move every parameter from y to x = y + (1 - 1/momentum) * (z - y)."""
        if self.training:
            for group in self.param_groups:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.lerp_(self.state[p]["z"], 1 - 1 / group["momentum"])
            self.training = False

    @torch.no_grad()
    def train(self) -> None:
        """Move every parameter from x back to y = x + (1 - momentum) * (z - x)."""
        if not self.training:
            for group in self.param_groups:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        p.lerp_(self.state[p]["z"], 1 - group["momentum"])
            self.training = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ScheduleFreeMomentum does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["z"] = p.detach().clone()
                    state["weight_sum"] = 0.0
                state["weight_sum"] += lr
                # x moves to z by the share of this step's rate in all rates so far (none at lr 0).
                share = lr / state["weight_sum"] if state["weight_sum"] > 0 else 0.0
                # With x eliminated: y' = y + share * (z - y) - lr * (1 - momentum * (1 - share)) * g.
                p.lerp_(state["z"], share)
                p.add_(p.grad, alpha=lr * (momentum * (1 - share) - 1))
                state["z"].sub_(p.grad, alpha=lr)
        return loss
