"""Plumbing the legacy (OptimizerV2) optimizers here share, so each file keeps only its math.

Dense updates assign whole tensors; sparse ones scatter the touched rows back (the base
class has already summed duplicate indices). Configs come back as plain Python numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def coefficients(optimizer: Any, var: Any, apply_state: dict[Any, Any] | None) -> dict[str, Any]:
    """This step's per-(device, dtype) values, as `_prepare_local` computed them."""
    key = (var.device, var.dtype.base_dtype)
    found: dict[str, Any] | None = (apply_state or {}).get(key)
    return found or optimizer._fallback_apply_state(*key)


def assign_all(optimizer: Any, targets: Sequence[Any], values: Sequence[Any]) -> Any:
    return tf.group(
        *(
            target.assign(value, use_locking=optimizer._use_locking, read_value=False)
            for target, value in zip(targets, values, strict=True)
        )
    )


def scatter_rows(targets: Sequence[Any], indices: Any, values: Sequence[Any]) -> Any:
    """Write `values` into rows `indices` of each target; other rows are not touched."""
    return tf.group(
        *(
            tf.raw_ops.ResourceScatterUpdate(resource=target.handle, indices=indices, updates=value)
            for target, value in zip(targets, values, strict=True)
        )
    )


def gather_rows(tensors: Sequence[Any], indices: Any) -> list[Any]:
    return [tf.gather(tensor, indices) for tensor in tensors]


def plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Once the optimizer has run, a hyperparameter lives in a float32 variable and reads back
    as a NumPy scalar, which neither JSON nor our range checks accept. Its shortest repr gives
    back the number as written (0.1, not 0.10000000149011612), the same in float32."""
    return {key: _plain(value) for key, value in config.items()}


def _plain(value: Any) -> Any:
    if not isinstance(value, np.generic | np.ndarray) or np.ndim(value) != 0:
        return value
    scalar = np.asarray(value)[()]
    return float(str(scalar)) if isinstance(scalar, np.floating) else scalar.item()
