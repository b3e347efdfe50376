"""The framework-neutral schedules evaluated with TensorFlow ops, for both Keras styles.

The formula is the one in `optimizers.schedules`, evaluated in float64 and rounded to
float32 once, so the rate at every step equals the torch rendering's. Keras 3 runs on
the TensorFlow backend here, so one set of ops serves it and tf_keras alike; each style
subclasses `RenderedSchedule` with its own LearningRateSchedule base and registration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from optimizers.schedules import build_schedule


class TensorFlowMath:
    """TensorFlow ops with every operand in float64 (Python numbers would become float32)."""

    def where(self, condition: Any, if_true: Any, if_false: Any) -> Any:
        return tf.where(condition, _f64(if_true), _f64(if_false))

    def floor(self, x: Any) -> Any:
        return tf.floor(_f64(x))

    def cos(self, x: Any) -> Any:
        return tf.cos(_f64(x))

    def minimum(self, x: Any, y: Any) -> Any:
        return tf.minimum(_f64(x), _f64(y))

    def maximum(self, x: Any, y: Any) -> Any:
        return tf.maximum(_f64(x), _f64(y))

    def power(self, x: Any, y: Any) -> Any:
        return tf.pow(_f64(x), _f64(y))


class RenderedSchedule:
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
        multiplier = self._formula.value(_f64(step), TensorFlowMath())
        return tf.cast(_f64(multiplier) * _f64(self.learning_rate), tf.float32)

    def get_config(self) -> dict[str, Any]:
        return {
            "learning_rate": self.learning_rate,
            "schedule": self.schedule,
            "params": self.params,
            "total_steps": self.total_steps,
        }


def _f64(x: Any) -> Any:
    # A Python number straight to float64: tf.cast would round it through float32 first.
    if isinstance(x, int | float):
        return tf.constant(x, dtype=tf.float64)
    return tf.cast(x, tf.float64)
