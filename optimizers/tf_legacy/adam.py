"""tf_keras's own legacy Adam (Kingma & Ba, https://arxiv.org/abs/1412.6980), registered as a baseline.

Its sparse update is not lazy: the moments of every row decay each step (see tf_keras's docs).
"""

from __future__ import annotations

from typing import Any, ClassVar

import tf_keras

from optimizers.hyperparams import Param, check_hyperparameters, positive, unit_interval
from optimizers.tf_legacy.plumbing import plain_config


@tf_keras.utils.register_keras_serializable(package="optlab")
class Adam(tf_keras.optimizers.legacy.Adam):
    """Adam: adaptive moment estimation, tf_keras.optimizers.legacy.Adam."""

    optlab_name = "adam"
    optlab_reference = "https://arxiv.org/abs/1412.6980"
    optlab_supports_sparse = True
    optlab_tunable = ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad")
    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "learning_rate": positive("learning_rate", "step size; a LearningRateSchedule is allowed"),
        "beta_1": unit_interval("beta_1", "decay of the first moment"),
        "beta_2": unit_interval("beta_2", "decay of the second moment"),
        "epsilon": positive("epsilon", "added to sqrt(v)"),
    }

    # tf_keras's signature and defaults, restated so the declared ranges are enforced here
    # too (tf_keras accepts beta_1=1 and silently replaces epsilon=0 by 1e-7).
    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "Adam",
        **kwargs: Any,
    ) -> None:
        learning_rate = kwargs.pop("lr", learning_rate)  # the legacy alias the base class accepts
        if isinstance(learning_rate, int | float):  # a schedule or a tensor is taken as given
            check_hyperparameters(self.optlab_hyperparameters, learning_rate=learning_rate)
        check_hyperparameters(self.optlab_hyperparameters, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            name=name,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        # A hyperparameter in a variable reads back as a NumPy float32; give the plain number.
        return plain_config(super().get_config())
