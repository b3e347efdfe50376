"""Schedules are pure `step -> multiplier` functions; torch renders them with LambdaLR."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
import torch

from optimizers.schedules import (
    SCHEDULES,
    Constant,
    Cosine,
    Exponential,
    LinearWarmup,
    Schedule,
    build_schedule,
    describe_schedules,
)

# (schedule, step, multiplier); every multiplier worked out by hand.
HAND_COMPUTED: list[tuple[Schedule, int, float]] = [
    (Constant(), 0, 1.0),
    (Constant(), 12345, 1.0),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=False), 0, 1.0),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=False), 5, 0.7071067811865476),  # 0.5 ** 0.5
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=False), 10, 0.5),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=False), 25, 0.1767766952966369),  # 0.5 ** 2.5
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=True), 0, 1.0),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=True), 9, 1.0),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=True), 10, 0.5),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=True), 19, 0.5),
    (Exponential(decay_steps=10, decay_rate=0.5, staircase=True), 25, 0.25),
    (Exponential(decay_steps=4, decay_rate=0.1, staircase=True), 8, 0.01),
    (LinearWarmup(warmup_steps=4), 0, 0.25),
    (LinearWarmup(warmup_steps=4), 1, 0.5),
    (LinearWarmup(warmup_steps=4), 2, 0.75),
    (LinearWarmup(warmup_steps=4), 3, 1.0),
    (LinearWarmup(warmup_steps=4), 100, 1.0),
    (LinearWarmup(warmup_steps=0), 0, 1.0),
    (Cosine(warmup_steps=0, min_ratio=0.0, total_steps=10), 0, 1.0),
    (Cosine(warmup_steps=0, min_ratio=0.0, total_steps=10), 5, 0.5),  # cos(pi/2) = 0
    (Cosine(warmup_steps=0, min_ratio=0.0, total_steps=12), 4, 0.75),  # (1 + cos(pi/3)) / 2
    (Cosine(warmup_steps=0, min_ratio=0.0, total_steps=10), 10, 0.0),
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 0, 0.25),  # warmup: (0 + 1) / 4
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 3, 1.0),
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 4, 1.0),  # decay starts at full rate
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 8, 0.55),  # 0.1 + 0.9 * 0.5
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 12, 0.1),
    (Cosine(warmup_steps=4, min_ratio=0.1, total_steps=12), 50, 0.1),  # held after the end
]


@pytest.mark.parametrize(("schedule", "step", "expected"), HAND_COMPUTED)
def test_value_at_step(schedule: Schedule, step: int, expected: float) -> None:
    assert schedule(step) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("warmup_steps", "min_ratio", "total_steps"), [(0, 0.0, 10), (5, 0.1, 50), (3, 1.0, 7)]
)
def test_cosine_ends_exactly_at_min_ratio(warmup_steps: int, min_ratio: float, total_steps: int) -> None:
    schedule = Cosine(warmup_steps=warmup_steps, min_ratio=min_ratio, total_steps=total_steps)
    assert schedule(total_steps) == min_ratio


def test_cosine_decreases_monotonically_after_warmup() -> None:
    schedule = Cosine(warmup_steps=10, min_ratio=0.05, total_steps=100)
    values = [schedule(step) for step in range(10, 101)]
    assert values == sorted(values, reverse=True)
    assert all(0.05 <= value <= 1.0 for value in values)


@pytest.mark.parametrize("name", ["linear_warmup", "cosine"])
@pytest.mark.parametrize("warmup_steps", [1, 7, 100])
def test_warmup_starts_at_one_over_warmup(name: str, warmup_steps: int) -> None:
    schedule = build_schedule(name, {"warmup_steps": warmup_steps}, total_steps=1000)
    assert schedule(0) == 1 / warmup_steps
    assert schedule(warmup_steps - 1) == 1.0


def test_build_schedule_uses_declared_defaults() -> None:
    assert build_schedule("constant", {}, total_steps=10) == Constant()
    assert build_schedule("exponential", {}, total_steps=10) == Exponential(
        decay_steps=100, decay_rate=0.5, staircase=False
    )
    assert build_schedule("linear_warmup", {}, total_steps=10) == LinearWarmup(warmup_steps=100)
    assert build_schedule("cosine", {}, total_steps=10) == Cosine(
        warmup_steps=0, min_ratio=0.0, total_steps=10
    )


def test_build_schedule_normalises_params() -> None:
    schedule = build_schedule("exponential", {"decay_steps": 10.0, "decay_rate": 1}, total_steps=0)
    assert schedule == Exponential(decay_steps=10, decay_rate=1.0, staircase=False)
    assert isinstance(schedule, Exponential)
    assert type(schedule.decay_steps) is int


def test_build_schedule_rejects_unknown_name_listing_known() -> None:
    with pytest.raises(ValueError) as caught:
        build_schedule("warmup_cosine", {}, total_steps=10)
    assert (
        str(caught.value)
        == "unknown schedule 'warmup_cosine'; known: constant, exponential, linear_warmup, cosine, "
        "piecewise_constant"
    )


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("exponential", {"decay_rate": 1.5}, "decay_rate must be a number in (0, 1]; received 1.5"),
        ("exponential", {"decay_rate": 0.0}, "decay_rate must be a number in (0, 1]; received 0.0"),
        ("exponential", {"decay_steps": 0}, "decay_steps must be an integer >= 1; received 0"),
        ("exponential", {"staircase": 1}, "staircase must be true or false; received 1"),
        ("linear_warmup", {"warmup_steps": -1}, "warmup_steps must be an integer >= 0; received -1"),
        ("linear_warmup", {"warmup_steps": 2.5}, "warmup_steps must be an integer >= 0; received 2.5"),
        ("cosine", {"min_ratio": -0.1}, "min_ratio must be a number in [0, 1]; received -0.1"),
        ("cosine", {"min_ratio": math.nan}, "min_ratio must be a number in [0, 1]; received NaN"),
        ("cosine", {"total_steps": 10}, "schedule 'cosine' has no hyperparameter 'total_steps'; accepted: "),
        (
            "linear_warmup",
            {"warmup": 10},
            "schedule 'linear_warmup' has no hyperparameter 'warmup'; accepted: ",
        ),
    ],
)
def test_build_schedule_rejects_bad_params(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        build_schedule(name, params, total_steps=10)
    assert str(caught.value).startswith(message)


def test_build_schedule_rejects_params_for_constant_saying_none_are_accepted() -> None:
    with pytest.raises(ValueError) as caught:
        build_schedule("constant", {"foo": 1}, total_steps=10)
    assert not str(caught.value).endswith("accepted: ")


def test_describe_schedules_is_json_serializable_and_complete() -> None:
    described = describe_schedules()
    assert json.loads(json.dumps(described)) == described
    assert [item["name"] for item in described] == list(SCHEDULES)
    by_name = {item["name"]: item for item in described}
    assert [param["name"] for param in by_name["exponential"]["params"]] == [
        "decay_steps",
        "decay_rate",
        "staircase",
    ]
    assert by_name["constant"]["params"] == []
    assert all(item["summary"] for item in described)


# --- rendered by torch: LambdaLR ------------------------------------------------------------------------

BASE_LR = 0.1
STEPS = 300
TORCH_CASES: list[tuple[str, dict[str, Any]]] = [
    ("constant", {}),
    ("exponential", {"decay_steps": 30, "decay_rate": 0.7}),
    ("exponential", {"decay_steps": 30, "decay_rate": 0.7, "staircase": True}),
    ("linear_warmup", {"warmup_steps": 25}),
    ("cosine", {"warmup_steps": 20, "min_ratio": 0.05}),
]
TORCH_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items())}" for name, params in TORCH_CASES]


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)


def _train(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int
) -> list[float]:
    """Run `steps` updates; return the lr each update actually applied (read inside its closure)."""
    applied: list[float] = []
    param = optimizer.param_groups[0]["params"][0]

    def closure() -> torch.Tensor:
        applied.append(optimizer.param_groups[0]["lr"])
        loss = (param**2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        optimizer.zero_grad()
        optimizer.step(closure)
        scheduler.step()
    return applied


@pytest.mark.parametrize(("name", "params"), TORCH_CASES, ids=TORCH_IDS)
def test_lambda_lr_applies_base_lr_times_schedule(name: str, params: dict[str, Any]) -> None:
    schedule = build_schedule(name, params, total_steps=STEPS)
    optimizer = _optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    applied = _train(optimizer, scheduler, STEPS)
    assert applied == [BASE_LR * schedule(step) for step in range(STEPS)]


@pytest.mark.parametrize(("name", "params"), TORCH_CASES, ids=TORCH_IDS)
def test_lambda_lr_state_survives_save_and_weights_only_load(name: str, params: dict[str, Any]) -> None:
    split = STEPS // 3
    straight_schedule = build_schedule(name, params, total_steps=STEPS)
    straight_optimizer = _optimizer()
    straight = _train(
        straight_optimizer,
        torch.optim.lr_scheduler.LambdaLR(straight_optimizer, straight_schedule),
        STEPS,
    )

    schedule = build_schedule(name, params, total_steps=STEPS)
    optimizer = _optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    first = _train(optimizer, scheduler, split)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    # Fresh objects, the schedule built with *other* settings: the saved ones must win.
    fresh_schedule = build_schedule(name, {}, total_steps=1)
    fresh_optimizer = _optimizer()
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, fresh_schedule)
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    fresh_scheduler.load_state_dict(loaded["scheduler"])
    assert fresh_schedule == straight_schedule
    assert fresh_scheduler.state_dict() == scheduler.state_dict()

    rest = _train(fresh_optimizer, fresh_scheduler, STEPS - split)
    assert first + rest == straight
