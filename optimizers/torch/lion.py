"""Lion: EvoLved Sign Momentum (Chen et al., 2023, https://arxiv.org/abs/2302.06675).

    c <- beta_1 * m + (1 - beta_1) * g
    p <- p * (1 - lr * weight_decay) - lr * sign(c)
    m <- beta_2 * m + (1 - beta_2) * g

The update has the same magnitude for every coordinate, so Lion wants a learning
rate 3-10x smaller than AdamW's. Sparse gradients update only the touched rows.

`fused=True` (opt-in) takes the decay and the update in one pass of torch's fused SGD kernel
(`optimizers.torch.fused.fused_decay_and_step`) instead of two `_foreach_*` passes; the direction
and the momentum are the multi-tensor kernel's, bitwise. Same math, not the same bits: the
parameters round their own way (tests/optimizers/torch/test_fused_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval
from optimizers.torch.foreach_default import default_foreach
from optimizers.torch.fused import (
    FUSED,
    by_device_and_dtype,
    check_fused,
    fused_decay_and_step,
    fused_sgd_serves,
)
from optimizers.torch.sparse_rows import coalesced_rows, touched_rows


class Lion(torch.optim.Optimizer):
    """Lion: sign of an interpolated momentum, with decoupled weight decay."""

    optlab_name = "lion"
    optlab_reference = "https://arxiv.org/abs/2302.06675"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr", "step size"),
        "beta_1": unit_interval("beta_1", "interpolation between momentum and gradient for the sign"),
        "beta_2": unit_interval("beta_2", "decay of the momentum"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
        "fused": FUSED,
    }

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        fused: bool = False,
    ) -> None:
        check_hyperparameters(
            self.optlab_hyperparameters,
            lr=lr,
            beta_1=beta_1,
            beta_2=beta_2,
            weight_decay=weight_decay,
            fused=fused,
        )
        defaults = {"lr": lr, "beta_1": beta_1, "beta_2": beta_2, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "foreach": foreach, "fused": fused})
        check_fused(self.param_groups, "lion")

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
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                momenta.append(state["exp_avg"])
            lion(
                params,
                grads,
                momenta,
                lr=group["lr"],
                beta_1=group["beta_1"],
                beta_2=group["beta_2"],
                weight_decay=group["weight_decay"],
                foreach=group["foreach"],
                fused=group.get("fused", False),  # a checkpoint from before lion took `fused` has none
            )
        return loss


def lion(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    weight_decay: float,
    foreach: bool | None,
    fused: bool = False,
) -> None:
    """Functional form; `foreach=None` picks the kernel measured faster (`default_foreach`).

    Sparse gradients always take the per-tensor kernel, applied to the touched rows only. With
    `fused`, dense gradients take the fused kernel, except under torch.compile (which cannot trace
    torch's fused SGD, and fuses the multi-tensor kernel's ops itself) and where torch's kernel
    fails its dtype (`fused_sgd_serves`).
    """
    if not params:
        return
    hyper = {"lr": lr, "beta_1": beta_1, "beta_2": beta_2, "weight_decay": weight_decay}
    dense = not any(g.is_sparse for g in grads)
    if fused and dense and not torch.compiler.is_compiling():
        for some_params, some_grads, some_momenta in by_device_and_dtype(params, grads, momenta):
            kernel = _fused_lion if fused_sgd_serves(some_params[0]) else _multi_tensor_lion
            kernel(some_params, some_grads, some_momenta, **hyper)
        return
    if foreach is None:
        foreach = default_foreach(params)
    if foreach and dense:
        _multi_tensor_lion(params, grads, momenta, **hyper)
        return
    for param, grad, momentum in zip(params, grads, momenta, strict=True):
        if grad.is_sparse:
            rows, values = coalesced_rows(grad)
            with touched_rows(rows, param, momentum) as (param_rows, momentum_rows):
                _single_tensor_lion([param_rows], [values], [momentum_rows], **hyper)
        else:
            _single_tensor_lion([param], [grad], [momentum], **hyper)


def _single_tensor_lion(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    weight_decay: float,
) -> None:
    for param, grad, momentum in zip(params, grads, momenta, strict=True):
        direction = momentum.lerp(grad, 1 - beta_1).sign_()
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        param.add_(direction, alpha=-lr)
        momentum.lerp_(grad, 1 - beta_2)


def _multi_tensor_lion(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    weight_decay: float,
) -> None:
    directions = torch._foreach_lerp(momenta, grads, 1 - beta_1)
    torch._foreach_sign_(directions)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, directions, alpha=-lr)
    torch._foreach_lerp_(momenta, grads, 1 - beta_2)


def _fused_lion(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    weight_decay: float,
) -> None:
    directions = torch._foreach_lerp(momenta, grads, 1 - beta_1)
    torch._foreach_sign_(directions)
    fused_decay_and_step(params, directions, lr=lr, weight_decay=weight_decay)
    torch._foreach_lerp_(momenta, grads, 1 - beta_2)
