"""step_cost compares an update with the framework's built-in of comparable state: an optimizer
with two state tensors per variable (Adam-like) against AdamW, one with at most one against
SGD(momentum=0.9), so an Adam-like optimizer is never flagged for being Adam-like."""

from __future__ import annotations

import pytest

from jobs.checks.runner import run_checks
from tests.checks.tables import target_of

CASES = [
    ("torch.optim:Adam", "torch.optim.AdamW"),
    ("torch.optim:NAdam", "torch.optim.AdamW"),
    ("torch.optim:SGD", "torch.optim.SGD(momentum=0.9)"),
    ("keras.optimizers:Adam", "AdamW"),
    ("keras.optimizers:SGD", "SGD(momentum=0.9)"),
    ("tf_keras.optimizers.legacy:Adam", "legacy Adam"),
]


@pytest.mark.parametrize(("target", "yardstick"), CASES, ids=[c[0] for c in CASES])
def test_the_yardstick_has_comparable_state(target: str, yardstick: str) -> None:
    check = run_checks(target_of(target), {}, only=["step_cost"]).checks[0]
    assert f", {yardstick} " in check.detail, check.detail
    assert check.status in ("pass", "warn"), check.detail  # step_cost only ever warns
