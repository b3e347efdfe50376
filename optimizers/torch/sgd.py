"""PyTorch's own SGD (with optional momentum), registered as a baseline."""

from __future__ import annotations

from typing import ClassVar

import torch

from optimizers.hyperparams import Param, non_negative, positive


class SGD(torch.optim.SGD):
    """Stochastic gradient descent with optional (Nesterov) momentum: torch.optim.SGD."""

    optlab_name = "sgd"
    optlab_tunable = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "momentum": Param("momentum", "float", None, low=0.0, high=1.0, high_inclusive=False),
        "dampening": Param("dampening", "float", None, low=0.0, high=1.0),
        "weight_decay": non_negative("weight_decay", "L2 penalty added to the gradient"),
    }
