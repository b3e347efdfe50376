"""PyTorch's own Adam (Kingma & Ba, https://arxiv.org/abs/1412.6980), registered as a baseline."""

from __future__ import annotations

from typing import ClassVar

import torch

from optimizers.hyperparams import Param, non_negative, positive, unit_interval_pair


class Adam(torch.optim.Adam):
    """Adam: adaptive moment estimation, torch.optim.Adam."""

    optlab_name = "adam"
    optlab_reference = "https://arxiv.org/abs/1412.6980"
    optlab_tunable = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "betas": unit_interval_pair("betas", "decay of the first and second moment"),
        "eps": positive("eps"),
        "weight_decay": non_negative("weight_decay", "L2 penalty added to the gradient"),
    }
