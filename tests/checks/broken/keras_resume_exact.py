"""Broken on purpose: the gentle first step is remembered in a module global.

Shared by every instance in a process, so an in-process reload keeps it; a run resumed
in a NEW process takes a second "first" step at a tenth of the learning rate.
"""

from __future__ import annotations

from typing import Any

import keras

EXPECTED_FAILURES = frozenset({"resume_exact"})

_warmed_up = False  # meant as "this training run has taken its first step"


@keras.saving.register_keras_serializable(package="optlab_broken")
class GentleStartSGD(keras.optimizers.SGD):
    """Keras SGD whose very first step is taken at a tenth of the learning rate."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        if not _warmed_up:
            learning_rate = learning_rate * 0.1
        super().update_step(gradient, variable, learning_rate)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        global _warmed_up
        result = super().apply(grads, trainable_variables)
        _warmed_up = True
        return result
