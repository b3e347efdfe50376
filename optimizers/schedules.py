"""Framework-neutral learning-rate schedules: `step -> multiplier` of the base `lr`.

Step 0 is the first update. Each schedule's formula is written once, against a small
math namespace: plain Python here (`__call__`, used by torch's `LambdaLR` and by the
API's validation), TensorFlow ops in `optimizers.tensorflow_schedules` (both Keras
styles). So the value applied at a step is the same in every framework. Schedules are
small dataclasses rather than closures so their settings travel inside a torch
scheduler's `state_dict`. Composition follows optax's `schedules` module: warmup is a
separate piece.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from optimizers.hyperparams import Param, check_all


class Math(Protocol):
    """The operations a schedule formula may use; `step` is a float or a float64 tensor."""

    def where(self, condition: Any, if_true: Any, if_false: Any) -> Any: ...
    def floor(self, x: Any) -> Any: ...
    def cos(self, x: Any) -> Any: ...
    def minimum(self, x: Any, y: Any) -> Any: ...
    def maximum(self, x: Any, y: Any) -> Any: ...
    def power(self, x: Any, y: Any) -> Any: ...


class PythonMath:
    def where(self, condition: Any, if_true: Any, if_false: Any) -> Any:
        return if_true if condition else if_false

    def floor(self, x: Any) -> Any:
        return float(math.floor(x))

    def cos(self, x: Any) -> Any:
        return math.cos(x)

    def minimum(self, x: Any, y: Any) -> Any:
        return min(x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return max(x, y)

    def power(self, x: Any, y: Any) -> Any:
        return float(x) ** y


PYTHON = PythonMath()


class Schedule:
    """Base: subclasses declare `params` and implement `value(step, m)` once."""

    summary: ClassVar[str]
    params: ClassVar[dict[str, Param]]

    def value(self, step: Any, m: Math) -> Any:
        raise NotImplementedError

    def __call__(self, step: int) -> float:
        return float(self.value(float(step), PYTHON))


@dataclass
class Constant(Schedule):
    summary: ClassVar[str] = "The base learning rate at every step."
    params: ClassVar[dict[str, Param]] = {}

    def value(self, step: Any, m: Math) -> Any:
        return 1.0


@dataclass
class Exponential(Schedule):
    """decay_rate ** (step / decay_steps); with `staircase` the exponent is floored."""

    summary: ClassVar[str] = "lr * decay_rate^(step / decay_steps), optionally in whole stairs."
    params: ClassVar[dict[str, Param]] = {
        "decay_steps": Param("decay_steps", "int", 100, low=1, help="steps per decay period"),
        "decay_rate": Param(
            "decay_rate", "float", 0.5, low=0.0, high=1.0, low_inclusive=False,
            help="factor applied once per decay period",
        ),
        "staircase": Param("staircase", "bool", False, help="decay in whole periods"),
    }  # fmt: skip
    decay_steps: int
    decay_rate: float
    staircase: bool

    def value(self, step: Any, m: Math) -> Any:
        exponent = step / self.decay_steps
        if self.staircase:  # a setting, not a tensor: plain Python control flow is fine
            exponent = m.floor(exponent)
        return m.power(self.decay_rate, exponent)


@dataclass
class LinearWarmup(Schedule):
    summary: ClassVar[str] = "Linear ramp to the base rate over warmup_steps, then constant."
    params: ClassVar[dict[str, Param]] = {
        "warmup_steps": Param("warmup_steps", "int", 100, low=0, help="steps of linear ramp"),
    }
    warmup_steps: int

    def value(self, step: Any, m: Math) -> Any:
        return _warmup(step, self.warmup_steps, m)


@dataclass
class Cosine(Schedule):
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

    def value(self, step: Any, m: Math) -> Any:
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = m.minimum(m.maximum(step - self.warmup_steps, 0.0) / decay_steps, 1.0)
        decayed = self.min_ratio + (1.0 - self.min_ratio) * (0.5 * (1.0 + m.cos(math.pi * progress)))
        return m.where(step < self.warmup_steps, _warmup(step, self.warmup_steps, m), decayed)


@dataclass
class PiecewiseConstant(Schedule):
    """values[i] between boundaries[i-1] and boundaries[i]: step < boundaries[0] gives values[0]."""

    summary: ClassVar[str] = "Multipliers that change at given steps (len(values) = len(boundaries) + 1)."
    params: ClassVar[dict[str, Param]] = {
        "boundaries": Param(
            "boundaries", "int_list", [], low=1, help="increasing steps where the value changes"
        ),
        "values": Param(
            "values", "float_list", [1.0], low=0.0, help="multipliers of lr, one more than boundaries"
        ),
    }
    boundaries: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=lambda: [1.0])

    def __post_init__(self) -> None:
        if len(self.values) != len(self.boundaries) + 1:
            default = " (values' default, where it is left out)"
            raise ScheduleParamError(
                "values",
                f"piecewise_constant needs one more value than boundaries; received {len(self.boundaries)} "
                f"boundaries {self.boundaries} and {len(self.values)} values {self.values}"
                + (default if self.values == [1.0] else ""),
            )
        if any(
            later <= earlier for earlier, later in zip(self.boundaries, self.boundaries[1:], strict=False)
        ):
            raise ScheduleParamError(
                "boundaries", f"boundaries must be strictly increasing; received {self.boundaries}"
            )

    def value(self, step: Any, m: Math) -> Any:
        # Nested selections, not sums of differences: each value comes back exactly.
        result: Any = self.values[0]
        for boundary, value in zip(self.boundaries, self.values[1:], strict=True):
            result = m.where(step >= boundary, value, result)
        return result


SCHEDULES: dict[str, type[Schedule]] = {
    "constant": Constant,
    "exponential": Exponential,
    "linear_warmup": LinearWarmup,
    "cosine": Cosine,
    "piecewise_constant": PiecewiseConstant,
}


class ScheduleParamError(ValueError):
    """A schedule's parameters that do not fit together, at the one to change (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def build_schedule(name: str, params: Mapping[str, Any], *, total_steps: int) -> Schedule:
    """Build a schedule by name; raise ValueError naming what is wrong and what is allowed."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    cls = SCHEDULES[name]
    checked = check_all(params, cls.params, owner=f"schedule {name!r}")
    if "total_steps" in cls.__dataclass_fields__:  # type: ignore[attr-defined]
        checked["total_steps"] = total_steps
    return cls(**checked)


def describe_schedules() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "summary": cls.summary,
            "params": [param.to_json() for param in cls.params.values()],
        }
        for name, cls in SCHEDULES.items()
    ]


def _warmup(step: Any, warmup_steps: int, m: Math) -> Any:
    # (step + 1) / warmup: the first update already moves, the last warmup step is full lr.
    return m.where(step < warmup_steps, (step + 1.0) / max(warmup_steps, 1), 1.0)
