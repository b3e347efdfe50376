"""torch classes whose arguments are accepted and do not act as given (a value in no group that no
step reads, a maximize or foreach switch that does not meet torch's definition), whose steps vary
from run to run without drawing a random number (an order taken from ids), and the wording of a
recipe's group values and of a step slow by its op calls."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import state_checks, tools  # noqa: E402
from jobs.checks.context import CheckContext, LoopSetup  # noqa: E402
from jobs.checks.fresh.resume import resume_exact  # noqa: E402
from jobs.checks.runner import validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402
from jobs.frameworks import torch_driver  # noqa: E402
from optimizers.hyperparams import Param  # noqa: E402


def context(name: str, tmp_path: Path, setup: LoopSetup | None = None, **params: object) -> CheckContext:
    target = resolve_target(f"{__name__}:{name}", framework="torch")
    params = validated_params(target, params)
    return CheckContext(target=target, params=params, workdir=tmp_path, setup=setup or LoopSetup())


class PlainLoop(torch.optim.Optimizer):
    """SGD with momentum over `update`, each parameter in order; subclasses change one thing."""

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in self.order(group["params"]):
                if p.grad is not None:
                    self.update(p, p.grad, group)
        return loss

    def order(self, params: list[Any]) -> Any:
        return params

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
        state["momentum"].mul_(group["momentum"]).add_(grad)
        p.add_(state["momentum"], alpha=-group["lr"])


# -- run to run: order nondeterminism is not randomness -----------------------------------------------


class OrderFromTheClock(PlainLoop):
    """A global norm summed in an order that changes from run to run (as a set of the parameters'
    does, the probe's f13, whose order follows their ids), weighted by position so that every order
    sums to another value, a float32 rounding apart (about 1e-6); nothing is drawn. The clock, not a
    set, so that the order surely differs between the runs a test compares."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        with torch.no_grad():
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            orders = list(itertools.permutations(params))
            total = torch.zeros(())
            for p in orders[time.perf_counter_ns() // 1000 % len(orders)]:
                total = total * (1 - 2**-20) + p.grad.pow(2).sum()  # apart at rounding's scale only
            for p in params:
                p.grad.mul_(0.5 / (total.sqrt() + 1e-6))
        return super().step(closure)


class GlobalNoise(PlainLoop):
    """Noise from torch's global generator (SGLD)."""

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        super().update(p, grad + 1e-3 * torch.randn_like(p), group)


class OwnGenerator(PlainLoop):
    """Noise from a generator of its own, seeded from the OS: in its attributes."""

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, lr, momentum)
        self.generator = torch.Generator()
        self.generator.seed()

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        noise = torch.randn(p.shape, generator=self.generator)
        super().update(p, grad + 1e-3 * noise, group)


class SharedGenerator(PlainLoop):
    """Noise from a generator its class holds, seeded from the OS (a module-level one is found the
    same way, from the class's module)."""

    generator = torch.Generator()

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        noise = torch.randn(p.shape, generator=SharedGenerator.generator)
        super().update(p, grad + 1e-3 * noise, group)


SharedGenerator.generator.seed()


class GeneratorPerStep(PlainLoop):
    """Noise from a generator made in each step, seeded from the OS: held nowhere, but its random op
    runs."""

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        generator = torch.Generator()
        generator.seed()
        super().update(p, grad + 1e-3 * torch.randn(p.shape, generator=generator), group)


class _NumpyNoise:
    """A helper object holding an unseeded numpy generator: not among the optimizer's attributes, and
    numpy's draws are no torch op."""

    def __init__(self) -> None:
        import numpy as np

        self.rng = np.random.default_rng()

    def like(self, p: Any) -> Any:
        return torch.from_numpy(self.rng.standard_normal(tuple(p.shape)).astype("float32"))


class HiddenNumpyNoise(PlainLoop):
    """SGLD-style noise of 1e-3 from `_NumpyNoise`: runs apart far beyond an order's rounding."""

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, lr, momentum)
        self.source = _NumpyNoise()

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        super().update(p, grad + 1e-3 * self.source.like(p), group)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("HiddenNumpyNoise", "draws"),
        ("OrderFromTheClock", "varies"),
        ("GlobalNoise", "draws"),
        ("OwnGenerator", "draws"),
        ("SharedGenerator", "draws"),
        ("GeneratorPerStep", "draws"),
        ("PlainLoop", "alike"),
    ],
)
def test_only_evidence_of_drawing_makes_a_class_random(name: str, expected: str, tmp_path: Path) -> None:
    """The probe's f13 had been called a class that draws by design (param_groups and graph_mode
    skipped) though it draws nothing; classes that do draw, from whatever generator, still are."""
    ctx = context(name, tmp_path)
    assert tools.run_to_run(ctx) == expected
    assert tools.draws_randomly(ctx) == (expected == "draws")


