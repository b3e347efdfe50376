"""The runner: a construct fail for an accepted invalid value still runs the other checks;
one that cannot build the optimizer at all skips them with the reason."""

from __future__ import annotations

from pathlib import Path

from jobs.checks.runner import run_checks
from tests.checks.tables import target_of

FIRST_TWO = ["construct", "dense_step"]

UNVALIDATED = """
import torch


class Unvalidated(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
"""

UNBUILDABLE = """
import torch


class Unbuildable(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        raise RuntimeError("this optimizer never builds")

    def step(self, closure=None):
        return None
"""


def test_an_accepted_invalid_value_fails_construct_but_the_rest_still_runs(tmp_path: Path) -> None:
    path = tmp_path / "unvalidated.py"
    path.write_text(UNVALIDATED)
    report = run_checks(target_of(f"{path}:Unvalidated"), {}, only=FIRST_TWO, workdir=tmp_path)
    construct, dense_step = report.checks
    assert construct.status == "fail" and "lr=-0.001 was accepted" in construct.detail
    assert dense_step.status == "pass", dense_step.detail


def test_an_optimizer_that_cannot_be_built_skips_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "unbuildable.py"
    path.write_text(UNBUILDABLE)
    report = run_checks(target_of(f"{path}:Unbuildable"), {}, only=FIRST_TWO, workdir=tmp_path)
    construct, dense_step = report.checks
    assert construct.status == "fail" and "this optimizer never builds" in construct.detail
    assert f"{path.name}:7" in construct.where
    assert dense_step.status == "skip" and "cannot be constructed" in dense_step.detail
