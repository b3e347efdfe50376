"""The torch faults a probe of hand-written optimizers found named wrongly or missed: state that is one
tensor with a parameter, a zero_grad that does not clear, a mutable default changed by the steps,
parameters of one shape sharing a state tensor, a switch read from self.defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import build_checks, state_checks, tools, torch_only  # noqa: E402
from jobs.checks.context import CheckContext  # noqa: E402
from jobs.checks.fresh.resume import resume_exact  # noqa: E402
from jobs.checks.runner import validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402


def context(text: str, tmp_path: Path, **params: object) -> CheckContext:
    target = resolve_target(text, framework="torch")
    return CheckContext(target=target, params=validated_params(target, params), workdir=tmp_path)


def line_of(cls: type, text: str) -> str:
    """`file:line` of the first line of this file holding `text` below the class statement."""
    lines = Path(__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"class {cls.__name__}("))
    number = next(i for i in range(start, len(lines)) if text in lines[i]) + 1
    return f"{__file__}:{number}"


# --- state that is one tensor with a parameter -------------------------------------------------------


class DecayToInit(torch.optim.Optimizer):
    """SGD with momentum and decay toward the initial weights (L2-SP), the initial weights kept with
    `p.detach()`, no clone: they move with the parameter, and the decay never acts."""

    def __init__(
        self, params: Any, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.1
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["init"] = p.detach()
                    state["buf"] = torch.zeros_like(p)
                d = p.grad.add(p - state["init"], alpha=group["weight_decay"])
                state["buf"].mul_(group["momentum"]).add_(d)
                p.add_(state["buf"], alpha=-group["lr"])
        return loss


class AliasedLookahead(torch.optim.Optimizer):
    """Lookahead over SGD with momentum putting the slow weights back with `p.data = slow` every k
    steps: after step k the parameter and its slow weights are one tensor."""

    def __init__(
        self, params: Any, lr: float = 0.01, momentum: float = 0.9, k: int = 5, alpha: float = 0.5
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "k": k, "alpha": alpha})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["buf"] = torch.zeros_like(p)
                    state["slow"] = p.clone()
                state["step"] += 1
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])
                if state["step"] % group["k"] == 0:
                    state["slow"].lerp_(p, group["alpha"])
                    p.data = state["slow"]
        return loss


def test_state_kept_as_a_view_of_the_parameter_fails_naming_the_sharing(tmp_path: Path) -> None:
    """A one-step twin cannot show it (the kept view equals the parameter at that moment): several
    steps do, and the fail names the sharing, its line and the clone."""
    outcome = state_checks.check_state_untrainable(context(f"{__name__}:DecayToInit", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "['init'] share storage with a model parameter" in outcome.detail, outcome.detail
    assert outcome.where == line_of(DecayToInit, 'state["init"] = p.detach()')
    assert "p.detach().clone()" in outcome.detail


def test_slow_weights_put_back_with_p_data_fail_after_the_k_th_step(tmp_path: Path) -> None:
    """Lookahead at k=5 shares storage only from step 5: looked at after each step, it is seen."""
    outcome = state_checks.check_state_untrainable(context(f"{__name__}:AliasedLookahead", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "['slow'] share storage" in outcome.detail and "(from step 5)" in outcome.detail
    assert outcome.where == line_of(AliasedLookahead, 'p.data = state["slow"]')
    assert "p.copy_(saved)" in outcome.detail


def test_the_round_trips_blame_the_sharing_not_an_attribute(tmp_path: Path) -> None:
    """A reload gives the kept weights a copy of their own: state_roundtrip and resume_exact say so,
    not "a Python attribute"."""
    ctx = context(f"{__name__}:DecayToInit", tmp_path)
    for outcome in (state_checks.check_state_roundtrip(ctx), resume_exact(ctx)):
        assert outcome.status == "fail", outcome.detail
        assert "share storage with a model parameter" in outcome.detail, outcome.detail
        assert "a Python attribute" not in outcome.detail
        assert "p.detach().clone()" in outcome.detail


# --- a zero_grad override that does not clear ---------------------------------------------------------


class PlainSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)
        return loss


class ZeroGradNoop(PlainSGD):
    """`p.grad.zero_` without the call: the gradients are never cleared."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_  # noqa: B018


