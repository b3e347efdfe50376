"""An optimizer plugin you can copy: drop this file into a folder named by OPTLAB_PLUGIN_DIRS.

It imports nothing from optlab. Every optimizer class defined here is registered,
under `optlab_name` when set, else its class name in snake_case (`SignMomentum` ->
`sign_momentum`). Hyperparameters, their types and defaults come from `__init__`'s
signature; the first docstring line becomes the catalogue's summary and the first
URL its reference. Ranges are plain dicts in `optlab_hyperparameters` (keys: low, high,
low_inclusive, high_inclusive, choices, help): the catalogue publishes them and the API refuses a
job whose values fall outside. Keep per-parameter state in `self.state[p]` and hyperparameters
in `param_groups`, or the checkpoint round-trip will fail the job (on purpose).

Signum: the sign of a momentum average, Bernstein et al. 2018, https://arxiv.org/abs/1802.04434

    m <- beta * m + (1 - beta) * g
    p <- p * (1 - lr * weight_decay) - lr * sign(m)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch


class SignMomentum(torch.optim.Optimizer):
    """Signum: steps along the sign of an exponential moving average of gradients.

    Bernstein et al., signSGD, 2018: https://arxiv.org/abs/1802.04434
    """

    # The same rules __init__ enforces, published so that a bad job is refused when submitted, not
    # when it starts. Type and default come from the signature. beta = 1 would freeze the average.
    optlab_hyperparameters: ClassVar[dict[str, dict[str, Any]]] = {
        "lr": {"low": 0.0, "low_inclusive": False, "help": "step size"},
        "beta": {"low": 0.0, "high": 1.0, "high_inclusive": False, "help": "decay of the gradient average"},
        "weight_decay": {"low": 0.0, "help": "decoupled, scaled by lr"},
    }

    def __init__(self, params: Any, lr: float = 1e-3, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        # Say what is wrong and what is allowed: the service shows this message as is.
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be a number in [0, 1); received {beta}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be a number >= 0; received {weight_decay}")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

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
                    raise RuntimeError("sign_momentum does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                momentum = state["momentum"]
                momentum.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(momentum.sign(), alpha=-group["lr"])
        return loss
