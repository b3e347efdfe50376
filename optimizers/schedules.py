"""Framework-neutral learning-rate schedules: pure `step -> multiplier` functions.

The multiplier scales the optimizer's base `lr`; step 0 is the first update. Each
framework renders the same function (torch: `LambdaLR`), so the value applied at a
step is identical everywhere. Schedules are small dataclasses rather than closures
so their settings travel inside a torch scheduler's `state_dict`.
Composition follows optax's `schedules` module: warmup is a separate piece.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from optimizers.hyperparams import Param, check_all


class Schedule(Protocol):
    def __call__(self, step: int) -> float: ...


@dataclass
class Constant:
    """The base learning rate at every step."""

    summary: ClassVar[str] = "The base learning rate at every step."
    params: ClassVar[dict[str, Param]] = {}

    def __call__(self, step: int) -> float:
        return 1.0


@dataclass
class Exponential:
    """lr * decay_rate ** (step / decay_steps); with `staircase` the exponent is floored."""

    summary: ClassVar[str] = "lr * decay_rate^(step / decay_steps), optionally in whole stairs."
    params: ClassVar[dict[str, Param]] = {
        "decay_steps": Param("decay_steps", "int", 100, low=1, help="steps per decay period"),
        "decay_rate": Param(
            "decay_rate",
            "float",
            0.5,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            help="factor applied once per decay period",
        ),
        "staircase": Param("staircase", "bool", False, help="decay in whole periods"),
    }
    decay_steps: int
    decay_rate: float
    staircase: bool

    def __call__(self, step: int) -> float:
        exponent = step / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return float(self.decay_rate**exponent)


@dataclass
class LinearWarmup:
    """Ramps linearly to the base rate over `warmup_steps`, then holds it."""

    summary: ClassVar[str] = "Linear ramp to the base rate over warmup_steps, then constant."
    params: ClassVar[dict[str, Param]] = {
        "warmup_steps": Param("warmup_steps", "int", 100, low=0, help="steps of linear ramp"),
    }
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)


@dataclass
class Cosine:
    """Linear warmup, then a half cosine from the base rate down to `min_ratio` of it.

    Loshchilov & Hutter, SGDR (https://arxiv.org/abs/1608.03983), without restarts.
    """

    summary: ClassVar[str] = "Linear warmup, then cosine decay reaching min_ratio * lr when training ends."
    params: ClassVar[dict[str, Param]] = {
        "warmup_steps": Param("warmup_steps", "int", 0, low=0, help="steps of linear ramp"),
        "min_ratio": Param("min_ratio", "float", 0.0, low=0.0, high=1.0, help="final lr as a fraction of lr"),
    }
    warmup_steps: int
    min_ratio: float
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cosine


SCHEDULES: dict[str, type[Any]] = {
    "constant": Constant,
    "exponential": Exponential,
    "linear_warmup": LinearWarmup,
    "cosine": Cosine,
}


def build_schedule(name: str, params: Mapping[str, Any], *, total_steps: int) -> Schedule:
    """Build a schedule by name; raise ValueError naming what is wrong and what is allowed."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    cls = SCHEDULES[name]
    checked = check_all(params, cls.params, owner=f"schedule {name!r}")
    if "total_steps" in cls.__dataclass_fields__:
        checked["total_steps"] = total_steps
    schedule: Schedule = cls(**checked)
    return schedule


def describe_schedules() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "summary": cls.summary,
            "params": [param.to_json() for param in cls.params.values()],
        }
        for name, cls in SCHEDULES.items()
    ]


def _warmup(step: int, warmup_steps: int) -> float:
    # (step + 1) / warmup: the first update already moves, the last warmup step is full lr.
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps
