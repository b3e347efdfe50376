"""A hand-written AdamW, to prove the harness against the frameworks' own implementations.

Loshchilov & Hutter, Decoupled Weight Decay Regularization, https://arxiv.org/abs/1711.05101;
written in torch.optim.AdamW's convention (epsilon added after the bias-corrected root):

    p <- p * (1 - lr * weight_decay)
    m <- beta_1 * m + (1 - beta_1) * g;   v <- beta_2 * v + (1 - beta_2) * g^2
    p <- p - lr / (1 - beta_1^t) * m / (sqrt(v) / sqrt(1 - beta_2^t) + epsilon)

It must match `torch.optim.AdamW` and `keras.optimizers.AdamW` to 1e-6 after 50 steps.
Sparse gradients update only the touched rows (LazyAdam semantics).

`fused=True` (opt-in) runs torch's fused AdamW kernel, `torch._fused_adamw_`: this math exactly,
in one pass per tensor. It gives bitwise what `torch.optim.AdamW(fused=True)` gives, and differs
from the reference kernels (which are bitwise torch's for-loop and foreach AdamW) by what
torch's fused AdamW differs from its unfused one: rounding, within about one float32 ulp of the
values' scale (tests/optimizers/torch/test_fused_kernels.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive, unit_interval
from optimizers.torch.foreach_default import default_foreach
from optimizers.torch.fused import FUSED, by_device_and_dtype, check_fused
from optimizers.torch.sparse_rows import coalesced_rows, touched_rows


class AdamWRef(torch.optim.Optimizer):
    """AdamW written out by hand: Adam moments, bias correction, decoupled weight decay."""

    optlab_name = "adamw_ref"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_supports_sparse = True
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr", "step size"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to the bias-corrected root"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
        "fused": FUSED,
    }

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: bool | None = None,
        fused: bool = False,
    ) -> None:
        hyper = {
            "lr": lr,
            "beta_1": beta_1,
            "beta_2": beta_2,
            "epsilon": epsilon,
            "weight_decay": weight_decay,
        }
        check_hyperparameters(self.optlab_hyperparameters, **hyper, fused=fused)
        super().__init__(params, {**hyper, "foreach": foreach, "fused": fused})
        check_fused(self.param_groups, "adamw_ref")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, firsts, seconds, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                firsts.append(state["exp_avg"])
                seconds.append(state["exp_avg_sq"])
                steps.append(state["step"])
            adamw_ref(
                params,
                grads,
                firsts,
                seconds,
                steps,
                lr=group["lr"],
                beta_1=group["beta_1"],
                beta_2=group["beta_2"],
                epsilon=group["epsilon"],
                weight_decay=group["weight_decay"],
                foreach=group["foreach"],
                fused=group["fused"],
            )
        return loss


def adamw_ref(
    params: list[Tensor],
    grads: list[Tensor],
    firsts: list[Tensor],
    seconds: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
    foreach: bool | None,
    fused: bool = False,
) -> None:
    """Functional form; `steps` holds each parameter's update count t (already incremented);
    `foreach=None` picks the kernel measured faster (`default_foreach`); `fused` takes torch's
    fused kernel for dense gradients (a step with a sparse one takes the per-tensor kernel), but
    not under torch.compile, which cannot trace it and fuses the multi-tensor kernel's ops itself."""
    if not params:
        return
    hyper = {"lr": lr, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon, "weight_decay": weight_decay}
    dense = not any(g.is_sparse for g in grads)
    if fused and dense and not torch.compiler.is_compiling():
        for some in by_device_and_dtype(params, grads, firsts, seconds, steps):
            some_params, some_grads, some_firsts, some_seconds, some_steps = some
            _fused_adamw_ref(some_params, some_grads, some_firsts, some_seconds, some_steps, **hyper)
        return
    if foreach is None:
        foreach = default_foreach(params)
    if foreach and dense:
        _multi_tensor_adamw_ref(params, grads, firsts, seconds, steps, **hyper)
        return
    for param, grad, first, second, step in zip(params, grads, firsts, seconds, steps, strict=True):
        if grad.is_sparse:
            rows, values = coalesced_rows(grad)
            with touched_rows(rows, param, first, second) as (param_rows, first_rows, second_rows):
                _single_tensor_adamw_ref([param_rows], [values], [first_rows], [second_rows], [step], **hyper)
        else:
            _single_tensor_adamw_ref([param], [grad], [first], [second], [step], **hyper)


def _single_tensor_adamw_ref(
    params: list[Tensor],
    grads: list[Tensor],
    firsts: list[Tensor],
    seconds: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
) -> None:
    for param, grad, first, second, step in zip(params, grads, firsts, seconds, steps, strict=True):
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        first.lerp_(grad, 1 - beta_1)  # as torch.optim.AdamW: one pass
        second.mul_(beta_2).addcmul_(grad, grad, value=1 - beta_2)
        root_correction = math.sqrt(1 - beta_2**step)
        denominator = second.sqrt().div_(root_correction).add_(epsilon)
        param.addcdiv_(first, denominator, value=-lr / (1 - beta_1**step))


def _multi_tensor_adamw_ref(
    params: list[Tensor],
    grads: list[Tensor],
    firsts: list[Tensor],
    seconds: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
) -> None:
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(firsts, grads, 1 - beta_1)
    torch._foreach_mul_(seconds, beta_2)
    torch._foreach_addcmul_(seconds, grads, grads, value=1 - beta_2)
    denominators = torch._foreach_sqrt(seconds)
    torch._foreach_div_(denominators, [math.sqrt(1 - beta_2**step) for step in steps])
    torch._foreach_add_(denominators, epsilon)
    torch._foreach_addcdiv_(params, firsts, denominators, [-lr / (1 - beta_1**step) for step in steps])


def _fused_adamw_ref(
    params: list[Tensor],
    grads: list[Tensor],
    firsts: list[Tensor],
    seconds: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    weight_decay: float,
) -> None:
    # The kernel reads each t from a 0-d float32 tensor on the parameters' device (as torch's
    # fused AdamW keeps it); the state keeps an int, so one tensor per distinct count, made here.
    device = params[0].device
    counts = {step: torch.full((), float(step), dtype=torch.float32, device=device) for step in set(steps)}
    torch._fused_adamw_(
        params,
        grads,
        firsts,
        seconds,
        [],  # no max_exp_avg_sqs: not AMSGrad
        [counts[step] for step in steps],
        lr=lr,
        beta1=beta_1,
        beta2=beta_2,
        weight_decay=weight_decay,
        eps=epsilon,
        amsgrad=False,
        maximize=False,
    )