class ZeroGradOwn(PlainSGD):
    """A zero_grad of its own that clears, without set_to_none: no fault."""

    def zero_grad(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def test_a_zero_grad_that_does_not_clear_fails_at_the_override(tmp_path: Path) -> None:
    ctx = context(f"{__name__}:ZeroGradNoop", tmp_path)
    outcome = build_checks.check_none_grads(ctx)
    assert outcome.status == "fail", outcome.detail
    assert (
        "zero_grad(set_to_none=True) and zero_grad(set_to_none=False) left gradients nonzero"
        in outcome.detail
    )
    assert outcome.where == line_of(ZeroGradNoop, "def zero_grad")
    assert "p.grad.zero_()" in outcome.detail
    resumed = resume_exact(ctx)
    assert resumed.status == "fail" and "gradients pile up across steps" in resumed.detail, resumed.detail
    assert resumed.where == outcome.where
    own = build_checks.check_none_grads(context(f"{__name__}:ZeroGradOwn", tmp_path))
    assert own.status == "pass", own.detail


class FreeingSGD(PlainSGD):
    """Frees each gradient once its step has used it (as fused-backward optimizers do): its zero_grad()
    has nothing left to clear and is a no-op by design. No fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: step() frees every gradient it used."""


class StateZeroSGD(PlainSGD):
    """Momentum SGD clearing the gradients of the parameters it has stepped (those holding state), as a
    loop only ever asks it to after a step. No fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    p.sub_(buf.mul_(0.9).add_(p.grad), alpha=group["lr"])
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.state:
            p.grad = None


@pytest.mark.parametrize("name", ["FreeingSGD", "StateZeroSGD"])
def test_a_zero_grad_is_judged_after_a_step_as_a_loop_calls_it(name: str, tmp_path: Path) -> None:
    """Gradients set on an optimizer that never stepped are no loop's: these clear every gradient a
    step leaves, and pass."""
    outcome = build_checks.check_none_grads(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == "pass", outcome.detail


# --- a mutable default changed by the steps -----------------------------------------------------------


class AnnealedBetaSGD(torch.optim.Optimizer):
    """Momentum annealed toward 0.99 in place in the group's list, which is the default list itself."""

    def __init__(self, params: Any, lr: float = 0.01, betas: list[float] = [0.5, 0.5]) -> None:  # noqa: B006
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            betas = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(betas[0]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
            betas[0] = min(0.99, betas[0] + 0.1)
        return None


class TupleBetaSGD(AnnealedBetaSGD):
    """The same with a tuple default copied into a list of its own: no fault."""

    def __init__(self, params: Any, lr: float = 0.01, betas: tuple[float, float] = (0.5, 0.5)) -> None:
        super().__init__(params, lr, list(betas))


def test_a_default_list_changed_by_the_steps_is_named_and_not_called_random(tmp_path: Path) -> None:
    ctx = context(f"{__name__}:AnnealedBetaSGD", tmp_path)
    assert tools.run_to_run(ctx) != "draws"  # the runs differ since each starts from a later default
    outcome = state_checks.check_config_roundtrip(ctx)
    assert outcome.status == "fail", outcome.detail
    assert "the class changed the default `betas` (written [0.5, 0.5], " in outcome.detail, outcome.detail
    assert " after 3 steps) of AnnealedBetaSGD.__init__" in outcome.detail
    assert "every optimizer built later without that argument starts from the changed value" in outcome.detail
    assert outcome.where == line_of(AnnealedBetaSGD, "def __init__")
    assert "a tuple" in outcome.detail
    copied = state_checks.check_config_roundtrip(context(f"{__name__}:TupleBetaSGD", tmp_path))
    assert copied.status == "pass", copied.detail


class ExcludeSGD(PlainSGD):
    """Completes its list default once, alike every time, in __init__; no step writes it. No fault."""

    def __init__(self, params: Any, lr: float = 0.01, exclude: list[str] = ["bias"]) -> None:  # noqa: B006
        if "norm" not in exclude:
            exclude.append("norm")
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "exclude": exclude})


