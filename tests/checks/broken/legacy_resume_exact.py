"""Broken on purpose: the gentle first step is remembered in a module global.

Shared by every instance in a process, so an in-process reload keeps it; a run resumed
in a NEW process takes a second "first" step at a tenth of the learning rate.
"""

from __future__ import annotations

from typing import Any

import tf_keras

EXPECTED_FAILURES = frozenset({"resume_exact"})

_warmed_up = False  # meant as "this training run has taken its first step"


@tf_keras.utils.register_keras_serializable(package="optlab_broken")
class GentleStartSGD(tf_keras.optimizers.legacy.SGD):
    """Legacy SGD whose very first step is taken at a tenth of the learning rate."""

    def _prepare_local(self, var_device: Any, var_dtype: Any, apply_state: dict[Any, Any]) -> None:
        super()._prepare_local(var_device, var_dtype, apply_state)
        if not _warmed_up:
            apply_state[(var_device, var_dtype)]["lr_t"] *= 0.1

    def apply_gradients(self, grads_and_vars: Any, name: Any = None, **kwargs: Any) -> Any:
        global _warmed_up
        result = super().apply_gradients(grads_and_vars, name=name, **kwargs)
        _warmed_up = True
        return result
