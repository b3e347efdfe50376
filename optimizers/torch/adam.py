"""PyTorch's own Adam (Kingma & Ba, https://arxiv.org/abs/1412.6980), registered as a baseline."""

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


class Adam(torch.optim.Adam):
    """Adam: adaptive moment estimation, torch.optim.Adam."""

    optlab_name = "adam"
    optlab_reference = "https://arxiv.org/abs/1412.6980"
    # torch's `decoupled_weight_decay`, which **implementation hands on too, is AdamW: its own entry.
    optlab_tunable = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "betas": unit_interval_pair("betas", "decay of the first and second moment"),
        "eps": positive("eps"),
        "weight_decay": non_negative("weight_decay", "L2 penalty added to the gradient"),
    }

    # torch's signature and defaults, restated so the declared ranges are enforced here too.
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        **implementation: Any,
    ) -> None:
        check_hyperparameters(
            self.optlab_hyperparameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **implementation
        )
