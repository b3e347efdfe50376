"""What the opt-in `fused=True` of the built-in torch optimizers shares (ema_momentum, adamw_ref, lion).

torch's own fused kernels (`torch._fused_sgd_`, `torch._fused_adamw_`) do a whole update in one
pass per tensor: in C++ on a CPU, one launch for many tensors on a GPU. `torch._foreach_*` lists
take one pass through memory per op, and on a CPU one dispatch per tensor and op. adamw_ref's math
is fused AdamW's; ema_momentum and lion end with `fused_decay_and_step`, the decay and the update in
one pass of fused SGD. The math is the same; the rounding is torch's (each optimizer's docstring
says how close).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from optimizers.hyperparams import Param

FUSED = Param(
    "fused",
    "bool",
    None,
    help="one pass per tensor through torch's fused kernel (dense gradients; same math, torch's rounding)",
)


def fused_devices() -> list[str]:
    """Device types with fused optimizer kernels, as torch.optim's own `fused=True` checks them."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def check_fused(groups: Iterable[Mapping[str, object]], optimizer: str) -> None:
    """ValueError naming what `fused=True` cannot take: `foreach=True` beside it, a parameter that
    is not floating point or lies on a device without fused kernels."""
    devices = fused_devices()
    for group in groups:
        if not group["fused"]:
            continue
        if group["foreach"]:
            raise ValueError(
                f"{optimizer}: fused=True and foreach=True cannot be set together "
                "(the fused kernel replaces the multi-tensor one); set one of them"
            )
        params: Iterable[Tensor] = group["params"]  # type: ignore[assignment]
        for param in params:
            if not torch.is_floating_point(param):
                raise ValueError(
                    f"{optimizer}: fused=True takes floating-point parameters; received {param.dtype}"
                )
            if param.device.type not in devices:
                raise ValueError(
                    f"{optimizer}: fused=True needs parameters on a device with fused kernels "
                    f"({', '.join(devices)}); received one on {param.device}"
                )


def by_device_and_dtype(*lists: list[Any]) -> list[tuple[list[Any], ...]]:
    """Parallel lists (tensors, step counts) split by the device and dtype of the first one's
    tensors: one fused call takes tensors of one device and dtype (on a GPU; a CPU takes any mix)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(lists[0]):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    if len(groups) == 1:
        return [lists]
    return [tuple([items[i] for i in indices] for items in lists) for indices in groups.values()]


def fused_sgd_serves(tensor: Tensor) -> bool:
    """Whether torch's fused SGD kernel updates tensors of this one's device and dtype whole.

    Not half precision on a CPU: there torch 2.13's kernel updates only the last few elements of a
    tensor (its vector loop never stores the rest: pytorch/pytorch#191763, fixed after 2.13), so
    `fused=True` takes the multi-tensor kernel for them, whatever the torch version (the pin is 2.13,
    and a later one is trusted only once measured).
    """
    return not (tensor.dtype in (torch.float16, torch.bfloat16) and tensor.device.type == "cpu")


def fused_decay_and_step(
    params: list[Tensor], steps: list[Tensor] | tuple[Tensor, ...], *, lr: float, weight_decay: float
) -> None:
    """`p <- p * (1 - lr * weight_decay) - lr * s` for each parameter p and its step s, in one pass:
    torch's fused SGD at momentum 0, s as its gradient. Its weight decay is added to the gradient
    (`p - lr * (s + weight_decay * p)`), which without momentum is the decoupled decay exactly, up
    to rounding. `steps` are read, never written (the kernel writes a gradient back only to unscale
    it by a `grad_scale`, which is not passed)."""
    torch._fused_sgd_(
        params,
        steps,
        [],  # no momentum buffers: momentum 0
        weight_decay=weight_decay,
        momentum=0.0,
        lr=lr,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        is_first_step=False,
    )
