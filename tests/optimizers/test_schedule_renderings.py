"""One schedule, three renderings: torch LambdaLR, Keras 3 and tf_keras LearningRateSchedules.

The learning rate applied at every step must be identical (as float32, the dtype the
updates use) over a few thousand steps, and the Keras renderings must survive
serialization without custom objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from optimizers.schedules import build_schedule

STEPS = 3000
BASE_LR = 0.003
CASES: list[tuple[str, dict[str, Any]]] = [
    ("constant", {}),
    ("exponential", {"decay_steps": 97, "decay_rate": 0.37}),
    ("exponential", {"decay_steps": 50, "decay_rate": 0.5, "staircase": True}),
    ("linear_warmup", {"warmup_steps": 130}),
    ("cosine", {"warmup_steps": 100, "min_ratio": 0.1}),
    ("cosine", {}),
    ("piecewise_constant", {"boundaries": [100, 1000, 2500], "values": [1.0, 0.3, 0.01, 0.007]}),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


def torch_rates(name: str, params: dict[str, Any]) -> np.ndarray:
    """The lr each torch update used, read from the optimizer as the step runs."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=BASE_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, build_schedule(name, params, total_steps=STEPS))
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return np.array(rates, dtype=np.float32)  # torch's CPU kernels apply it as float32


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_keras_rendering_equals_torch_at_every_step(name: str, params: dict[str, Any]) -> None:
    import keras

    from optimizers.keras.schedules import OptlabSchedule

    schedule = OptlabSchedule(BASE_LR, name, params, STEPS)
    rates = np.asarray(schedule(np.arange(STEPS, dtype=np.int64)))
    assert rates.dtype == np.float32
    np.testing.assert_array_equal(rates, torch_rates(name, params))

    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert type(revived) is OptlabSchedule and revived.get_config() == schedule.get_config()
    np.testing.assert_array_equal(np.asarray(revived(np.arange(STEPS, dtype=np.int64))), rates)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_legacy_rendering_equals_torch_at_every_step(name: str, params: dict[str, Any]) -> None:
    import tensorflow as tf
    import tf_keras

    from optimizers.tf_legacy.schedules import OptlabLegacySchedule

    schedule = OptlabLegacySchedule(BASE_LR, name, params, STEPS)
    rates = schedule(tf.range(STEPS, dtype=tf.int64)).numpy()
    np.testing.assert_array_equal(rates, torch_rates(name, params))

    config = tf_keras.optimizers.schedules.serialize(schedule)
    revived = tf_keras.optimizers.schedules.deserialize(config)
    assert type(revived) is OptlabLegacySchedule
    np.testing.assert_array_equal(revived(tf.range(STEPS, dtype=tf.int64)).numpy(), rates)


def test_piecewise_constant_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="one more value than boundaries"):
        build_schedule("piecewise_constant", {"boundaries": [10], "values": [1.0]}, total_steps=20)
    with pytest.raises(ValueError, match="strictly increasing"):
        build_schedule("piecewise_constant", {"boundaries": [10, 10], "values": [1, 1, 1]}, total_steps=20)
