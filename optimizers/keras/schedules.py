"""The framework-neutral schedules rendered as a serializable Keras 3 LearningRateSchedule.

The formula is the one in `optimizers.schedules`, evaluated with `keras.ops` in float64
and rounded to float32 once, so the rate at every step equals the torch rendering's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
from keras import ops

from optimizers.schedules import build_schedule


class KerasMath:
    """keras.ops with every operand in float64 (Python numbers would become float32)."""

    def where(self, condition: Any, if_true: Any, if_false: Any) -> Any:
        return ops.where(condition, _f64(if_true), _f64(if_false))

    def floor(self, x: Any) -> Any:
        return ops.floor(_f64(x))

    def cos(self, x: Any) -> Any:
        return ops.cos(_f64(x))

    def minimum(self, x: Any, y: Any) -> Any:
        return ops.minimum(_f64(x), _f64(y))

    def maximum(self, x: Any, y: Any) -> Any:
        return ops.maximum(_f64(x), _f64(y))

    def power(self, x: Any, y: Any) -> Any:
        return ops.power(_f64(x), _f64(y))


def _f64(x: Any) -> Any:
    # A Python number straight to float64: casting would round it through float32 first.
    if isinstance(x, int | float):
        return ops.convert_to_tensor(x, dtype="float64")
    return ops.cast(x, "float64")


@keras.saving.register_keras_serializable(package="optlab")
class OptlabSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`learning_rate * multiplier(step)` for one of optlab's schedules, by name."""

    def __init__(
        self, learning_rate: float, schedule: str, params: Mapping[str, Any], total_steps: int
    ) -> None:
        super().__init__()
        self.learning_rate = float(learning_rate)
        self.schedule = schedule
        self.params = dict(params)
        self.total_steps = int(total_steps)
        self._formula = build_schedule(schedule, params, total_steps=total_steps)

    def __call__(self, step: Any) -> Any:
        multiplier = self._formula.value(ops.cast(step, "float64"), KerasMath())
        return ops.cast(ops.multiply(_f64(multiplier), _f64(self.learning_rate)), "float32")

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self.learning_rate,
            "schedule": self.schedule,
            "params": self.params,
            "total_steps": self.total_steps,
        }
