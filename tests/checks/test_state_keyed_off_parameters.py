"""State kept in `self.state` under keys that are not the parameters (`self.state[id(p)]`, an index): the
probe's `none_grads` failed with an error of optlab's own lookup ("Boolean value of Tensor with more
than one value is ambiguous", an int key hashing like the tensor), and `state_roundtrip` blamed "a
Python attribute, a dict of tensors it does not track", by up to inf."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import build_checks, state_checks  # noqa: E402
from jobs.checks.context import CheckContext  # noqa: E402
from jobs.checks.runner import validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402

SOURCE = """
import torch


class Momentum(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    def key(self, p, index):
        return p

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[self.key(p, index)]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


class ById(Momentum):
    def key(self, p, index):
        return id(p)


class ByIndex(Momentum):
    def key(self, p, index):
        return index


class CounterSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self._t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self._t += 1
        self.state['meta'] = {'version': 1}
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group['lr'] / self._t)
"""


def context(name: str, tmp_path: Path) -> CheckContext:
    path = tmp_path / "keyed.py"
    path.write_text(SOURCE)
    target = resolve_target(f"{path}:{name}", framework="torch")
    return CheckContext(target=target, params=validated_params(target, {}), workdir=tmp_path)


@pytest.mark.parametrize("name", ["ById", "ByIndex"])
def test_state_roundtrip_names_keys_that_are_not_parameters(name: str, tmp_path: Path) -> None:
    outcome = state_checks.check_state_roundtrip(context(name, tmp_path))
    assert outcome.status == "fail", outcome
    assert "keeps state under keys that are none of its parameters (int " in outcome.detail, outcome.detail
    assert "a Python attribute" not in outcome.detail and "up to inf" not in outcome.detail, outcome.detail
    assert "key per-parameter state by the parameter itself, `self.state[p]`" in outcome.detail


def test_state_keyed_by_parameter_passes(tmp_path: Path) -> None:
    assert state_checks.check_state_roundtrip(context("Momentum", tmp_path)).status == "pass"


@pytest.mark.parametrize("name", ["ById", "ByIndex", "Momentum"])
def test_none_grads_looks_state_up_by_identity(name: str, tmp_path: Path) -> None:
    """The step leaves a parameter without a gradient alone: a pass, whatever the keys."""
    outcome = build_checks.check_none_grads(context(name, tmp_path))
    assert outcome.status == "pass", outcome


def test_a_string_key_is_not_blamed_for_what_an_attribute_did(tmp_path: Path) -> None:
    """The review's: a step counter kept as an attribute the save misses (the fault), beside a string
    key in self.state, which torch's save keeps and a reload gives back under its name."""
    outcome = state_checks.check_state_roundtrip(context("CounterSGD", tmp_path))
    assert outcome.status == "fail", outcome
    assert "none of its parameters" not in outcome.detail, outcome.detail
    assert "self._t is 4" in outcome.detail, outcome.detail
