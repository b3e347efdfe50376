"""PyTorch's own AdamW (Loshchilov & Hutter, https://arxiv.org/abs/1711.05101), a baseline."""

from __future__ import annotations

from typing import ClassVar

import torch

from optimizers.hyperparams import Param, non_negative, positive, unit_interval_pair


class AdamW(torch.optim.AdamW):
    """AdamW: Adam with decoupled weight decay, torch.optim.AdamW."""

    optlab_name = "adamw"
    optlab_reference = "https://arxiv.org/abs/1711.05101"
    optlab_tunable = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "betas": unit_interval_pair("betas", "decay of the first and second moment"),
        "eps": positive("eps"),
        "weight_decay": non_negative("weight_decay", "decoupled, scaled by lr"),
    }