def test_resume_exact_blames_the_order_not_an_attribute(tmp_path: Path) -> None:
    """Told before to keep state out of class attributes, which the class does not have."""
    outcome = resume_exact(context("OrderFromTheClock", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "draws no random numbers" in outcome.detail and "iterating a set" in outcome.detail
    assert tools.VARIES_WITHOUT_DRAWING_FIX in outcome.detail
    assert "class attribute" not in outcome.detail


# -- arguments accepted and never acting ------------------------------------------------------------


class NusLost(PlainLoop):
    """QHAdam's fault (the probe's f14): `nus` stored as `nu`, and read back under its own name with a
    default, so the value given never acts."""

    def __init__(self, params: Any, lr: float = 0.01, nus: tuple[float, float] = (0.7, 1.0)) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "momentum": 0.9, "nu": nus})

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        nu0, _ = group.get("nus", (0.7, 1.0))
        super().update(p, grad * nu0, group)


class NusKeptAsAttribute(PlainLoop):
    """`nus` kept as an attribute and read in the step: in no group, but it acts."""

    def __init__(self, params: Any, lr: float = 0.01, nus: tuple[float, float] = (0.7, 1.0)) -> None:
        super().__init__(params, lr)
        self.nus = nus

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        super().update(p, grad * self.nus[0], group)


class VerboseSwitch(PlainLoop):
    """A logging switch no step depends on, rightly."""

    def __init__(self, params: Any, lr: float = 0.01, verbose: bool = False) -> None:
        super().__init__(params, lr)
        self.verbose = verbose


class DecoupledSwitch(PlainLoop):
    """A switch for a mode that no decay turns off (lion-pytorch's `decoupled_weight_decay` with its
    default weight_decay=0): it acts once the decay is on, so it is not said never to act."""

    def __init__(
        self, params: Any, lr: float = 0.01, weight_decay: float = 0.0, decoupled_weight_decay: bool = False
    ) -> None:
        torch.optim.Optimizer.__init__(
            self, params, {"lr": lr, "momentum": 0.9, "weight_decay": weight_decay}
        )
        self.decoupled = decoupled_weight_decay

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        decay = group["weight_decay"] * (group["lr"] if self.decoupled else 1.0)
        p.mul_(1 - decay)
        super().update(p, grad, group)


class VariantRho(PlainLoop):
    """`rho` is put in the groups, and read, only for variant='exp' (A2Grad): a mode not taken at the
    default variant, not an argument that never acts."""

    def __init__(
        self, params: Any, lr: float = 0.01, rho: float = 0.5, variant: Literal["uni", "exp"] = "uni"
    ) -> None:
        defaults = {"lr": lr, "momentum": 0.9, **({"rho": rho} if variant == "exp" else {})}
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.variant = variant

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        super().update(p, grad * (group["rho"] if self.variant == "exp" else 1.0), group)


class MaximizeIgnored(PlainLoop):
    """Takes maximize, stores it, never reads it (the probe's f03)."""

    def __init__(self, params: Any, lr: float = 0.01, maximize: bool = False) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "momentum": 0.9, "maximize": maximize})


class MaximizeHonoured(MaximizeIgnored):
    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        super().update(p, -grad if group["maximize"] else grad, group)


class ClipFallback(PlainLoop):
    """A clip whose threshold a group may override, the constructor's kept as the fallback
    (`group.get("max_grad_norm", self.max_grad_norm)`): it acts, only past the checks' gradients."""

    def __init__(self, params: Any, lr: float = 0.01, max_grad_norm: float = 100.0) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "momentum": 0.9})
        self.max_grad_norm = max_grad_norm

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        limit = group.get("max_grad_norm", self.max_grad_norm)
        norm = grad.norm()
        super().update(p, grad * (limit / norm) if norm > limit else grad, group)


class ForeachDiffers(PlainLoop):
    """A foreach path that forgets a factor its loop applies (the probe's f08)."""

    def __init__(self, params: Any, lr: float = 0.01, foreach: bool | None = None) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "momentum": 0.9, "foreach": foreach})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["foreach"]:
                torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])
            else:
                for p in params:
                    p.add_(p.grad, alpha=-group["lr"] * 0.5)
        return None


