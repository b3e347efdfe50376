"""The checks' paths that run only where CUDA is, driven on the CPU: CI has no GPU, and each of these
once misjudged a class only when one was there. GradScaler runs its own path on 'cpu'; torch's
'meta' device stands in for the accelerator of device_placement (state made without `device=` on
a meta parameter lands on the CPU, as it would next to a CUDA one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jobs.checks import state_checks, torch_only
from jobs.checks.context import CheckContext
from jobs.checks.runner import _outcome, checks_for_style, validated_params
from jobs.checks.target import resolve_target
from jobs.frameworks.torch_driver import TorchDriver
from optimizers.loop_needs import PLAIN, LoopNeeds

CHECKS = checks_for_style("torch")
ADAHESSIAN = "pytorch_optimizer.optimizer.adahessian:AdaHessian"


def context(text: str, tmp_path: Path) -> CheckContext:
    target = resolve_target(text, framework="torch")
    return CheckContext(target=target, params=validated_params(target, {}), workdir=tmp_path)


# --- mixed_precision: GradScaler ---------------------------------------------------------------------


@pytest.fixture
def cuda_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """mixed_precision as on a CUDA machine, its GradScaler step taken on the CPU (GradScaler('cpu'))."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_cuda = torch_only._grad_scaler_step
    monkeypatch.setattr(torch_only, "_grad_scaler_step", lambda ctx, device: on_cuda(ctx, "cpu"))


@pytest.mark.parametrize(
    ("needs", "words"),
    [
        (PLAIN, None),
        (LoopNeeds(train_eval=True, base_optimizer="optimizer"), None),
        (LoopNeeds(closure=True), "does not support step(closure)"),
        (LoopNeeds(backward_in_step=True), "does not support step(closure)"),
        (LoopNeeds(create_graph=True), "unscales only .grad"),
    ],
)
def test_grad_scaler_refuses_only_what_torch_does_not_support(needs: LoopNeeds, words: str | None) -> None:
    refused = torch_only._grad_scaler_refuses(needs)
    assert refused is None if words is None else words in (refused or ""), refused


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("torch.optim:LBFGS", "GradScaler skipped (torch's GradScaler does not support step(closure))"),
        (ADAHESSIAN, "GradScaler skipped (torch's GradScaler unscales only .grad"),
    ],
)
def test_mixed_precision_passes_closure_and_hessian_classes_on_cuda_saying_why_grad_scaler_is_skipped(
    text: str, words: str, cuda_here: None, tmp_path: Path
) -> None:
    if text == ADAHESSIAN:
        pytest.importorskip("pytorch_optimizer")
    outcome = _outcome("mixed_precision", CHECKS, context(text, tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert words in outcome.detail


class UnscaledExpSGD(torch.optim.Optimizer):
    """Says it unscales gradients itself (`_step_supports_amp_scaling`, as torch's fused optimizers do)
    and does not: an update of expm1(grad), about grad for small gradients, overflows on gradients
    65536 times too large. Only a GradScaler step shows it."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * torch.expm1(p.grad))
        return None


@pytest.mark.parametrize(
    ("text", "status", "words"),
    [
        ("torch.optim:Adam", "pass", "a float16 GradScaler step on cpu"),
        (f"{__name__}:UnscaledExpSGD", "fail", "parameters not finite after a GradScaler step"),
    ],
)
def test_mixed_precision_still_takes_the_grad_scaler_step_where_torch_supports_it(
    text: str, status: str, words: str, cuda_here: None, tmp_path: Path
) -> None:
    outcome = _outcome("mixed_precision", CHECKS, context(text, tmp_path))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail


# --- device_placement ----------------------------------------------------------------------------------


@pytest.fixture
def meta_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch driver's accelerator scope, its variables on 'meta' instead of CUDA."""
    accelerator = TorchDriver.accelerator
    monkeypatch.setattr(TorchDriver, "accelerator", lambda self: accelerator(self, "meta"))


class MomentumSGD(torch.optim.Optimizer):
    """SGD with momentum; `bare` makes the buffer with torch.zeros(p.shape), the bug: on the CPU
    next to a CUDA parameter in a job (which sets no default device). `squares` also keeps a
    second moment mixed with the gradient in an op that refuses two devices, as CUDA does."""

    bare = False
    squares = False

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros(p.shape) if self.bare else torch.zeros_like(p)
                    if self.squares:
                        state["square"] = torch.zeros(p.shape)
                state["momentum"].mul_(group["momentum"]).add_(p.grad)
                if self.squares:
                    state["square"].addcmul_(p.grad, p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])
        return None


class BareZerosSGD(MomentumSGD):
    bare = True


class BareSquaresSGD(MomentumSGD):
    squares = True


@pytest.mark.parametrize(
    ("name", "status", "words"),
    [
        ("MomentumSGD", "pass", "state sits on its variable's device"),
        ("BareZerosSGD", "fail", "state tensors on the wrong device after 2 steps: 'momentum' on cpu"),
        ("BareSquaresSGD", "fail", "a step on the accelerator raised RuntimeError"),
    ],
)
def test_device_placement_builds_and_steps_with_no_default_device(
    name: str, status: str, words: str, meta_accelerator: None, tmp_path: Path
) -> None:
    outcome = state_checks.check_device_placement(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail
    if status == "fail":
        assert "Fix: create state with torch.zeros_like(p)" in outcome.detail
        assert outcome.where.startswith(__file__), outcome.where


def test_device_placement_passes_torchs_own_adam_on_the_accelerator(
    meta_accelerator: None, tmp_path: Path
) -> None:
    # Its scalar step counter stays on the CPU on purpose (capturable=False).
    outcome = state_checks.check_device_placement(context("torch.optim:Adam", tmp_path))
    assert outcome.status == "pass", outcome.detail


def test_the_accelerator_scope_sets_no_default_device() -> None:
    driver = TorchDriver()
    scope = driver.accelerator("meta")
    assert scope is not None
    with scope:
        (variable,) = driver.variables([torch.ones(2).numpy()])
        assert variable.device.type == "meta"
        assert torch.zeros(2).device.type == "cpu"  # as in a job: no torch.device(...) context
    assert driver.variables([torch.ones(2).numpy()])[0].device.type == "cpu"