def test_a_default_list_completed_once_in_init_is_no_fault(tmp_path: Path) -> None:
    """Judged by what the steps do to it, not against the source: built before (as earlier checks do),
    it holds ['bias', 'norm'], which no step changes."""
    ExcludeSGD([torch.zeros(2, requires_grad=True)])
    outcome = state_checks.check_config_roundtrip(context(f"{__name__}:ExcludeSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail


def test_a_default_list_changed_earlier_is_put_back_and_still_fails(tmp_path: Path) -> None:
    """Changed already by earlier steps (at its cap, where further steps leave it): put back to the
    value written first, the steps change it again."""
    AnnealedBetaSGD.__init__.__defaults__[1][:] = [0.99, 0.5]  # type: ignore[index]
    assert tools.changed_defaults(context(f"{__name__}:AnnealedBetaSGD", tmp_path)) == [
        "`betas` (written [0.5, 0.5], [0.7999999999999999, 0.5] after 3 steps) of AnnealedBetaSGD.__init__"
    ]


# --- an add_param_group override that drops the group's values ----------------------------------------


class MomentumSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
        return loss


class DropsGroupValues(MomentumSGD):
    """Keeps only params and lr of a group: a group's own momentum is lost."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        lr = param_group.get("lr", self.defaults["lr"])
        super().add_param_group({"params": param_group["params"], "lr": lr})


def test_an_add_param_group_override_that_drops_values_is_named(tmp_path: Path) -> None:
    """Not the lr line it reads self.defaults in: the override that keeps only part of the group."""
    outcome = torch_only.check_param_groups(context(f"{__name__}:DropsGroupValues", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "the class's own add_param_group()" in outcome.detail, outcome.detail
    assert "holds other values of momentum than given" in outcome.detail
    assert outcome.where == line_of(DropsGroupValues, "def add_param_group")
    assert "super().add_param_group(param_group)" in outcome.detail


# --- a torch op without a bfloat16 kernel -------------------------------------------------------------


class EighPreconditioned(MomentumSGD):
    """Preconditions matrices by an eigendecomposition, which torch does not compute in bfloat16."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.ndim == 2:
                    _, vectors = torch.linalg.eigh(g.T @ g + torch.eye(g.shape[1], dtype=g.dtype))
                    g = g @ vectors @ vectors.T
                p.add_(g, alpha=-group["lr"])
        return loss


def test_an_op_without_a_bfloat16_kernel_fails_with_the_float32_fix(tmp_path: Path) -> None:
    outcome = torch_only.check_mixed_precision(context(f"{__name__}:EighPreconditioned", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "torch has no bfloat16 kernel of `linalg_eigh_cpu`" in outcome.detail, outcome.detail
    assert outcome.where == line_of(EighPreconditioned, "torch.linalg.eigh(")
    assert "compute that op in float32 (`x.float()`) and cast the result back" in outcome.detail


# --- parameters of one shape sharing a state tensor ---------------------------------------------------


class MomentumByShape(MomentumSGD):
    """One momentum buffer per shape "to save memory": parameters of equal shape mix their momenta."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        by_shape: dict[Any, Any] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = by_shape.setdefault(p.shape, torch.zeros_like(p))
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])
        return None


class ScratchByShape(MomentumSGD):
    """A scratch tensor per shape, shared on purpose and overwritten before each use: no fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        scratch: dict[Any, Any] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                    state["scratch"] = scratch.setdefault(p.shape, torch.empty_like(p))
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                torch.mul(state["buf"], group["lr"], out=state["scratch"])
                p.sub_(state["scratch"])
        return None


def test_parameters_of_one_shape_sharing_a_buffer_fail_naming_the_key(tmp_path: Path) -> None:
    outcome = state_checks.check_state_untrainable(context(f"{__name__}:MomentumByShape", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert (
        "two parameters of one shape (4, 3), given different gradients, hold one state tensor under 'buf'"
        in (outcome.detail)
    )
    assert outcome.where == line_of(MomentumByShape, 'state["buf"] = by_shape.setdefault')
    assert "a state tensor of its own" in outcome.detail
    scratch = state_checks.check_state_untrainable(context(f"{__name__}:ScratchByShape", tmp_path))
    assert scratch.status == "pass", scratch.detail


class GroupNormSGD(MomentumSGD):
    """SGD normalised by an EMA of the group's global gradient norm: one group-level tensor [ema, count]
    that every parameter of the group holds (so state_dict saves it with them). Coupled by design: no
    fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            stats = next((self.state[p]["stats"] for p in params if "stats" in self.state[p]), None)
            if stats is None:
                stats = torch.zeros(2)
            for p in params:
                self.state[p]["stats"] = stats
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))
            stats[0].mul_(0.9).add_(norm * 0.1)
            stats[1].add_(1)
            scale = stats[0] / (1 - 0.9 ** stats[1])
            for p in params:
                p.add_(p.grad / (scale + 1e-8), alpha=-group["lr"])
        return None


class GroupSquareSGD(GroupNormSGD):
    """The same with a group-level tensor shaped as the checks' two equal parameters are, (4, 3): held
    by the parameter of another shape too, it is the group's, not a buffer kept per shape. No fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            held = (self.state[p]["sums"] for p in params if "sums" in self.state[p])
            shared = next(held, torch.zeros(4, 3))
            for p in params:
                self.state[p]["sums"] = shared
            shared.add_(sum(float(p.grad.abs().sum()) for p in params))
            for p in params:
                p.add_(p.grad / float(shared[0, 0]), alpha=-group["lr"])
        return None


@pytest.mark.parametrize("name", ["GroupNormSGD", "GroupSquareSGD"])
def test_a_group_level_tensor_every_parameter_holds_is_no_buffer_per_shape(name: str, tmp_path: Path) -> None:
    """Of another shape than the parameters', or held by a parameter of another shape too: coupled by
    design, it passes."""
    outcome = state_checks.check_state_untrainable(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == "pass", outcome.detail
