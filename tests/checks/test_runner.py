"""The runner: a construct fail for an accepted invalid value still runs the other checks;
one that cannot build the optimizer at all skips them with the reason; an error no line of the
class was on the way to is optlab's, not the class's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from jobs.checks import torch_only
from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, passed
from jobs.checks.runner import run_checks
from jobs.checks.tools import SHAPES, arrays, fresh
from jobs.frameworks.base import StateNotSaved
from tests.checks.tables import target_of

FIRST_TWO = ["construct", "dense_step"]

UNVALIDATED = """
import torch

from optimizers.hyperparams import unit_interval


class Unvalidated(torch.optim.Optimizer):
    optlab_hyperparameters = {"beta": unit_interval("beta")}  # declared, never enforced

    def __init__(self, params, lr=0.01, beta=0.0):
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta})

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
    assert construct.status == "fail" and "beta=1.001 was accepted" in construct.detail
    assert dense_step.status == "pass", dense_step.detail


def test_an_optimizer_that_cannot_be_built_skips_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "unbuildable.py"
    path.write_text(UNBUILDABLE)
    report = run_checks(target_of(f"{path}:Unbuildable"), {}, only=FIRST_TWO, workdir=tmp_path)
    construct, dense_step = report.checks
    assert construct.status == "fail" and "this optimizer never builds" in construct.detail
    assert f"{path.name}:7" in construct.where
    assert dense_step.status == "skip" and "cannot be constructed" in dense_step.detail


GRAD_IN_STEP = """
import torch


class GradInStep(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                torch.autograd.grad(p.sum(), p)  # under no_grad: torch raises, in its own code
"""


def _optlab_bug(ctx: CheckContext) -> Outcome:
    """A check's own mistake: no line of the class on the way."""
    empty: dict[str, str] = {}
    return passed(empty["no such key"])


def _steps_once(ctx: CheckContext) -> Outcome:
    """A check that steps the class: its error comes from torch, called by the class's step."""
    optimizer, variables = fresh(ctx)
    ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=1), ctx.needs)
    return passed("stepped")


def _known_fault(ctx: CheckContext) -> Outcome:
    """An error whose message names a known fault of a class, raised where no line of it is (legacy
    Keras grouping the None a class's update returned, after that update has returned)."""
    raise TypeError("'inputs' should be zero or more (nested) Tensors. Received 'None' with type NoneType")


def _framework_raises(ctx: CheckContext) -> Outcome:
    """A framework's code, called by a check with the class's objects, raising on them (torch.save
    pickling a lambda the class keeps in its state): the class's fault, with no line of it on the way."""
    import io

    import torch

    torch.save({"state": {0: {"scale": lambda x: x}}}, io.BytesIO())
    return passed("saved")


def _driver_says(ctx: CheckContext) -> Outcome:
    """A driver's own words about the class, raised in the driver (a Keras class's state that
    tf.train.Checkpoint cannot save): the class's fault, with the driver's fix."""
    raise StateNotSaved(
        "tf.train.Checkpoint cannot save the optimizer: `grads` hold(s) tensors", fix="keep them local"
    )


