"""The framework-neutral schedules as a serializable Keras 3 LearningRateSchedule."""

from __future__ import annotations

import keras

from optimizers.tensorflow_schedules import RenderedSchedule


@keras.saving.register_keras_serializable(package="optlab")
class OptlabSchedule(RenderedSchedule, keras.optimizers.schedules.LearningRateSchedule):
    """`learning_rate * multiplier(step)` for one of optlab's schedules, by name."""