@pytest.mark.parametrize(
    ("name", "status", "words"),
    [
        ("NusLost", "warn", "'nus' is accepted but kept in no param group"),
        ("MaximizeIgnored", "warn", "maximize is accepted but not honoured"),
        ("ForeachDiffers", "warn", "the foreach path computes another update"),
        ("NusKeptAsAttribute", "pass", "'nus' not in any group): a reload takes those from the constructor"),
        ("VerboseSwitch", "pass", "'verbose' not in any group"),
        ("DecoupledSwitch", "pass", "'decoupled_weight_decay' not in any group"),
        ("VariantRho", "pass", "'rho' not in any group"),
        ("MaximizeHonoured", "pass", "unchanged, carrying all 1 hyperparameters"),
        ("PlainLoop", "pass", "carrying all 2 hyperparameters"),
        ("ClipFallback", "pass", "'max_grad_norm' not in any group"),
    ],
)
def test_config_roundtrip_warns_of_arguments_that_never_act(
    name: str, status: str, words: str, tmp_path: Path
) -> None:
    """The probe's f14 had passed saying "'nus' not in any group ... so none is lost", and f03 and f08
    passed every check."""
    outcome = state_checks.check_config_roundtrip(context(name, tmp_path))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail
    if status == "warn":
        assert "so none is lost" not in outcome.detail


def test_the_ignored_argument_is_said_with_the_values_tried(tmp_path: Path) -> None:
    outcome = state_checks.check_config_roundtrip(context("NusLost", tmp_path))
    assert "nus=(0.7, 1.0) and (0.35, 0.5)" in outcome.detail
    assert f"did not change any of {state_checks.IGNORED_STEPS} steps" in outcome.detail


@pytest.mark.parametrize(
    "text", ["torch.optim:Adam", "torch.optim:SGD", "torch.optim:ASGD", "torch.optim:NAdam"]
)
def test_torchs_own_switches_meet_their_definition(text: str, tmp_path: Path) -> None:
    target = resolve_target(text, framework="torch")
    ctx = CheckContext(target=target, params=validated_params(target, {}), workdir=tmp_path)
    assert state_checks._switch_problems(ctx) == []


@pytest.mark.parametrize(
    ("kind", "value", "other"),
    [
        ("float_pair", (0.7, 1.0), (0.35, 0.5)),
        ("float_list", [0.9, 0.99], [0.45, 0.495]),
        ("bool", True, False),
        ("str", "adam", None),
    ],
)
def test_other_value_halves_each_number_of_a_tuple(kind: str, value: Any, other: Any) -> None:
    assert state_checks._other_value(Param(name="x", type=kind, default=value), value) == other  # type: ignore[arg-type]


# -- W1: a recipe's group values ------------------------------------------------------------------------


class DecayedSGD(PlainLoop):
    def __init__(self, params: Any, lr: float = 0.01, weight_decay: float = 0.1) -> None:
        torch.optim.Optimizer.__init__(
            self, params, {"lr": lr, "momentum": 0.9, "weight_decay": weight_decay}
        )

    def update(self, p: Any, grad: Any, group: dict[str, Any]) -> None:
        p.mul_(1 - group["lr"] * group["weight_decay"])
        super().update(p, grad, group)


def test_a_recipes_group_value_is_not_said_to_be_stored_otherwise(tmp_path: Path) -> None:
    """The pass had said "'weight_decay' stored as 0.0, given 0.1 ... per-group values and schedulers
    cannot reach them", of the value the recipe gave the group."""
    recipe = LoopSetup(
        param_groups=[
            {"match": {"ndim": ">=2"}, "params": {"weight_decay": 0.1}},
            {"match": "rest", "params": {"weight_decay": 0.0}},
        ]
    )
    outcome = state_checks.check_config_roundtrip(context("DecayedSGD", tmp_path, setup=recipe))
    assert outcome.status == "pass", outcome.detail
    assert "stored as" not in outcome.detail


# -- W2: a step slow by its op calls alone ------------------------------------------------------------


def test_per_op_overhead_is_told_to_fuse_the_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No host sync and most of the step outside the ops: told to drop host syncs and Python loops
    before (CautiousLion), which it does not have."""
    calls = torch_driver.PROFILED_CALLS
    slow = [SimpleNamespace(key="aten::copy_", count=48 * calls, self_cpu_time_total=100.0)]
    yardstick = [SimpleNamespace(key="aten::add_", count=8 * calls, self_cpu_time_total=50.0)]
    timed = {"slow": (slow, 1000.0, 0), "yardstick": (yardstick, 200.0, 0)}
    monkeypatch.setattr(torch_driver, "_aten_events", lambda update: timed[update()])
    spent = torch_driver.TorchDriver().where_time_goes(lambda: "slow", lambda: "yardstick")
    assert spent.in_tensor_ops and not spent.in_matrix_math
    assert "no host syncs" in spent.phrase and "per-op overhead" in spent.phrase
    assert "48 op calls a step against the yardstick's 8" in spent.phrase
