"""The framework-neutral schedules as a serializable tf_keras (Keras 2) LearningRateSchedule."""

from __future__ import annotations

import tf_keras

from optimizers.tensorflow_schedules import RenderedSchedule


@tf_keras.utils.register_keras_serializable(package="optlab")
class OptlabLegacySchedule(RenderedSchedule, tf_keras.optimizers.schedules.LearningRateSchedule):
    """`learning_rate * multiplier(step)` for one of optlab's schedules, by name."""


# tf_keras serializes a schedule inside an optimizer config with its bare class name
# (plus `registered_name`), but h5 loading looks up the bare name only: register both.
tf_keras.utils.get_custom_objects().setdefault("OptlabLegacySchedule", OptlabLegacySchedule)
