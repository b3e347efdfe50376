"""Three faults that passed every torch check: weight decay with the wrong sign, state that grows
every step, and a step count kept in the group and bumped once per parameter. Each is a warn; the
correct designs beside them (decay toward the start, cautious decay, a shrink that overshoots, a
bounded history, a group counter bumped once a step) stay silent."""

from __future__ import annotations

import collections
import inspect
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import build_checks, torch_only  # noqa: E402
from jobs.checks.context import CheckContext  # noqa: E402
from jobs.checks.runner import validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402


def context(text: str, tmp_path: Path, **params: object) -> CheckContext:
    target = resolve_target(text, framework="torch")
    return CheckContext(target=target, params=validated_params(target, params), workdir=tmp_path)


def line_of(class_name: str, code: str) -> str:
    """`file:line` of the first line of `class_name`'s step() that holds `code`."""
    lines, first = inspect.getsourcelines(inspect.unwrap(globals()[class_name].step))
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{__file__}:{first + offset}"


class _PlainSGD(torch.optim.Optimizer):
    """SGD whose decay a subclass applies, in `decay`."""

    def __init__(self, params: Any, lr: float = 0.01, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.decay(p, group)
                    p.add_(p.grad, alpha=-group["lr"])

    def decay(self, p: Any, group: dict[str, Any]) -> None:
        p.mul_(1 - group["lr"] * group["weight_decay"])


class WrongSignDecaySGD(_PlainSGD):
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 + group["lr"] * group["weight_decay"])
                    p.add_(p.grad, alpha=-group["lr"])


class WrongSignWdSGD(torch.optim.Optimizer):
    """The decay under the name `wd`, read into a local first."""

    def __init__(self, params: Any, lr: float = 0.01, wd: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "wd": wd})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            wd = group["wd"]
            if wd != 0:
                for p in group["params"]:
                    p.add_(p, alpha=group["lr"] * wd)
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


class DecoupledDecaySGD(_PlainSGD):
    pass


class OvershootingDecaySGD(_PlainSGD):
    """A right decay at a rate so large that 1 - lr * wd is below -1: the weights grow, flipping sign."""

    def __init__(self, params: Any, lr: float = 10.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(p.grad, alpha=-1e-3)


class DecayTowardStartSGD(_PlainSGD):
    """Decay toward the initial weights (as in fine-tuning's L2-SP): nothing happens at the start."""

    def decay(self, p: Any, group: dict[str, Any]) -> None:
        start = self.state[p].setdefault("start", p.detach().clone())
        p.sub_(p - start, alpha=group["lr"] * group["weight_decay"])


class CautiousDecaySGD(_PlainSGD):
    """Decay only where the update points the same way as the weight: a zero update decays nothing."""

    def decay(self, p: Any, group: dict[str, Any]) -> None:
        mask = (p.grad * p > 0).to(p.dtype)
        p.sub_(p * mask, alpha=group["lr"] * group["weight_decay"])


class NormKeepingDecaySGD(_PlainSGD):
    """Decay, then the weight scaled back to its norm at the start (Nero's constraint)."""

    def decay(self, p: Any, group: dict[str, Any]) -> None:
        norm = self.state[p].setdefault("norm", p.norm())
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.mul_(norm / p.norm())


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (f"{__name__}:WrongSignDecaySGD", 'p.mul_(1 + group["lr"] * group["weight_decay"])'),
        (f"{__name__}:WrongSignWdSGD", 'p.add_(p, alpha=group["lr"] * wd)'),
        (f"{__name__}:DecoupledDecaySGD", None),
        (f"{__name__}:OvershootingDecaySGD", None),
        (f"{__name__}:DecayTowardStartSGD", None),
        (f"{__name__}:CautiousDecaySGD", None),
        (f"{__name__}:NormKeepingDecaySGD", None),
        ("torch.optim:AdamW", None),
        ("torch.optim:Adam", None),
        ("torch.optim:SGD", None),
    ],
)
def test_weight_decay_that_grows_the_weights_is_a_warn_at_its_line(
    text: str, line: str | None, tmp_path: Path
) -> None:
    """It passed: no check asked which way the decay acts."""
    outcome = build_checks.check_dense_step(context(text, tmp_path))
    if line is None:
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "warn", outcome.detail
    assert "weight decay makes the weights larger" in outcome.detail, outcome.detail
    assert f"`{line}`" in outcome.detail, outcome.detail
    assert outcome.where == line_of(text.split(":")[1], line), outcome.where


class HistorySGD(torch.optim.Optimizer):
    """An integral term kept as every past gradient, summed again each step."""

    def __init__(self, params: Any, lr: float = 0.01, bound: int | None = None) -> None:
        super().__init__(params, {"lr": lr})
        self.bound = bound

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("history", self.new_history())
                history.append(p.grad.clone())
                p.add_(torch.stack(list(history)).mean(0), alpha=-group["lr"])

    def new_history(self) -> Any:
        return []


class BoundedHistorySGD(HistorySGD):
    def new_history(self) -> Any:
        return collections.deque(maxlen=20)


class LongBoundedHistorySGD(HistorySGD):
    """Still growing at the first comparison, bounded long before the second."""

    def new_history(self) -> Any:
        return collections.deque(maxlen=200)


@pytest.mark.parametrize(
    ("text", "grows"),
    [
        (f"{__name__}:HistorySGD", True),
        (f"{__name__}:BoundedHistorySGD", False),
        (f"{__name__}:LongBoundedHistorySGD", False),
        ("torch.optim:Adam", False),
    ],
)
def test_state_that_grows_every_step_is_a_warn_naming_it(text: str, grows: bool, tmp_path: Path) -> None:
    """Only step_cost had warned, calling the cost "by design" and telling to fuse passes."""
    outcome = build_checks.check_dense_step(context(text, tmp_path))
    if not grows:
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "warn", outcome.detail
    assert "the optimizer's state keeps growing" in outcome.detail, outcome.detail
    assert "state[param 0]['history'], state[param 1]['history']" in outcome.detail, outcome.detail
    assert "collections.deque(maxlen=...)" in outcome.detail, outcome.detail


class _GroupStepAdam(torch.optim.Optimizer):
    """Adam with its step count kept in the group."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    def update(self, p: Any, lr: float, step: int) -> None:
        state = self.state[p]
        if not state:
            state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
        state["m"].lerp_(p.grad, 0.1)
        state["v"].lerp_(p.grad * p.grad, 0.001)
        m, v = state["m"] / (1 - 0.9**step), state["v"] / (1 - 0.999**step)
        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-lr)


class GroupStepPerParameterAdam(_GroupStepAdam):
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                group["step"] = group.get("step", 0) + 1
                self.update(p, group["lr"], group["step"])


class GroupStepPerStepAdam(_GroupStepAdam):
    """Distributed Shampoo's way: one count per group, bumped once a step."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                self.update(p, group["lr"], group["step"])


@pytest.mark.parametrize(
    ("name", "counts_parameters"),
    [("GroupStepPerParameterAdam", True), ("GroupStepPerStepAdam", False)],
)
def test_a_group_step_count_bumped_once_per_parameter_is_a_warn(
    name: str, counts_parameters: bool, tmp_path: Path
) -> None:
    """It passed: a single-group optimizer over the same parameters counts the same wrong way."""
    outcome = torch_only.check_param_groups(context(f"{__name__}:{name}", tmp_path))
    if not counts_parameters:
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "warn", outcome.detail
    assert "param group 0's 'step' rises by 3 a step, once per parameter" in outcome.detail, outcome.detail
    assert outcome.where == line_of(name, 'group["step"] = group.get("step", 0) + 1'), outcome.where