@pytest.mark.parametrize(
    ("check", "status", "words", "line"),
    [
        (_optlab_bug, "skip", "optlab's check failed: KeyError: 'no such key' (at tests/checks/test_", None),
        (_framework_raises, "fail", "raised AttributeError: Can't pickle local object", 5),
        (_driver_says, "fail", "cannot save the optimizer: `grads` hold(s) tensors (at ", 5),
        (_steps_once, "fail", "raised RuntimeError: element 0 of tensors does not require grad", 15),
        (_known_fault, "fail", "Fix: return the update op from _resource_apply_dense", 5),  # the class
    ],
)
def test_an_unexpected_error_is_the_class_fault_only_when_its_code_was_on_the_way(
    check: Callable[[CheckContext], Outcome],
    status: str,
    words: str,
    line: int | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "grad_in_step.py"
    path.write_text(GRAD_IN_STEP)
    monkeypatch.setitem(torch_only.CHECKS, "closure", check)
    (result,) = run_checks(target_of(f"{path}:GradInStep"), {}, only=["closure"], workdir=tmp_path).checks
    assert result.status == status, result.detail
    assert words in result.detail, result.detail
    if status == "skip":
        assert "not the class's fault" in result.detail and "please report it" in result.detail
    else:
        assert result.where == f"{path}:{line}", result.where


INHERITED_BASE = """
import torch


class LeanSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        raise RuntimeError("lean_sgd: an update this class never finished")
"""


def test_a_fault_in_a_method_inherited_from_another_file_is_located_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`class MyLean(LeanSGD): pass` (the way the README registers a published class): every fail had
    pointed at that line, not at the base's file where the fault is."""
    (tmp_path / "lean_base.py").write_text(INHERITED_BASE)
    registering = tmp_path / "lean_registered.py"
    registering.write_text("from lean_base import LeanSGD\n\n\nclass MyLean(LeanSGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (result,) = run_checks(
        target_of(f"{registering}:MyLean"), {}, only=["dense_step"], workdir=tmp_path
    ).checks
    assert result.status == "fail", result.detail
    assert result.where == f"{tmp_path / 'lean_base.py'}:13", result.where  # its raise


HANGS = """
import time

import torch


class WaitsForever(torch.optim.SGD):
    def __init__(self, params, lr=0.01):
        super().__init__(params, lr=lr)

    def step(self, closure=None):
        while True:  # a barrier no other process reaches
            try:
                time.sleep(3600)
            except Exception:
                pass
"""


def test_a_step_that_hangs_fails_its_check_at_the_time_limit_and_the_rest_are_not_started(
    tmp_path: Path,
) -> None:
    """`optlab check` on a class whose step never returns had hung for good (in CI: until the runner's
    own limit, with no table). The caller's SIGALRM timer (pytest-timeout's) runs on afterwards."""
    import signal

    path = tmp_path / "hangs.py"
    path.write_text(HANGS)
    before, _ = signal.getitimer(signal.ITIMER_REAL)
    report = run_checks(
        target_of(f"{path}:WaitsForever"),
        {},
        only=["dense_step", "descends"],
        workdir=tmp_path,
        time_limit_s=3.0,  # construct's builds alone can take 2 s on a busy machine: not run here
    )
    after, _ = signal.getitimer(signal.ITIMER_REAL)
    dense_step, descends = report.checks
    assert dense_step.status == "fail", dense_step
    assert dense_step.detail.startswith("did not end within 3 s: the class's code was still running")
    assert dense_step.where == f"{path}:{HANGS.splitlines().index('                time.sleep(3600)') + 1}"
    assert descends.status == "skip"
    assert descends.detail.startswith("not run: check dense_step did not end within 3 s, so the rest")
    assert (before == 0) == (after == 0) and after <= before  # given back, not restarted nor dropped


def test_a_check_stopped_in_optlabs_own_code_is_not_the_class_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check still busy in optlab's or a framework's code at the limit says the machine may be too
    busy to judge: the class's code was not what ran."""
    import time

    from jobs.checks import common

    monkeypatch.setitem(common.CHECKS, "schedule", lambda ctx: time.sleep(30) or passed("never"))
    path = tmp_path / "unvalidated.py"
    path.write_text(UNVALIDATED)
    report = run_checks(target_of(f"{path}:Unvalidated"), {}, only=["schedule"], time_limit_s=0.5)
    (schedule,) = report.checks
    assert schedule.status == "skip", schedule
    assert schedule.detail.startswith("not judged: did not end within 0.5 s, stopped in optlab's")


def test_the_time_limit_leaves_a_sooner_deadline_alone_and_gives_a_later_one_back() -> None:
    """pytest-timeout's alarm (or any caller's) had been put off for the whole check, or dropped."""
    import signal
    import time

    from jobs.checks.runner import RanPastLimit, _time_limit

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    previous_timer, _ = signal.getitimer(signal.ITIMER_REAL)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)  # later than the check's limit: given back
        with pytest.raises(RanPastLimit), _time_limit(0.2):
            time.sleep(5)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 98.0 < remaining < 100.0 and not fired
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # sooner than the check's limit: it fires as set
        with _time_limit(60.0):
            time.sleep(0.6)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if previous_timer:
            signal.setitimer(signal.ITIMER_REAL, previous_timer)
