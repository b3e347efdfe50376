"""Framework optimizers with unusual but legitimate semantics, beyond the ones the issue
names: the checks that once misjudged them, each run alone (fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from jobs.checks.runner import run_checks
from tests.checks.tables import target_of


@pytest.mark.parametrize(
    ("text", "check_id", "status", "says"),
    [
        # ASGD applies a rate derived from the previous step's lr: one step late, not ignored.
        ("torch.optim:ASGD", "schedule", "pass", "one step late"),
        # Rprop uses lr only to start its per-element step sizes: a schedule never reaches it.
        ("torch.optim:Rprop", "schedule", "fail", "never applied"),
        # Halving Rprop's etas would make them invalid: the group check must vary only what is valid.
        ("torch.optim:Rprop", "param_groups", "pass", "steps like a single-group optimizer"),
        # FTRL divides by the rate: the schedule is checked with positive rates.
        ("keras.optimizers:Ftrl", "schedule", "pass", "rates kept above 0"),
        ("tf_keras.optimizers.legacy:Ftrl", "schedule", "pass", "rates kept above 0"),
        # Legacy Nadam refuses schedules outright, with a clear message.
        ("tf_keras.optimizers.legacy:Nadam", "schedule", "warn", "refuses a LearningRateSchedule"),
        ("tf_keras.optimizers.legacy:Nadam", "config_roundtrip", "pass", "which the class refuses"),
        # Draws from numpy's and Python's global streams in every step (Kron, PSGD, PCGrad do):
        # a resume restores those streams too, so straight and resumed runs are bitwise equal.
        ("tests.checks.global_random_draws:GlobalRandomSGD", "resume_exact", "pass", ""),
        # The same draws compared in a sparse step and its dense twin: it had failed ("the rows a
        # row-sparse gradient touches differ by up to ..."), as Microsoft's Dion did.
        ("tests.checks.global_random_draws:GlobalRandomSGD", "sparse", "pass", ""),
    ],
)
def test_unusual_semantics_are_judged_fairly(
    text: str, check_id: str, status: str, says: str, tmp_path: Path
) -> None:
    (result,) = run_checks(target_of(text), {}, only=[check_id], workdir=tmp_path).checks
    assert (result.id, result.status) == (check_id, status), result.detail
    assert says in result.detail


class PlainSetSGD(torch.optim.SGD):
    """Refuses param groups in torch's documentation's words for them, as torchmin's Minimizer does."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        if len(self.param_groups) != 1:
            raise ValueError("PlainSetSGD doesn't support per-parameter options")


def test_a_refusal_of_per_parameter_options_is_a_refusal_of_groups(tmp_path: Path) -> None:
    text = "tests.checks.test_unusual_optimizers:PlainSetSGD"
    (result,) = run_checks(target_of(text), {}, only=["param_groups"], workdir=tmp_path).checks
    assert result.status == "skip", result.detail
    assert "refuses param groups with a clear error" in result.detail


class ForeignWordsSGD(torch.optim.SGD):
    """Refuses a bad rate in its author's language, quoting the value (Atiny: 学习速率, learning rate)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if lr <= 0:
            raise ValueError(f"Invalid 学习速率: {lr}")
        super().__init__(params, lr=lr)


class ScientificNotationSGD(torch.optim.SGD):
    """Quotes the refused rate in scientific notation: `-1.0e-03` is the -0.001 it was given."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if lr <= 0:
            raise ValueError(f"Ungültiger Wert: {lr:.1e}.")
        super().__init__(params, lr=lr)


class SilentRefusalSGD(torch.optim.SGD):
    """Refuses a bad rate with neither its name nor the value: still worth a warning (torch's lr > 0,
    which the class never declared, is input validation, not a fault of the update)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if lr <= 0:
            raise ValueError("invalid setting")
        super().__init__(params, lr=lr)


@pytest.mark.parametrize(
    ("name", "status"),
    [("ForeignWordsSGD", "pass"), ("ScientificNotationSGD", "pass"), ("SilentRefusalSGD", "warn")],
)
def test_a_refusal_quoting_the_value_names_it_in_any_words(name: str, status: str, tmp_path: Path) -> None:
    text = f"tests.checks.test_unusual_optimizers:{name}"
    (result,) = run_checks(target_of(text), {}, only=["construct"], workdir=tmp_path).checks
    assert result.status == status, result.detail


class ClosureOfOutputAndLoss(torch.optim.Optimizer):
    """Hessian-free style: the closure returns the loss and the model's output (for a Gauss-Newton
    product), and step() differentiates the loss itself."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        loss, _output = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        with torch.no_grad():
            for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
                param.add_(grad, alpha=-self.param_groups[0]["lr"])
        return loss


