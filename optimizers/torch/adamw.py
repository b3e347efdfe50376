"""PyTorch's own AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101), a baseline."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers.hyperparams import (
    Param,
    check_hyperparameters,
    non_negative,
    positive,
    unit_interval_pair,
)


class AdamW(torch.optim.AdamW):
    """AdamW: Adam with decoupled weight decay, torch.optim.AdamW."""

    optlab_name = "adamw"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "betas": unit_interval_pair("betas", "decay of the first and second moment"),
        "eps": positive("eps"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
    }

    # torch's signature and defaults, restated so the declared ranges are enforced here too.
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        **implementation: Any,
    ) -> None:
        check_hyperparameters(
            self.optlab_hyperparameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **implementation
        )
