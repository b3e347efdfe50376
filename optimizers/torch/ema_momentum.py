"""EMA momentum: the seed algorithm of the catalogue, written as a correct torch optimizer.

    m <- beta * m + (1 - beta) * g
    p <- p - lr * m                      (after p <- p * (1 - lr * weight_decay))

Weight decay is decoupled as in AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101).
Structured like `torch/optim/sgd.py`: the class gathers parameters and state, a
functional `ema_momentum()` dispatches to a per-tensor or a multi-tensor kernel.
Sparse gradients (`nn.Embedding(sparse=True)`) update only the rows they touch.

`fused=True` (opt-in) runs torch's fused SGD kernel, `torch._fused_sgd_`, in one of two ways:
- without weight decay, one pass: its momentum is EMA momentum exactly when dampening = momentum =
  beta and the buffer starts at zero (`buf <- beta * buf + (1 - beta) * g`, never SGD's first-step
  `buf <- g`);
- with it (its decay would go into that buffer), two: the average as the reference computes it
  (`_foreach_lerp_`), then the decay and the update in one pass of the kernel at momentum 0
  (`optimizers.torch.fused.fused_decay_and_step`). Also at beta = 0, where the kernel keeps no
  buffer and the state must still hold m = g.
Same math, not the same bits: the one-pass kernel averages as `beta * m + (1 - beta) * g`, the
reference as `lerp`, and the decay rounds its own way (within a few float32 ulps of the values'
scale after many steps; tests/optimizers/torch/test_fused_kernels.py).
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
from optimizers.torch.fused import (
    FUSED,
    by_device_and_dtype,
    check_fused,
    fused_decay_and_step,
    fused_sgd_serves,
)
from optimizers.torch.sparse_rows import coalesced_rows, touched_rows


class EmaMomentum(torch.optim.Optimizer):
    """Momentum as an exponential moving average of gradients, with decoupled weight decay."""

    optlab_name = "ema_momentum"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr", "step size"),
        "beta": unit_interval("beta", "decay of the gradient average"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
        "fused": FUSED,
    }

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        beta: float = 0.9,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool = False,
    ) -> None:
        check_hyperparameters(
            self.optlab_hyperparameters, lr=lr, beta=beta, weight_decay=weight_decay, fused=fused
        )
        defaults = {"lr": lr, "beta": beta, "weight_decay": weight_decay, "foreach": foreach, "fused": fused}
        super().__init__(params, defaults)
        check_fused(self.param_groups, "ema_momentum")

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
                fused=group["fused"],
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
    fused: bool = False,
) -> None:
    """Functional form; `foreach=None` picks the kernel measured faster (`default_foreach`).

    Sparse gradients always take the per-tensor kernel, applied to the touched rows only. With
    `fused`, dense gradients take the fused kernel, except under torch.compile (which cannot trace
    torch's fused SGD, and fuses the multi-tensor kernel's ops itself) and where torch's kernel
    fails its dtype (`fused_sgd_serves`): there the others serve.
    """
    if not params:
        return
    hyper = {"lr": lr, "beta": beta, "weight_decay": weight_decay}
    dense = not any(g.is_sparse for g in grads)
    if fused and dense and not torch.compiler.is_compiling():
        for some_params, some_grads, some_momenta in by_device_and_dtype(params, grads, momenta):
            kernel = _fused_ema_momentum if fused_sgd_serves(some_params[0]) else _multi_tensor_ema_momentum
            kernel(some_params, some_grads, some_momenta, **hyper)
        return
    if foreach is None:
        foreach = default_foreach(params)
    if foreach and dense:
        _multi_tensor_ema_momentum(params, grads, momenta, **hyper)
        return
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


def _fused_ema_momentum(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta: float,
    weight_decay: float,
) -> None:
    if weight_decay == 0 and beta != 0:  # one pass (measured: 0.8x the two below; benchmarks/README)
        torch._fused_sgd_(
            params,
            grads,
            momenta,
            weight_decay=0.0,
            momentum=beta,
            lr=lr,
            dampening=beta,  # (1 - dampening) * g: the EMA's weight of the new gradient
            nesterov=False,
            maximize=False,
            is_first_step=False,  # the buffer starts at zero, as m does; never SGD's `buf <- g`
        )
        return
    torch._foreach_lerp_(momenta, grads, 1 - beta)
    fused_decay_and_step(params, momenta, lr=lr, weight_decay=weight_decay)