class StepOfItsOwnArguments(torch.optim.Optimizer):
    """CurveBall style: step(model_output, loss_fn), not torch's step(closure)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, model_output: Any, loss_fn: Any) -> Any:  # type: ignore[override]
        return loss_fn(model_output)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("ClosureOfOutputAndLoss", "a closure that returns more than the loss (`loss, _output = closure()`)"),
        ("StepOfItsOwnArguments", "arguments of its own in step() (model_output, loss_fn)"),
    ],
)
def test_a_step_contract_of_its_own_is_inconclusive_not_a_fault(name: str, says: str, tmp_path: Path) -> None:
    # Both had failed dense_step, quoting the TypeError of a step called as torch's loops call it.
    text = f"tests.checks.test_unusual_optimizers:{name}"
    (result,) = run_checks(target_of(text), {}, only=["dense_step"], workdir=tmp_path).checks
    assert result.status == "skip", result.detail
    assert says in result.detail


def test_a_closure_asked_for_the_loss_alone_returns_it_and_leaves_the_gradients(tmp_path: Path) -> None:
    # `closure(backward=False)` had raised "got an unexpected keyword argument 'backward'": a fail of
    # dense_step, and a job with the class failed at its first step.
    target = target_of("tests.checks.closure_contracts:LossOnlyLineSearch")
    report = run_checks(target, {}, workdir=tmp_path)
    failed = {r.id: r.detail for r in report.checks if r.status == "fail"}
    assert not failed, failed
    statuses = {r.id: r.status for r in report.checks}
    for check_id in ("dense_step", "descends", "closure", "resume_exact", "sparse", "mixed_precision"):
        assert statuses[check_id] == "pass", check_id


class GroupCounterMomentum(torch.optim.Optimizer):
    """Momentum with one step counter per group, the very tensor put under every parameter's state
    (Distributed Shampoo keeps its `step` so, for a checkpoint keyed by parameter). A parameter
    without a gradient is left alone; the group's counter counts on."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9, decay_idle: bool = False) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.decay_idle = decay_idle
        for group in self.param_groups:
            counter = torch.zeros((), dtype=torch.int64)
            for param in group["params"]:
                self.state[param]["step"] = counter
                self.state[param]["momentum"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.state[group["params"][0]]["step"].add_(1)
            for param in group["params"]:
                momentum = self.state[param]["momentum"]
                if param.grad is None:
                    if self.decay_idle:
                        momentum.mul_(group["beta"])
                    continue
                momentum.mul_(group["beta"]).add_(param.grad)
                param.add_(momentum, alpha=-group["lr"])
        return loss


class FlatBufferMomentum(torch.optim.Optimizer):
    """Momentum buffers are views of one flat buffer (as fused and sharded optimizers keep them), and
    the buffer of a parameter without a gradient decays: its state is updated, views or not."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        params_ = [p for group in self.param_groups for p in group["params"]]
        flat = torch.zeros(sum(p.numel() for p in params_))
        offset = 0
        for param in params_:
            self.state[param]["momentum"] = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
        self.flat = flat

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.flat.mul_(self.param_groups[0]["beta"])
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["momentum"].add_(param.grad)
                    param.add_(self.state[param]["momentum"], alpha=-group["lr"])
        return None


@pytest.mark.parametrize(
    ("name", "params", "status"),
    [
        ("GroupCounterMomentum", {}, "pass"),
        ("GroupCounterMomentum", {"decay_idle": True}, "fail"),
        ("FlatBufferMomentum", {}, "fail"),
    ],
)
def test_a_group_s_counter_under_every_parameter_is_not_a_parameter_s_state(
    name: str, params: dict[str, Any], status: str, tmp_path: Path
) -> None:
    # The counter failed none_grads ("the state of a variable that never had gradient (None) changed
    # by 2"): Distributed Shampoo's group step, aliased under each parameter, counted the group's steps.
    text = f"tests.checks.test_unusual_optimizers:{name}"
    (result,) = run_checks(target_of(text), params, only=["none_grads"], workdir=tmp_path).checks
    assert result.status == status, result.detail


@pytest.mark.parametrize("check_id", ["state_roundtrip", "resume_exact"])
def test_a_type_of_the_class_s_own_in_its_state_is_named_with_the_way_to_allow_it(
    check_id: str, tmp_path: Path
) -> None:
    # Distributed Shampoo keeps an enum and config dataclasses in param_groups: the fail had quoted the
    # first refused type only (resume_exact: torch's whole message, cut), and advised plain values alone.
    text = "tests.checks.own_types_in_groups:EnumDecaySGD"
    (result,) = run_checks(target_of(text), {}, only=[check_id], workdir=tmp_path).checks
    assert result.status == "fail", result.detail
    assert "tests.checks.own_types_in_groups.DecayKind" in result.detail
    assert "torch.serialization.add_safe_globals([DecayKind])" in result.detail
    # Allowed where the class is defined, as the advice says: the same state loads and resumes.
    allowed = "tests.checks.own_types_in_groups:AllowedEnumDecaySGD"
    (result,) = run_checks(target_of(allowed), {}, only=[check_id], workdir=tmp_path).checks
    assert result.status == "pass", result.detail


def test_a_deque_in_the_state_is_not_advised_to_be_allowed(tmp_path: Path) -> None:
    # Python's and numpy's types are better kept as tensors or lists: only a package's own are named.
    text = "tests.checks.broken.torch_state_roundtrip_weights_only:NormHistoryMomentum"
    (result,) = run_checks(target_of(text), {}, only=["state_roundtrip"], workdir=tmp_path).checks
    assert result.status == "fail", result.detail
    assert "collections.deque" in result.detail and "add_safe_globals" not in result.detail


class PlainZeroGradSGD(torch.optim.SGD):
    """A zero_grad() of its own that takes no argument, as fairscale's AdaScale proxies its base's."""

    def zero_grad(self) -> None:  # type: ignore[override]
        super().zero_grad()


@pytest.mark.parametrize("check_id", ["resume_exact", "distributed"])
def test_a_zero_grad_without_arguments_is_called_as_a_user_s_loop_calls_it(
    check_id: str, tmp_path: Path
) -> None:
    # Both had failed: "zero_grad() got an unexpected keyword argument 'set_to_none'", from the
    # fresh processes' loop, not from anything a user's `optimizer.zero_grad()` would meet.
    text = "tests.checks.test_unusual_optimizers:PlainZeroGradSGD"
    (result,) = run_checks(target_of(text), {}, only=[check_id], workdir=tmp_path).checks
    assert result.status == "pass", result.detail


class DataParallelOnlySGD(torch.optim.SGD):
    """Refuses to be built for one worker, as fairscale's AdaScale does without gradient accumulation."""

    def __init__(self, params: Any, lr: float = 0.1, world_size: int = 1) -> None:
        if world_size <= 1:
            raise RuntimeError("DataParallelOnlySGD does not support a single worker.")
        super().__init__(params, lr=lr)


def test_a_class_refusing_a_single_worker_is_inconclusive_not_a_fault(tmp_path: Path) -> None:
    # It had failed construct: "the constructor must accept every declared hyperparameter at its default".
    text = "tests.checks.test_unusual_optimizers:DataParallelOnlySGD"
    (result,) = run_checks(target_of(text), {}, only=["construct"], workdir=tmp_path).checks
    assert result.status == "skip", result.detail
    assert "builds only with more than one worker" in result.detail


def test_an_enum_hyperparameter_given_by_name_is_checked_as_the_member_it_builds_with(tmp_path: Path) -> None:
    # A group holds the member, the check's params the name: they are the same value.
    text = "tests.checks.own_types_in_groups:KindDecaySGD"
    stepped = [
        "construct",
        "dense_step",
        "config_roundtrip",
        "state_roundtrip",
        "resume_exact",
        "param_groups",
    ]
    report = run_checks(target_of(text), {"decay": "COUPLED"}, only=stepped, workdir=tmp_path)
    assert {r.id: r.status for r in report.checks} == dict.fromkeys(stepped, "pass"), report.checks
    (config,) = (r for r in report.checks if r.id == "config_roundtrip")
    assert "not there as given" not in config.detail  # "'decay' stored as <...COUPLED>, given 'COUPLED'"


class TinyStepSGD(torch.optim.SGD):
    """Steps 1e-10 of the gradient: too little for a float32 of magnitude 1 to change, as
    Mechanic's first steps are (its scale starts at s_init=1e-8)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-1e-10)
        return None


def test_steps_too_small_for_the_variables_are_inconclusive_and_say_so(tmp_path: Path) -> None:
    text = "tests.checks.test_unusual_optimizers:TinyStepSGD"
    (result,) = run_checks(target_of(text), {}, only=["dense_step"], workdir=tmp_path).checks
    assert result.status == "skip", result.detail
    assert "its steps are too small to change the larger ones" in result.detail


class ParamKeyedMomentum(torch.optim.SGD):
    """Keeps its momentum in a dict keyed by the parameters themselves under a state key of its own,
    as Mechanic does: a reload copies the keys, and the next step cannot find its parameters."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        own = self.state["_own"]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not own:
                    own.update({p: torch.zeros_like(p) for g in self.param_groups for p in g["params"]})
                own[param].mul_(0.9).add_(param.grad)
                param.add_(own[param], alpha=-group["lr"])
        return None


@pytest.mark.parametrize(
    ("check_id", "says"),
    [
        ("state_roundtrip", "keys differ (missing after reload: ['<Parameter of shape"),
        ("resume_exact", "KeyError: a Parameter of shape"),
    ],
)
def test_a_tensor_as_a_key_is_named_by_its_shape_not_its_values(
    check_id: str, says: str, tmp_path: Path
) -> None:
    # Both details had quoted whole tensors ("Parameter containing: tensor([[-0.3431, 0.0058, ...").
    text = "tests.checks.test_unusual_optimizers:ParamKeyedMomentum"
    (result,) = run_checks(target_of(text), {}, only=[check_id], workdir=tmp_path).checks
    assert result.status == "fail", result.detail
    assert says in result.detail and "tensor([" not in result.detail


@pytest.mark.parametrize(("name", "status"), [("MatricesOnlySGD", "skip"), ("SilentlyAssertingSGD", "fail")])
def test_a_step_refusing_shapes_with_an_assert_in_words_is_inconclusive(
    name: str, status: str, tmp_path: Path
) -> None:
    # Dion's Muon had failed dense_step: "raised AssertionError: Muon optimizer only supports matrix
    # parameters." (The classes live outside this module: pytest rewrites a test module's asserts.)
    text = f"tests.checks.asserting_steps:{name}"
    (result,) = run_checks(target_of(text), {}, only=["dense_step"], workdir=tmp_path).checks
    assert result.status == status, result.detail
    if status == "fail":  # the bare assert's own line says what it wants (it had said "AssertionError: ")
        assert "AssertionError: raised with no message by `assert param.ndim == 2`" in result.detail


def test_each_check_compiles_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dion compiles its math (`torch.compile(fullgraph=True)`); the checks feed it more shapes and
    # dtypes than one training run does, and three checks had failed with FailOnRecompileLimitHit.
    import torch._dynamo

    from jobs.frameworks.torch_driver import TorchDriver

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    double = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
    double(torch.ones(2))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # another shape, the same caches
        double(torch.ones(3))
    with TorchDriver().isolated():
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))


class ProjectingSGD(torch.optim.SGD):
    """Keeps every matrix's rows at unit norm, projecting them in its constructor too (as Nero does):
    building a second optimizer over saved values moves them by rounding. A resumed job loads its
    weights after building the optimizer; state_roundtrip had built over the values and failed by
    7e-9, "state the save does not see"."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self._project()

    @torch.no_grad()
    def _project(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 2:
                    p.div_(p.norm(dim=1, keepdim=True).add_(1e-3))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self._project()
        return loss


def test_a_constructor_that_changes_the_parameters_is_no_state_lost(tmp_path: Path) -> None:
    text = "tests.checks.test_unusual_optimizers:ProjectingSGD"
    (result,) = run_checks(target_of(text), {}, only=["state_roundtrip"], workdir=tmp_path).checks
    assert result.status == "pass", result.detail
