"""Broken on purpose: the optimizer sums the workers' gradients itself, as a hand-rolled
(Horovod-style) data-parallel loop needs, so under DDP, which has already averaged
them, every gradient counts twice. On one process it is plain momentum SGD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

EXPECTED_FAILURES = frozenset({"distributed"})


class WorkerSumSGD(torch.optim.Optimizer):
    """Heavy-ball momentum that combines the gradients of all data-parallel workers."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1); received {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

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
                if p.grad.is_sparse:
                    raise RuntimeError("WorkerSumSGD does not support sparse gradients")
                grad = p.grad.clone()
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(grad)  # combine the workers' gradients
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(grad)
                p.add_(buffer, alpha=-group["lr"])
        return loss
