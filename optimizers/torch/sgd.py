"""PyTorch's own SGD (with optional momentum), registered as a baseline."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers.hyperparams import Param, check_hyperparameters, non_negative, positive


class SGD(torch.optim.SGD):
    """Stochastic gradient descent with optional (Nesterov) momentum: torch.optim.SGD."""

    optlab_name = "sgd"
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "lr": positive("lr"),
        "momentum": Param("momentum", "float", None, low=0.0, high=1.0, high_inclusive=False),
        "dampening": Param("dampening", "float", None, low=0.0, high=1.0),
        "weight_decay": non_negative("weight_decay", "L2 penalty added to the gradient"),
    }

    # torch's signature and defaults, restated so the declared ranges are enforced
    # here too (torch accepts lr=0, momentum=1 and any dampening).
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **implementation: Any,
    ) -> None:
        check_hyperparameters(
            self.optlab_hyperparameters,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
        )
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            **implementation,
        )
