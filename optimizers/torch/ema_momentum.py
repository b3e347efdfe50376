"""EMA momentum: the seed algorithm of the catalogue, written as a correct torch optimizer.

    m <- beta * m + (1 - beta) * g
    p <- p - lr * m                      (after p <- p * (1 - lr * weight_decay))

Weight decay is decoupled as in AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101).
Structured like `torch/optim/sgd.py`: the class gathers parameters and state, a
functional `ema_momentum()` dispatches to a per-tensor or a multi-tensor kernel.
Sparse gradients (`nn.Embedding(sparse=True)`) update only the rows they touch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from optimizers.hyperparams import (
    Param,
    check_hyperparameters,
    non_negative,
    positive,
    unit_interval,
)
from optimizers.torch.foreach_default import default_foreach
from optimizers.torch.sparse_rows import coalesced_rows, touched_rows


class EmaMomentum(torch.optim.Optimizer):
    """Momentum as an exponential moving average of gradients, with decoupled weight decay."""

    optlab_name = "ema_momentum"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr", "step size"),
        "beta": unit_interval("beta", "decay of the gradient average"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
    }

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        beta: float = 0.9,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        check_hyperparameters(self.optlab_hyperparameters, lr=lr, beta=beta, weight_decay=weight_decay)
        defaults = {"lr": lr, "beta": beta, "weight_decay": weight_decay, "foreach": foreach}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, momenta = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                momenta.append(state["momentum"])
            ema_momentum(
                params,
                grads,
                momenta,
                lr=group["lr"],
                beta=group["beta"],
                weight_decay=group["weight_decay"],
                foreach=group["foreach"],
            )
        return loss


def ema_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta: float,
    weight_decay: float,
    foreach: bool | None,
) -> None:
    """Functional form; `foreach=None` picks the kernel measured faster (`default_foreach`).

    Sparse gradients always take the per-tensor kernel, applied to the touched rows only.
    """
    if not params:
        return
    if foreach is None:
        foreach = default_foreach(params)
    if foreach and not any(g.is_sparse for g in grads):
        _multi_tensor_ema_momentum(params, grads, momenta, lr=lr, beta=beta, weight_decay=weight_decay)
        return
    hyper = {"lr": lr, "beta": beta, "weight_decay": weight_decay}
    for param, grad, momentum in zip(params, grads, momenta, strict=True):
        if grad.is_sparse:
            rows, values = coalesced_rows(grad)
            with touched_rows(rows, param, momentum) as (param_rows, momentum_rows):
                _single_tensor_ema_momentum([param_rows], [values], [momentum_rows], **hyper)
        else:
            _single_tensor_ema_momentum([param], [grad], [momentum], **hyper)


def _single_tensor_ema_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta: float,
    weight_decay: float,
) -> None:
    for param, grad, momentum in zip(params, grads, momenta, strict=True):
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        momentum.lerp_(grad, 1 - beta)  # beta * m + (1 - beta) * g in one pass
        param.add_(momentum, alpha=-lr)


def _multi_tensor_ema_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta: float,
    weight_decay: float,
) -> None:
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(momenta, grads, 1 - beta)
    torch._foreach_add_(params, momenta, alpha=-lr)
