"""The torch check table (the common checks plus torch's own): good optimizers pass, each broken
one is caught by its own check."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import build_checks, cost_checks, rate_checks, state_checks, torch_only  # noqa: E402
from jobs.checks.context import CheckContext  # noqa: E402
from jobs.checks.report import CHECK_IDS  # noqa: E402
from jobs.checks.runner import checks_for_style, validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402
from optimizers.hyperparams import Param, unit_interval  # noqa: E402
from tests.checks.group_state import GroupStateSGD, PrivateDefaultSGD  # noqa: E402

BROKEN = Path(__file__).parent / "broken"
CHECKS = checks_for_style("torch")


def context(text: str, tmp_path: Path, **params: object) -> CheckContext:
    target = resolve_target(text, framework="torch")
    return CheckContext(target=target, params=validated_params(target, params), workdir=tmp_path)


def broken(name: str, tmp_path: Path) -> CheckContext:
    path = BROKEN / f"{name}.py"
    class_name = next(
        line.split()[1].split("(")[0] for line in path.read_text().splitlines() if line.startswith("class ")
    )
    return context(f"{path}:{class_name}", tmp_path)


def test_table_covers_every_torch_check() -> None:
    assert set(CHECKS) == set(CHECK_IDS) - {"save_load_model"}


FAST_CHECKS = [
    "construct",
    "dense_step",
    "descends",
    "none_grads",
    "schedule",
    "sparse",
    "config_roundtrip",
    "state_roundtrip",
    "param_groups",
    "closure",
    "mixed_precision",
    "state_untrainable",
    "deprecations",
]


@pytest.mark.parametrize("text", ["torch.optim:SGD", "torch.optim:Adam", "lion"])
def test_good_optimizers_pass_the_fast_checks(text: str, tmp_path: Path) -> None:
    ctx = context(text, tmp_path)
    for check_id in FAST_CHECKS:
        outcome = CHECKS[check_id](ctx)
        assert outcome.status == "pass", (check_id, outcome.detail)


@pytest.mark.parametrize(
    ("name", "check_id", "words"),
    [
        ("torch_construct_default", "construct", "cannot unpack non-iterable float"),
        ("torch_dense_step", "dense_step", "did not change"),
        ("torch_descends", "descends", "loss went from"),
        ("torch_none_grads", "none_grads", "grad is None"),
        ("torch_schedule", "schedule", "never applied"),
        ("torch_sparse", "sparse", "crashed inside the update"),
        ("torch_config_roundtrip", "config_roundtrip", "['lr'] was 0.005 and is 0.01"),
        ("torch_state_roundtrip", "state_roundtrip", "here self.momenta holds 3 array(s) (dict) that differ"),
        ("torch_state_roundtrip_weights_only", "state_roundtrip", "collections.deque"),
        (
            "torch_state_dict_drops_a_key",
            "state_roundtrip",
            "state_dict() leaves out state[param 0]['momentum_buffer']",
        ),
        ("torch_train_eval_mode", "state_roundtrip", "gives other variables than the saved ones"),
        ("torch_param_groups", "param_groups", "second param group"),
        ("torch_closure", "closure", "never called the closure"),
        ("torch_mixed_precision", "mixed_precision", "changed dtype"),
        ("torch_state_untrainable", "state_untrainable", "requires grad"),
    ],
)
def test_broken_optimizer_fails_its_check_at_the_users_file(
    name: str, check_id: str, words: str, tmp_path: Path
) -> None:
    ctx = broken(name, tmp_path)
    outcome = CHECKS[check_id](ctx)
    assert outcome.status == "fail", outcome.detail
    assert words in outcome.detail
    assert outcome.where.startswith(str(BROKEN / f"{name}.py")), outcome.where
    assert "Fix:" in outcome.detail


class StepWithoutClosure(torch.optim.Optimizer):
    """`def step(self)`: steps in a plain loop, and raises TypeError in one that passes a closure."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)


def test_a_step_that_takes_no_closure_fails_the_closure_check_saying_so(tmp_path: Path) -> None:
    outcome = torch_only.check_closure(context(f"{__name__}:StepWithoutClosure", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "step() takes no closure: torch.optim.Optimizer declares step(closure=None)" in outcome.detail
    assert "Fix: in step(closure=None)" in outcome.detail
    assert outcome.where.startswith(__file__), outcome.where


class CountedSGD(StepWithoutClosure):
    """Steps of lr / t, with the step count t a Python attribute: no checkpoint saves it."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.count = 0

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] / self.count * p.grad)


def test_state_roundtrip_names_the_attribute_a_checkpoint_does_not_save(tmp_path: Path) -> None:
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:CountedSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "the next step after reloading differs" in outcome.detail
    # Three steps, a save, a restore, and a next step on each.
    assert "here self.count is 4 in the uninterrupted optimizer and 1 in the restored one" in outcome.detail


def test_deprecated_overload_is_a_warning_with_the_users_line(tmp_path: Path) -> None:
    outcome = cost_checks.check_deprecations(broken("torch_deprecations", tmp_path))
    assert outcome.status == "warn"
    assert "add_" in outcome.detail
    source = (BROKEN / "torch_deprecations.py").read_text().splitlines()
    file, line = outcome.where.rsplit(":", 1)
    assert file == str(BROKEN / "torch_deprecations.py")
    assert "add_(" in source[int(line) - 1]


def test_row_loop_with_host_syncs_is_a_slow_step(tmp_path: Path) -> None:
    outcome = cost_checks.check_step_cost(broken("torch_step_cost", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "host syncs" in outcome.detail and "matrix math" not in outcome.detail
    assert outcome.figure is not None and outcome.figure > cost_checks.STEP_COST_LIMIT


def test_sparse_refusals_and_densifying(tmp_path: Path) -> None:
    refused = rate_checks.check_sparse(context("torch.optim:Adam", tmp_path))
    assert refused.status == "pass" and "refuses sparse" in refused.detail
    # torch's SGD with weight decay crashes inside an op on a sparse gradient: a fail.
    crashed = rate_checks.check_sparse(context("torch.optim:SGD", tmp_path, weight_decay=0.1))
    assert crashed.status == "fail" and "crashed inside the update" in crashed.detail
    dense = rate_checks.check_sparse(context(f"{__name__}:DecayEveryRow", tmp_path))
    assert dense.status == "warn" and "densifies" in dense.detail


PACKAGE_BASE = '''
import torch


class RowView(torch.optim.Optimizer):
    """A package's base class: its step reshapes each gradient, which a sparse one refuses."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad.view(-1).view(p.shape), alpha=-group["lr"])
'''


def test_a_sparse_crash_in_a_package_s_base_class_is_the_update_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code of the class's bases outside the framework counts as the class's (bitsandbytes' classes
    inherit their step): only a crash with none of it on the way is put down to the framework."""
    (tmp_path / "package_base.py").write_text(PACKAGE_BASE)
    (tmp_path / "leaf.py").write_text("from package_base import RowView\n\n\nclass Leaf(RowView): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    outcome = rate_checks.check_sparse(context(f"{tmp_path / 'leaf.py'}:Leaf", tmp_path))
    assert outcome.status == "fail" and "crashed inside the update" in outcome.detail, outcome.detail


class DecayEveryRow(torch.optim.Optimizer):
    """Decoupled weight decay on the whole table, then the sparse gradient's rows."""

    def __init__(self, params: object, lr: float = 0.1, weight_decay: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(p.grad, alpha=-group["lr"])


class DensifyingSGD(torch.optim.Optimizer):
    """SGD that turns each sparse gradient dense first (as a ported SM3 did: `grad = grad.to_dense()`):
    untouched rows get a zero update and stay put, yet every step costs the whole table. `how` picks
    the spelling of the conversion; "first step only" densifies once, to size its state (SM3's
    accumulators), which costs nothing per step; "one vector" flattens the dense gradient, as a method
    over all parameters as one vector does by design (LBFGS, torchmin's Minimizer)."""

    def __init__(self, params: object, lr: float = 0.1, how: str = "method") -> None:
        super().__init__(params, {"lr": lr, "how": how})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                grad, state = p.grad, self.state[p]
                if grad is None:
                    continue
                if not state:
                    state["rows"] = torch.zeros(p.shape[0]).add_(grad.to_dense().abs().sum(1))
                if not grad.is_sparse:
                    pass
                elif group["how"] == "method":
                    grad = grad.to_dense()
                elif group["how"] == "coalesced":
                    grad = torch.Tensor.to_dense(grad.coalesce())
                elif group["how"] == "one vector":  # as LBFGS and torchmin gather every gradient
                    grad = grad.to_dense().view(-1).view(p.shape)
                p.add_(grad, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("how", "status"),
    [("method", "warn"), ("coalesced", "warn"), ("first step only", "pass"), ("one vector", "pass")],
)
def test_a_step_that_turns_sparse_gradients_dense_is_told_so_at_its_line(
    how: str, status: str, tmp_path: Path
) -> None:
    """It had passed: the rows it leaves alone do not move, which was all `sparse` looked at."""
    outcome = rate_checks.check_sparse(context(f"{__name__}:DensifyingSGD", tmp_path, how=how))
    assert outcome.status == status, outcome.detail
    if status == "warn":
        assert "densifies: step() turns the sparse gradient into a dense tensor" in outcome.detail
        file, line = outcome.where.rsplit(":", 1)
        assert file == __file__ and "to_dense(" in Path(file).read_text().splitlines()[int(line) - 1]


@pytest.mark.parametrize("name", ["SparseAdam", "SGD", "Adagrad", "LBFGS"])
def test_torchs_sparse_updates_are_not_told_they_densify(name: str, tmp_path: Path) -> None:
    outcome = rate_checks.check_sparse(context(f"torch.optim:{name}", tmp_path))
    assert outcome.status == "pass", outcome.detail


class SortedRowsSGD(torch.optim.Optimizer):
    """SGD whose sparse path sorts the ids (for locality) and leaves their values in batch order:
    right only while a gradient's ids come sorted, which an Embedding's do not."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    rows = p.grad._indices()[0].sort().values
                    p.index_add_(0, rows, p.grad._values(), alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])


class LastRepeatMomentum(torch.optim.Optimizer):
    """Lazy momentum whose sparse path writes each id's momentum row once per id in the batch: with
    a repeated id the last write wins, so the repeat is lost from the momentum (the first step's
    update still sums it: only the next step shows it)."""

    def __init__(self, params: object, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                grad = p.grad
                if not grad.is_sparse:
                    buf.mul_(group["momentum"]).add_(grad)
                    p.add_(buf, alpha=-group["lr"])
                    continue
                rows, values = grad._indices()[0], grad._values()
                step = buf[rows] * group["momentum"] + values  # per id, repeats not summed
                buf[rows] = step  # a repeated id: the last write wins
                p.index_add_(0, rows, step, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("SortedRowsSGD", "differ by up to"),
        ("LastRepeatMomentum", "with a repeated index (ids [5, 2, 5], two steps)"),
    ],
)
def test_a_sparse_update_right_only_for_sorted_or_unique_ids_fails(
    name: str, words: str, tmp_path: Path
) -> None:
    outcome = rate_checks.check_sparse(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert words in outcome.detail, outcome.detail


class NewtonRows(torch.optim.Optimizer):
    """A Hessian-vector product through each gradient, as AdaHessian's: for rows with a gradient,
    p -= lr * g * (H v) with v all ones, the curvature kept; untouched rows stay. Call
    loss.backward(create_graph=True) before step() (what the entry reads as needing a graph)."""

    def __init__(self, params: object, lr: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})
        self.curvatures: list[torch.Tensor] = []

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                (curvature,) = torch.autograd.grad(p.grad, p, grad_outputs=torch.ones_like(p))
                self.curvatures.append(curvature.to_dense().detach())
                with torch.no_grad():
                    p.sub_(group["lr"] * p.grad.to_dense() * self.curvatures[-1])


def test_a_class_that_needs_a_graph_gets_a_sparse_gradient_with_one(tmp_path: Path) -> None:
    # The row-sparse gradient a job's nn.Embedding(sparse=True) gives under backward(create_graph=True)
    # has a graph; the check's must too, or a Hessian-vector product fails on the check's gradient
    # ("does not have grad_fn") where a job would not.
    from jobs.checks.tools import arrays
    from jobs.frameworks.base import SparseRows
    from jobs.frameworks.torch_driver import TorchDriver
    from optimizers.loop_needs import LoopNeeds

    driver, rows = TorchDriver(), [1, 3, 3]
    (table,) = driver.variables(arrays([(5, 2)], seed=0))
    before = table.detach().clone()
    values = arrays([(3, 2)], seed=1)[0]
    gradient = SparseRows(rows, values, (5, 2))
    optimizer = NewtonRows([table])
    driver.step(optimizer, [table], [gradient], LoopNeeds(create_graph=True))
    # The dense quadratic's Hessian is the identity: 1 on the rows the gradient touches (a repeated
    # row's shares add up to 1), 0 on the others, which it does not reach.
    (curvature,) = optimizer.curvatures
    assert torch.equal(curvature, torch.tensor([[0.0] * 2, [1.0] * 2, [0.0] * 2, [1.0] * 2, [0.0] * 2]))
    expected = before.clone()
    expected[1] -= 0.5 * torch.from_numpy(values[0])
    expected[3] -= 0.5 * torch.from_numpy(values[1] + values[2])  # a repeated row's gradients add up
    assert torch.allclose(table.detach(), expected), (table, expected)
    # Its step multiplies by `p.grad.to_dense()`: told so, and nothing else.
    outcome = rate_checks.check_sparse(context(f"{__name__}:NewtonRows", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert outcome.detail.startswith("sparse gradients work, but densifies: step() turns the sparse gradient")
    assert ";" not in outcome.detail


def test_construct_accepts_torch_wording_for_the_argument() -> None:
    assert build_checks.names_argument("Invalid learning rate: -0.001", "lr")
    assert build_checks.names_argument("Invalid beta parameter at index 0: -0.001", "betas")
    assert build_checks.names_argument("Invalid epsilon value: -1", "eps")
    assert build_checks.names_argument("beta_1 must be a number in [0, 1); received 1.0", "beta_1")
    assert not build_checks.names_argument("", "lr")
    assert not build_checks.names_argument("already failed", "lr")


class ComputedStep(torch.optim.Optimizer):
    """Computes its own step size; `lr` only fits the common signature and is never read."""

    def __init__(self, params: object, lr: float | None = None, scale: float = 0.1) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be a number > 0; received {scale}")
        super().__init__(params, {"lr": lr, "scale": scale})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["scale"] * p.grad / (1 + p.grad.norm()))


def test_an_lr_without_a_default_is_not_probed_with_a_negative_rate(tmp_path: Path) -> None:
    outcome = build_checks.check_construct(context(f"{__name__}:ComputedStep", tmp_path))
    assert outcome.status == "pass", outcome.detail
    # A class with a rate by default is still probed with a negative one (and warned).
    refused = build_checks.check_construct(broken("torch_construct", tmp_path))
    assert refused.status == "warn" and "lr=-0.001" in refused.detail, refused.detail


class PlainSGD(torch.optim.Optimizer):
    """Plain SGD steps (the closure called, its loss returned) for the constructors below."""

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


class PrivateNoiseSGD(PlainSGD):
    """SGLD-like: noise from a generator of its own, seeded in __init__; no checkpoint saves it."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.generator = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.sub_(group["lr"] * (p.grad + 0.01 * torch.randn(p.shape, generator=self.generator)))
        return None


def test_state_roundtrip_names_the_random_generator_a_checkpoint_does_not_save(tmp_path: Path) -> None:
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:PrivateNoiseSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "here self.generator is a random number generator (torch.Generator) the save does not hold" in (
        outcome.detail
    )


class NamedSGD(PlainSGD):
    """Takes `model.named_parameters()`, as adam-mini does (it splits them by name)."""

    def __init__(self, named_parameters: object, lr: float = 0.1) -> None:
        named = list(named_parameters)  # type: ignore[call-overload]
        params = [param for _, param in named]  # ValueError over a plain list of tensors
        super().__init__(params, {"lr": lr})


def test_a_class_that_takes_named_parameters_says_what_it_needs(tmp_path: Path) -> None:
    outcome = build_checks.check_construct(context(f"{__name__}:NamedSGD", tmp_path))
    assert outcome.status == "skip", outcome.detail
    assert "is built over the model (its 'named_parameters' argument)" in outcome.detail


class NamedOnlySGD(PlainSGD):
    """Takes named parameters under the usual `params` (torch's optimizers take either) and refuses
    plain ones, saying so."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        named = list(params)  # type: ignore[call-overload]
        if not all(isinstance(item, tuple) for item in named):
            raise TypeError("NamedOnlySGD expects named parameters: pass model.named_parameters()")
        super().__init__(named, {"lr": lr})


def test_a_class_that_takes_named_parameters_only_is_inconclusive_not_failed(tmp_path: Path) -> None:
    """It had failed construct, told to accept its hyperparameters at their defaults."""
    outcome = build_checks.check_construct(context(f"{__name__}:NamedOnlySGD", tmp_path))
    assert outcome.status == "skip", outcome.detail
    assert "over (name, parameter) pairs, as model.named_parameters() gives them, it builds" in outcome.detail


class Orthogonalized(PlainSGD):
    """Muon-like: each matrix's gradient orthogonalized by a few Newton-Schulz iterations (matrix
    products, no host syncs), vectors stepped plainly."""

    def __init__(self, params: object, lr: float = 0.02) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad / (p.grad.norm() + 1e-7)
                for _ in range(3) if p.ndim == 2 else ():
                    update = self.iteration(update)
                p.sub_(group["lr"] * update)
        return None

    @staticmethod
    def iteration(update: Any) -> Any:
        return 1.5 * update - 0.5 * update @ update.T @ update


class InPlaceOrthogonalized(Orthogonalized):
    """The same iterations written with in-place products (`addmm_`, as DASH's `baddbmm_`), which the
    profiler names with a trailing underscore."""

    @staticmethod
    def iteration(update: Any) -> Any:
        gram = update.new_zeros(update.shape[0], update.shape[0]).addmm_(update, update.T)
        return update.mul(1.5).addmm_(gram, update, alpha=-0.5)


class Eigendecomposed(Orthogonalized):
    """Shampoo-like: each matrix's update through the inverse square root of its Gram matrix, by
    torch.linalg.eigh, which on the CPU reads its LAPACK info with an aten::item: a host sync of the
    decomposition's own, not of the class's code (shampoo_lite had been told to drop its .item())."""

    @staticmethod
    def iteration(update: Any) -> Any:
        values, vectors = torch.linalg.eigh(update @ update.T + 1e-3 * torch.eye(update.shape[0]))
        return vectors @ torch.diag(values.rsqrt()) @ vectors.T @ update


@pytest.mark.parametrize("name", ["Orthogonalized", "InPlaceOrthogonalized", "Eigendecomposed"])
def test_a_step_slow_by_its_matrix_math_is_not_blamed_on_its_code(name: str, tmp_path: Path) -> None:
    outcome = cost_checks.check_step_cost(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == "warn" and "matrix math" in outcome.detail, outcome.detail
    fix = outcome.detail.split("Fix:")[1]
    assert cost_checks.MATRIX_MATH_FIX in fix and "host syncs" not in fix


class PerParameter(torch.optim.Optimizer):
    """The step loop of the test optimizers below: `update` each parameter that has a gradient."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group["lr"])
        return None

    def update(self, p: Any, lr: float) -> None:
        raise NotImplementedError


class ManyPasses(PerParameter):
    """SGD through twenty element-wise passes a parameter (as BCOS's powers, factored moments'
    reductions): whole tensors, no host syncs, no Python loop over elements. Twenty, not six: on a
    CPU with wide vector units six passes came to 2.5x the yardstick, under the warn's 3x."""

    def update(self, p: Any, lr: float) -> None:
        update = p.grad
        for _ in range(9):
            update = torch.tanh(update).mul(1.0001)
        p.sub_(lr * update)


def test_a_step_slow_by_its_element_wise_passes_is_told_to_fuse_them(tmp_path: Path) -> None:
    """Not told to drop host syncs and Python loops it does not have (BCOS, DAdaptAdan had been)."""
    outcome = cost_checks.check_step_cost(context(f"{__name__}:ManyPasses", tmp_path))
    assert outcome.status == "warn" and "passes over whole tensors" in outcome.detail, outcome.detail
    assert "op calls a step against the yardstick's" in outcome.detail
    fix = outcome.detail.split("Fix:")[1]
    assert "fuse the passes" in fix and "host syncs" not in fix


class DataParallelOnly(PlainSGD):
    """Shares its update across ranks (as Keller Jordan's Muon): needs a process group to step."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:
        torch.distributed.get_world_size()  # raises without init_process_group
        return super().step(closure)


def test_a_class_written_for_data_parallel_training_only_is_inconclusive_alone(tmp_path: Path) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is set up in this process")
    outcome = build_checks.check_dense_step(context(f"{__name__}:DataParallelOnly", tmp_path))
    assert outcome.status == "skip" and "distributed process group" in outcome.detail, outcome.detail


class CapturableAdamW(torch.optim.AdamW):
    """AdamW for CUDA graphs: capturable=True keeps the step count on the device, and torch's
    kernels refuse parameters on the CPU."""

    def __init__(self, params: object, lr: float = 1e-3) -> None:
        super().__init__(params, lr=lr, capturable=True)  # type: ignore[arg-type]


def test_a_class_whose_options_need_an_accelerator_is_inconclusive_on_the_cpu(tmp_path: Path) -> None:
    """Not a fail: on the GPU it was written for, the same class trains."""
    outcome = build_checks.check_dense_step(context(f"{__name__}:CapturableAdamW", tmp_path))
    assert outcome.status == "skip", outcome.detail
    assert "steps only with tensors on cuda or" in outcome.detail and "refuse the CPU" in outcome.detail
    assert "capturable=True" in outcome.detail  # torch's own words, in the error quoted


class CopiedSam(torch.optim.Optimizer):
    """SAM as davda54's is copied everywhere: the closure required by an assert, the weights put back
    with `p.data = old_p` (so the saved copy then is the parameter's storage), and no loss returned."""

    def __init__(self, params: object, lr: float = 0.1, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})  # type: ignore[arg-type]
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=lr)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * group["rho"] / (norm + 1e-12))
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()


class AliasedMomentum(PlainSGD):
    """A momentum buffer that is the parameter itself (`buf = p.data`): read at every step, so the
    aliasing changes the update."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    def step(self, closure: Any = None) -> Any:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    buf = self.state[p].setdefault("buf", p.data)
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])


def test_state_aliasing_a_parameter_fails_only_where_it_is_read(tmp_path: Path) -> None:
    """SAM's saved weights alias the parameter after `p.data = old_p` but are rewritten before they
    are read: no false alarm. A momentum buffer that is the parameter changes every update: a fail."""
    copied = state_checks.check_state_untrainable(context(f"{__name__}:CopiedSam", tmp_path))
    assert copied.status == "pass" and "harmless here" in copied.detail, copied.detail
    aliased = state_checks.check_state_untrainable(context(f"{__name__}:AliasedMomentum", tmp_path))
    assert aliased.status == "fail" and "share storage with a model parameter" in aliased.detail


class MatricesOnly(PlainSGD):
    """Refuses a vector in its own __init__, as GefenMuon and torch's Muon do."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"MatricesOnly only supports 2D parameters, found {tuple(p.shape)}")


def test_a_class_refusing_the_checks_vectors_in_its_constructor_is_inconclusive(tmp_path: Path) -> None:
    """Not "the constructor must accept every declared hyperparameter": over the matrix alone it builds."""
    outcome = build_checks.check_construct(context(f"{__name__}:MatricesOnly", tmp_path))
    assert outcome.status == "skip" and "refuses parameters of some shapes" in outcome.detail, outcome.detail


class NoneRate(PlainSGD):
    """`lr=None` in the signature, refused by the class itself (as CAME's `assert lr > 0.`)."""

    def __init__(self, params: object, lr: float | None = None) -> None:
        if lr is None or not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        super().__init__(params, {"lr": lr})


def test_a_none_default_the_class_refuses_is_judged_with_the_value_given(tmp_path: Path) -> None:
    alone = context(f"{__name__}:NoneRate", tmp_path)
    outcome = build_checks.check_construct(alone)
    assert outcome.status == "fail" and "default hyperparameters raised" in outcome.detail, outcome.detail
    assert alone.unbuildable
    given = context(f"{__name__}:NoneRate", tmp_path, lr=0.1)
    outcome = build_checks.check_construct(given)
    assert outcome.status == "pass", outcome.detail
    assert "builds with the given params (its defaults alone raise ValueError" in outcome.detail
    assert "lr must be given" in outcome.detail
    assert not given.unbuildable  # the other checks run with lr=0.1


class NoneRateStrictEps(NoneRate):
    """Refuses its own `eps` default too: the defaults fail for more than the missing lr."""

    def __init__(self, params: object, lr: float | None = None, eps: float = 0.0) -> None:
        if not eps > 0:
            raise ValueError(f"eps must be a number > 0; received {eps}")
        super().__init__(params, lr)


class RequiredRate(PlainSGD):
    """A required lr: still held to refusing a negative one."""

    def __init__(self, params: object, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        super().__init__(params, {"lr": lr})


def test_only_the_missing_values_are_excused_and_a_refused_none_is_still_probed(tmp_path: Path) -> None:
    # The defaults fail for eps as well as lr: giving lr excuses only lr's part.
    strict = build_checks.check_construct(context(f"{__name__}:NoneRateStrictEps", tmp_path, lr=0.1))
    assert strict.status == "fail" and "default hyperparameters raised ValueError: eps" in strict.detail
    # A None lr the class refuses, and a required lr, are rates it reads: a negative one is probed.
    for name in ("NoneRate", "RequiredRate"):
        outcome = build_checks.check_construct(context(f"{__name__}:{name}", tmp_path, lr=0.1))
        assert outcome.status == "pass" and "(lr)" in outcome.detail, (name, outcome.detail)
    # A required lr has no default to refuse: the class builds with the given one and nothing more
    # is said of its defaults (a required lr is not one the class refuses).
    required = build_checks.check_construct(context(f"{__name__}:RequiredUncheckedRate", tmp_path, lr=0.1))
    assert required.status == "warn" and "lr=-0.001 was accepted" in required.detail, required.detail
    assert "defaults alone" not in required.detail, required.detail


class RequiredUncheckedRate(PlainSGD):
    """A required lr, never validated (torch's old `lr=required` classes, e.g. SGDP)."""

    def __init__(self, params: object, lr: float) -> None:
        super().__init__(params, {"lr": lr})


class UncheckedRate(PlainSGD):
    """Never validates its lr, as KellerJordan's Muon and LiyuanLucasLiu's RAdam do."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})


class UncheckedDeclaredBeta(PlainSGD):
    """Declares beta's range [0, 1) and never enforces it: its own published promise, broken."""

    optlab_hyperparameters: ClassVar[dict[str, Param]] = {"beta": unit_interval("beta")}

    def __init__(self, params: object, lr: float = 0.1, beta: float = 0.9) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        super().__init__(params, {"lr": lr, "beta": beta})


@pytest.mark.parametrize(
    ("name", "status", "words"),
    [
        # torch's lr > 0, which the class never stated: input validation to add, not a fault (a bare
        # `assert lr > 0`, refusing it in words naming nothing, warns too: broken/torch_construct.py).
        ("UncheckedRate", "warn", "lr=-0.001 was accepted although lr must be a number > 0"),
        # A range the class declares itself, not enforced: a fault.
        ("UncheckedDeclaredBeta", "fail", "beta=1.001 was accepted although beta must be"),
    ],
)
def test_an_unchecked_rate_warns_and_an_unenforced_declared_range_fails(
    name: str, status: str, words: str, tmp_path: Path
) -> None:
    outcome = build_checks.check_construct(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail, outcome.detail
    assert "Fix: validate each argument in __init__ and raise ValueError naming it" in outcome.detail
    assert outcome.where.startswith(__file__), outcome.where


class ModesPerGroup(PlainSGD):
    """Keeps its mode in every group and starts in eval mode, as schedule-free classes do; refuses to
    step while any group is not training (a group added later starts in eval mode too)."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "train_mode": False})

    def train(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = True

    def eval(self) -> None:
        for group in self.param_groups:
            group["train_mode"] = False

    def step(self, closure: Any = None) -> Any:
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError("not in train mode: call optimizer.train() before step()")
        return super().step(closure)


def test_a_class_with_modes_is_stepped_in_training_mode_by_every_torch_check(tmp_path: Path) -> None:
    from jobs.checks import torch_only

    ctx = context(f"{__name__}:ModesPerGroup", tmp_path)
    for check in (torch_only.check_param_groups, torch_only.check_closure, torch_only.check_mixed_precision):
        outcome = check(ctx)
        assert outcome.status == "pass", outcome.detail
    outcome = cost_checks.check_step_cost(ctx)
    assert outcome.status in ("pass", "warn") and "not in train mode" not in outcome.detail, outcome.detail


class PowerFromDefaults(torch.optim.Optimizer):
    """A float hyperparameter written with an int default (`power: float = 1`), read from
    self.defaults instead of the group: a second group's own value is ignored."""

    def __init__(self, params: object, lr: float = 0.1, power: float = 1) -> None:
        super().__init__(params, {"lr": lr, "power": power})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad.sign() * p.grad.abs() ** self.defaults["power"])


def test_a_float_with_an_int_default_is_halved_as_a_float(tmp_path: Path) -> None:
    from jobs.checks import torch_only

    outcome = torch_only.check_param_groups(context(f"{__name__}:PowerFromDefaults", tmp_path))
    assert outcome.status == "fail" and "power=0.5" in outcome.detail, outcome.detail


class LocalsDefaults(PlainSGD):
    """Builds its defaults from locals(), as heavyball does: with super() in the body, its groups hold
    `__class__`, which its state_dict() writes as None (heavyball keeps the dict serializable)."""

    def __init__(self, params: object, lr: float = 0.1, momentum: float = 0.0) -> None:
        defaults = {k: v for k, v in locals().items() if k not in ("self", "params")}
        super().__init__(params, defaults)

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for group in saved["param_groups"]:
            group["__class__"] = None
        return saved


def test_a_dunder_key_in_the_groups_is_not_a_hyperparameter(tmp_path: Path) -> None:
    ctx = context(f"{__name__}:LocalsDefaults", tmp_path)
    assert "__class__" in ctx.build([torch.nn.Parameter(torch.zeros(2))]).param_groups[0]
    outcome = state_checks.check_config_roundtrip(ctx)
    assert outcome.status == "pass", outcome.detail
    assert "all 2 hyperparameters" in outcome.detail, outcome.detail


class Anneal:
    """A plain object as a group value, as Kron's ProbScheduler: no __eq__ of its own."""

    def __init__(self, start: float) -> None:
        self.start = start

    def __call__(self, step: int) -> float:
        return self.start / (1 + step)


class AnnealedSGD(PlainSGD):
    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "anneal": Anneal(0.5)})


def test_a_plain_object_in_the_groups_survives_as_an_equal_copy(tmp_path: Path) -> None:
    # load_state_dict() deep-copies the saved groups: the object comes back equal, not the same one.
    outcome = state_checks.check_config_roundtrip(context(f"{__name__}:AnnealedSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail
    from jobs.checks.tools import same_value

    assert same_value(Anneal(0.5), Anneal(0.5))
    assert not same_value(Anneal(0.5), Anneal(1.0))
    # Tensors of many elements compare by shape and values (DoG keeps lists of them in its groups).
    held, other = Anneal(0.5), Anneal(0.5)
    held.start, other.start = torch.ones(3), torch.ones(3)  # type: ignore[assignment]
    assert same_value(held, held) and same_value(held, other)
    other.start = torch.tensor([1.0, 1.0, 2.0])  # type: ignore[assignment]
    assert not same_value(held, other) and not same_value(torch.ones(3), torch.ones(4))
    # Values that hold each other: only identity says.
    held.start, other.start = held, other  # type: ignore[assignment]
    assert not same_value(held, other)


class DistanceSGD(PlainSGD):
    """Keeps per-group lists of tensors in its param groups, as DoG keeps its initial points and
    distances: a config that survives the round trip, which `==` on tensors could not say."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group.setdefault("start", [p.detach().clone() for p in group["params"]])
            group["distance"] = [
                torch.linalg.norm(p - s) for p, s in zip(group["params"], group["start"], strict=True)
            ]
        return super().step(closure)


def test_tensors_in_the_groups_are_compared_by_value(tmp_path: Path) -> None:
    """config_roundtrip had failed DoG with the checker's own error (`Boolean value of Tensor with
    more than one value is ambiguous`) pinned on the class."""
    outcome = state_checks.check_config_roundtrip(context(f"{__name__}:DistanceSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail


class CachesLeftOut(PlainSGD):
    """Drops every `_` key from the groups it saves, as heavyball's state_dict() does."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for group in saved["param_groups"]:
            for key in [k for k in group if k.startswith("_")]:
                del group[key]
        return saved


class StepCacheSGD(CachesLeftOut):
    """Keeps a per-step cache in each group (heavyball's `_sf_step`), which its next step rebuilds."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["_scale"] = torch.tensor(group["lr"])
        return super().step(closure)


class CountedStepCacheSGD(StepCacheSGD):
    """Counts its steps in a tensor kept in each group, in place (saved and restored by torch), beside
    its private cache: the next step that shows the cache rebuilt must not count as a changed value."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        for group in self.param_groups:
            group["step"] = torch.zeros((), dtype=torch.int64)

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"].add_(1)
        return super().step(closure)


class InitCacheSGD(CachesLeftOut):
    """A private value set once, in __init__, and left out of the save: the next step lacks it."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "_decay": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.mul_(1 - group["_decay"])
        return super().step(closure)


class DroppedMomentumSGD(PlainSGD):
    """Leaves a hyperparameter a user sets per group out of its save."""

    def __init__(self, params: object, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for group in saved["param_groups"]:
            del group["momentum"]
        return saved


@pytest.mark.parametrize(
    ("cls", "status", "says", "at"),
    [
        # A private cache the class's save leaves out on purpose and its next step rebuilds: no loss.
        (
            StepCacheSGD,
            "pass",
            "param_groups[0]['_scale'], left out by the class's own save on purpose, private by the leading "
            "underscore: a cache, not a hyperparameter, rebuilt by the next step",
            "",
        ),
        # Beside a group value the next step changes in place (a step count): compared as reloaded.
        (
            CountedStepCacheSGD,
            "pass",
            "param_groups[0]['_scale'], left out by the class's own save on purpose, private by the leading "
            "underscore: a cache, not a hyperparameter, rebuilt by the next step",
            "",
        ),
        # One the next step does without (read with a default): resume_exact judges what that does.
        (
            PrivateDefaultSGD,
            "pass",
            "param_groups[0]['_decay'], left out by the class's own save on purpose, private by the leading "
            "underscore: a cache, not a hyperparameter, not rebuilt by the next step, which ran without it",
            "",
        ),
        # Private but set only in __init__: the next step after a reload fails for want of it.
        (
            InitCacheSGD,
            "fail",
            "param_groups[0]['_decay'] was 0.01 and is missing after state_dict() -> load_state_dict(): "
            "the class's own state_dict() leaves it out of the groups it saves, and the next step after the "
            "reload raised KeyError: '_decay'",
            "state_dict",
        ),
        # A hyperparameter (no underscore) left out of the save stays a loss, said as missing (not None).
        (
            DroppedMomentumSGD,
            "fail",
            "param_groups[0]['momentum'] was 0.9 and is missing after state_dict() -> load_state_dict(): the "
            "class's own state_dict() leaves it out of the groups it saves",
            "state_dict",
        ),
        # Per-parameter state in a group: summarised, not printed, and told where state belongs.
        (
            GroupStateSGD,
            "fail",
            "param_groups[0]['state'] holds per-parameter state keyed by the parameters themselves "
            "({<Parameter of shape (4, 3)>: <Tensor of shape (4, 3)>, ... 3 entries})",
            "step",
        ),
    ],
    ids=[
        "rebuilt-cache",
        "rebuilt-cache-beside-a-count",
        "cache-done-without",
        "cache-a-step-needs",
        "hyperparameter",
        "per-parameter-state",
    ],
)
def test_group_keys_a_save_leaves_out_or_cannot_carry(
    cls: type, status: str, says: str, at: str, tmp_path: Path
) -> None:
    outcome = state_checks.check_config_roundtrip(context(f"{cls.__module__}:{cls.__name__}", tmp_path))
    assert outcome.status == status, outcome.detail
    assert says in outcome.detail, outcome.detail
    assert len(outcome.detail) < 600, outcome.detail  # a repr of every tensor had made 1,600
    if at:
        method = inspect.unwrap(getattr(cls, at))
        assert outcome.where == f"{inspect.getsourcefile(method)}:{inspect.getsourcelines(method)[1]}"
    if cls is GroupStateSGD:
        assert "Fix: keep per-parameter state in self.state[p]" in outcome.detail


class HalfMomentumSGD(PerParameter):
    """Momentum kept in bfloat16 beside float32 parameters (ProdigyPlusScheduleFree's `p0` and `s`),
    which torch's load_state_dict casts to float32."""

    def update(self, p: Any, lr: float) -> None:
        buffer = self.state[p].setdefault("momentum", torch.zeros_like(p, dtype=torch.bfloat16))
        buffer.mul_(0.9).add_(p.grad.to(torch.bfloat16))
        p.sub_(lr * buffer.float())


class RowCountSGD(PerParameter):
    """An int64 count per element (a lazy sparse Adam's row steps), which torch's load_state_dict
    casts to float32 too."""

    def update(self, p: Any, lr: float) -> None:
        count = self.state[p].setdefault("count", torch.zeros_like(p, dtype=torch.int64))
        count.add_(1)
        p.sub_(lr * p.grad / count)


class WideBoundSGD(PerParameter):
    """A running bound kept in float64 beside float32 parameters (heavyball's PSGD lower bound), which
    torch's load_state_dict casts down to float32: its values do not survive the cast."""

    def update(self, p: Any, lr: float) -> None:
        bound = self.state[p].setdefault("bound", torch.zeros((), dtype=torch.float64))
        bound.copy_(torch.maximum(bound * 0.99, p.grad.double().norm() / 3.0))
        p.sub_(lr * p.grad / (1.0 + bound.float()))


@pytest.mark.parametrize(
    ("name", "saved", "shape", "values"),
    [
        ("HalfMomentumSGD", "bfloat16", "[4, 3]", "the same values"),
        ("RowCountSGD", "int64", "[4, 3]", "the same values"),
        ("WideBoundSGD", "float64", "[]", "its values rounded by up to"),
    ],
)
def test_state_a_load_casts_to_another_dtype_is_named_with_its_cause(
    tmp_path: Path, name: str, saved: str, shape: str, values: str
) -> None:
    """Not "keep per-parameter state in self.state[p]", where it is: what torch's load does, and the
    fix, whether the values survive the cast (bfloat16 momentum, a count) or not (a float64 bound)."""
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert f"torch.{saved}{shape} saved, torch.float32{shape} after reload, {values}" in outcome.detail
    # What the recast does, by kind: another precision rounds the steps otherwise; a count keeps its
    # values (a probe's class resumed to bitwise the same parameters, and had been told otherwise).
    rounds = "the steps after a resume round otherwise than uninterrupted ones"
    assert (rounds in outcome.detail) == (saved != "int64"), outcome.detail
    if saved == "int64":
        assert "integer state comes back as torch.float32, exact for whole numbers up to 16,777,216" in (
            outcome.detail
        )
    assert (
        "torch's load_state_dict casts each state tensor (but `step`) of a floating-point" in outcome.detail
    )
    assert "Fix: cast such state back to its own dtype after loading" in outcome.detail
    # resume_exact's difference has the same cause: the load shows it, and the fix is the same one.
    resumed = CHECKS["resume_exact"](context(f"{__name__}:{name}", tmp_path))
    assert resumed.status == "fail", resumed.detail
    assert "loading the checkpoint changed its state: state_dict['state']" in resumed.detail
    assert "Fix: cast such state back to its own dtype after loading" in resumed.detail


class MomentumPerParameter(PerParameter):
    """Momentum and a per-step cache, kept in self.state[p]; a momentum missing starts afresh."""

    def update(self, p: Any, lr: float) -> None:
        state = self.state[p]
        buffer = state.setdefault("momentum", torch.zeros_like(p))
        buffer.mul_(0.9).add_(p.grad)
        state["last_grad"] = p.grad.clone()
        p.sub_(lr * buffer)


class PoppedSaveSGD(MomentumPerParameter):
    """Pops the momentum from what super().state_dict() returns, as SPAM's "save space" override:
    those dicts are self.state[p] itself, so each save wipes the momentum training goes on with."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("momentum", None)
        return saved


class ZeroedSaveSGD(MomentumPerParameter):
    """Zeroes the momentum in what it saves, in place: the live momentum with it."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum"].zero_()
        return saved


class HalvedSaveSGD(MomentumPerParameter):
    """Saves the momentum in bfloat16, written back into the dicts super().state_dict() returns."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum"] = entry["momentum"].to(torch.bfloat16)
        return saved


class PoppedCacheSGD(MomentumPerParameter):
    """Pops a cache every step writes afresh: the live state loses it, training does not."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("last_grad", None)
        return saved


class CopiedSaveSGD(MomentumPerParameter):
    """Leaves the momentum out of copies: the live state is intact, the save lacks it."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["state"] = {
            i: {k: v for k, v in e.items() if k != "momentum"} for i, e in saved["state"].items()
        }
        return saved


class WrappedPoppedSaveSGD(MomentumPerParameter):
    """PoppedSaveSGD's pop, in a save that wraps what super().state_dict() returns (a versioned
    format, a Lookahead's nested dicts): the entries under "wrapped" are self.state[p] itself too."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("momentum", None)
        return {"wrapped": [saved], "version": 2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["wrapped"][0])


class CountedMomentumSGD(MomentumPerParameter):
    """Counts its updates in a tensor, read as a number (`int(state['updates'])`): any kind works."""

    def update(self, p: Any, lr: float) -> None:
        state = self.state[p]
        state["updates"] = state.get("updates", torch.tensor(0.0)) + 1
        super().update(p, lr * (1 - 0.5 ** int(state["updates"])))


class FloatCountSaveSGD(CountedMomentumSGD):
    """Saves the count as a Python float, written into the live dicts, and loads it back as a tensor:
    the same value, another kind, which its own next step takes alike: no false alarm."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["updates"] = float(entry["updates"])
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            entry["updates"] = torch.tensor(entry["updates"])


class LazyCacheSaveSGD(MomentumPerParameter):
    """Keeps None for a statistic until asked, and fills it in as it saves: an addition, no change."""

    def update(self, p: Any, lr: float) -> None:
        self.state[p].setdefault("norm", None)
        super().update(p, lr)

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            if entry.get("norm") is None:
                entry["norm"] = entry["momentum"].norm()
        return saved


class FloatStepSaveAdam(torch.optim.Adam):
    """Saves Adam's step as a Python float (as older torch did), written into the live dicts: the
    round trip is exact (Adam's __setstate__ turns it back), but torch's Adam step raises on a float
    step, so a user's own training breaks at its first step after a save."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["step"] = float(entry["step"])
        return saved


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("FloatCountSaveSGD", None),
        ("LazyCacheSaveSGD", None),
        (
            "FloatStepSaveAdam",
            "state[param 0]['step'] turned from a torch.float32 tensor into a Python float of the same value "
            "(3.0): the next step then raises RuntimeError",
        ),
    ],
)
def test_a_value_a_save_swaps_for_the_same_value_is_named_only_where_the_next_step_sees_it(
    tmp_path: Path, name: str, says: str | None
) -> None:
    """It had been "replaced by other values" in every case (a lazy None filled in too): a note on a
    class that is right, and no fail for the one a user's own training breaks on."""
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:{name}", tmp_path))
    if says is None:
        assert outcome.status == "pass", outcome.detail
        assert "live state" not in outcome.detail, outcome.detail
        return
    assert outcome.status == "fail", outcome.detail
    assert says in outcome.detail, outcome.detail
    line = inspect.getsourcelines(globals()[name].state_dict)[1]
    assert outcome.where == f"{__file__}:{line}", outcome.where


@pytest.mark.parametrize(
    ("name", "status", "says"),
    [
        ("PoppedSaveSGD", "fail", "state[param 0]['momentum'] removed, state[param 1]['momentum'] removed"),
        # Wrapped: the saved entries are the live ones still, so putting them back had put the key back
        # into what is saved, and the round trip passed.
        (
            "WrappedPoppedSaveSGD",
            "fail",
            "state[param 0]['momentum'] removed, state[param 1]['momentum'] removed",
        ),
        ("ZeroedSaveSGD", "fail", "state[param 0]['momentum'] changed in place"),
        ("HalvedSaveSGD", "fail", "state[param 0]['momentum'] cast from torch.float32 to torch.bfloat16"),
        # No false alarm: what the save takes, the next step writes afresh.
        ("PoppedCacheSGD", "pass", "state[param 0]['last_grad'] removed"),
        # A save that copies keeps the message that names what it leaves out.
        ("CopiedSaveSGD", "fail", "state_dict() leaves out state[param 0]['momentum']"),
    ],
)
def test_a_state_dict_that_edits_the_live_state_is_named_with_its_line_and_fix(
    tmp_path: Path, name: str, status: str, says: str
) -> None:
    """A save and a reload of such a class agree (both lack what the save took): the checks compare the
    live state before and after the call, name what it removed or changed, and put it back."""
    roundtrip = state_checks.check_state_roundtrip(context(f"{__name__}:{name}", tmp_path))
    resumed = CHECKS["resume_exact"](context(f"{__name__}:{name}", tmp_path))
    if status == "pass":
        assert roundtrip.status == "pass", roundtrip.detail
        assert f"calling state_dict() changed the optimizer's live state ({says}" in roundtrip.detail
        assert roundtrip.detail.endswith("(rebuilt alike for the next step)"), roundtrip.detail
        assert resumed.status == "pass", resumed.detail
        return
    live = name != "CopiedSaveSGD"
    for outcome in (roundtrip, resumed):
        assert outcome.status == "fail", outcome.detail
        assert says in outcome.detail, outcome.detail
        assert ("calling state_dict() changed the optimizer's live state" in outcome.detail) == live
        if live:  # the override's line, and the fix for it
            method = inspect.unwrap(globals()[name].state_dict)
            assert outcome.where == f"{__file__}:{inspect.getsourcelines(method)[1]}", outcome.where
            assert "Fix: copy before editing what super().state_dict() returns" in outcome.detail


class CopiedPoppedCacheSGD(CountedMomentumSGD):
    """Pops the cache each step writes afresh from the live state (harmless), and leaves the momentum
    out of copies (the live state intact): the loss is the left-out momentum's, not the pop's."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("last_grad", None)
        saved["state"] = {
            i: {k: v for k, v in e.items() if k != "momentum"} for i, e in saved["state"].items()
        }
        return saved


def test_a_harmless_change_of_the_live_state_takes_neither_the_line_nor_the_fix_of_another_loss(
    tmp_path: Path,
) -> None:
    """Any change of the live state had moved every failure to state_dict() with its fix, the
    momentum left out of copies included."""
    line = inspect.getsourcelines(CopiedPoppedCacheSGD.state_dict)[1]
    for check in (state_checks.check_state_roundtrip, CHECKS["resume_exact"]):
        outcome = check(context(f"{__name__}:CopiedPoppedCacheSGD", tmp_path))
        assert outcome.status == "fail", outcome.detail
        assert "state_dict() leaves out state[param 0]['momentum']" in outcome.detail, outcome.detail
        assert "changed the optimizer's live state (state[param 0]['last_grad'] removed" in outcome.detail
        assert "Fix: copy before editing" not in outcome.detail, outcome.detail
        assert outcome.where != f"{__file__}:{line}", outcome.where


class DroppingLoadSGD(MomentumPerParameter):
    """Re-derives its state after a reload, and pops the momentum instead of casting it (NovoGrad's
    port): the save holds it, the loaded optimizer does not, and its next step starts it afresh."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            entry.pop("momentum", None)


class DroppingSetstateSGD(MomentumPerParameter):
    """The same, in __setstate__, through which torch's load_state_dict() sets the state."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for entry in self.state.values():
            entry.pop("momentum", None)


class CastingLoadSGD(MomentumPerParameter):
    """Overrides load_state_dict() and keeps every key (it casts one back): nothing to blame."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            entry["momentum"] = entry["momentum"].to(torch.float32)


class DroppingSetstateLoadingSGD(DroppingSetstateSGD):
    """Drops the momentum in __setstate__, and overrides load_state_dict() too, harmlessly."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)


class DroppingLoadZeroedCacheSGD(DroppingLoadSGD):
    """Its load_state_dict() drops the momentum, and its save zeroes the cache each step writes afresh,
    in the live state: the load is at fault, not the save."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["last_grad"] = torch.zeros_like(entry["last_grad"])
        return saved


@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("DroppingLoadSGD", "load_state_dict"),
        ("DroppingSetstateSGD", "__setstate__"),
        # Both defined: the one that drops it (had been load_state_dict, always).
        ("DroppingSetstateLoadingSGD", "__setstate__"),
        # A save that changes the live state harmlessly takes neither the line nor the fix.
        ("DroppingLoadZeroedCacheSGD", "load_state_dict"),
        ("CastingLoadSGD", None),
    ],
)
def test_a_key_the_class_s_own_load_drops_is_blamed_on_that_method(
    tmp_path: Path, name: str, method: str | None
) -> None:
    """Not "keep per-parameter state in self.state[p]" at the step, where it is: the override's line."""
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:{name}", tmp_path))
    if method is None:
        assert outcome.status == "pass", outcome.detail
        return
    assert outcome.status == "fail", outcome.detail
    assert "missing after reload: ['momentum']" in outcome.detail, outcome.detail
    assert (
        "the saved state_dict holds state[param 0]['momentum'], state[param 1]['momentum'], "
        "state[param 2]['momentum'], and the optimizer it was loaded into lacks them: the class's own "
        f"{method}() drops them"
    ) in outcome.detail, outcome.detail
    line = inspect.getsourcelines(getattr(globals()[name], method))[1]
    assert outcome.where == f"{__file__}:{line}", outcome.where
    fix = (
        "keep every key super().load_state_dict"
        if method == "load_state_dict"
        else "call super().__setstate__"
    )
    assert f"Fix: {fix}" in outcome.detail, outcome.detail
    assert "Fix: keep per-parameter state in self.state[p]" not in outcome.detail
    # resume_exact's difference has the same cause, at the same line.
    resumed = CHECKS["resume_exact"](context(f"{__name__}:{name}", tmp_path))
    assert resumed.status == "fail", resumed.detail
    assert f"the class's own {method}() drops them as it loads" in resumed.detail, resumed.detail
    assert resumed.where == outcome.where, resumed.where


class SparseOnlySGD(torch.optim.Optimizer):
    """Takes only sparse gradients, as torch's SparseAdam; sums a repeated row's gradients."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseOnlySGD does not support dense gradients")
                self.update(p, p.grad, group["lr"])

    def update(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        grad = grad.coalesce()
        p.index_add_(0, grad.indices()[0], grad.values(), alpha=-lr)


class SparseOnlyLastRepeatWins(SparseOnlySGD):
    """Assigns each row's update by index: of a repeated row's gradients, only the last one counts."""

    def update(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        rows = grad._indices()[0]
        p[rows] = p[rows] - lr * grad._values()


class SparseOnlyStill(SparseOnlySGD):
    """Refuses dense gradients and then never moves anything."""

    def update(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        return None


class SparseOnlyWarmUp(SparseOnlySGD):
    """Its first step on a row only records the gradient (a warm-up, as dense_step allows)."""

    def update(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        state = self.state[p]
        if "seen" not in state:
            state["seen"] = torch.zeros(())
            return
        super().update(p, grad, lr)


class RefusesEveryGradient(PlainSGD):
    """Raises about sparse gradients whatever the gradient is (an inverted `is_sparse` test)."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("RefusesEveryGradient does not support sparse gradients")


def test_a_class_that_takes_only_sparse_gradients_is_judged_by_sparse_alone(tmp_path: Path) -> None:
    from jobs.checks.runner import ONLY_SPARSE, run_checks

    for text in ("torch.optim:SparseAdam", f"{__name__}:SparseOnlySGD"):
        report = run_checks(resolve_target(text, framework="torch"), {}, workdir=tmp_path)
        status = {r.id: r.status for r in report.checks}
        detail = {r.id: r.detail for r in report.checks}
        assert status["dense_step"] == "skip" and "takes only sparse gradients" in detail["dense_step"]
        assert status["sparse"] == "pass" and "takes only sparse gradients" in detail["sparse"], detail
        dense_checks = set(status) - {"construct", "dense_step", "sparse"}
        assert all(status[c] == "skip" for c in dense_checks), detail
        torch_checks = {c for c in dense_checks if "optimizers only" not in detail[c]}  # not Keras's own
        assert all(ONLY_SPARSE in detail[c] for c in torch_checks) and len(torch_checks) > 10, detail
    repeats = rate_checks.check_sparse(context(f"{__name__}:SparseOnlyLastRepeatWins", tmp_path))
    assert repeats.status == "fail" and "repeated index" in repeats.detail, repeats.detail
    still = rate_checks.check_sparse(context(f"{__name__}:SparseOnlyStill", tmp_path))
    assert still.status == "fail" and "moved none of them" in still.detail, still.detail
    warm = rate_checks.check_sparse(context(f"{__name__}:SparseOnlyWarmUp", tmp_path))
    assert warm.status == "pass" and "takes only sparse gradients" in warm.detail, warm.detail
    # A class that refuses sparse gradients too takes no gradient at all: dense_step fails it.
    report = run_checks(
        resolve_target(f"{__name__}:RefusesEveryGradient", framework="torch"), {}, workdir=tmp_path
    )
    status = {r.id: r.status for r in report.checks}
    assert status["dense_step"] == "fail" and status["sparse"] == "skip", report.checks


def test_checks_leave_rng_and_warn_always_as_found(tmp_path: Path) -> None:
    ctx = context("lion", tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    warn_always, threads = torch.is_warn_always_enabled(), torch.get_num_threads()
    cost_checks.check_deprecations(ctx)
    build_checks.check_dense_step(ctx)
    assert torch.equal(torch.rand(3), expected)
    assert torch.is_warn_always_enabled() == warn_always
    assert torch.get_num_threads() == threads


def test_device_placement_skips_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    outcome = state_checks.check_device_placement(context("lion", tmp_path))
    assert outcome.status == "skip" and "CUDA" in outcome.detail


# --- published shapes the phase-10 survey met (benchmarks/README.md § Phase 10) ----------------------


class CudaSynchronisingSGD(PlainSGD):
    """Synchronises with the GPU in every step, as GaLore's AdamW8bit does: CUDA only."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        torch.cuda.synchronize()
        return loss


class CudaStateSGD(PlainSGD):
    """Asks the CUDA runtime for its device in the constructor: it cannot be built without one."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        self.device_index = torch.cuda.current_device()
        super().__init__(params, {"lr": lr})


class OwnDeviceRefusalSGD(PlainSGD):
    """Refuses a machine without a GPU in its own words, as torchao's CPUOffloadOptimizer does
    (`assert self.device in ["cuda", "xpu"], "CPU Offload currently only supports CUDA & XPU"`)."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        assert device in ["cuda", "xpu"], "CPU Offload currently only supports CUDA & XPU"
        super().__init__(params, {"lr": lr})


class OwnStepRefusalSGD(PlainSGD):
    """Builds anywhere, and its step refuses the CPU in its own words."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> Any:
        if not torch.cuda.is_available():
            raise RuntimeError("the fused kernel of this optimizer requires a GPU")
        return super().step(closure)


class AlwaysRaisingSGD(PlainSGD):
    """Raises in its constructor a message that names an accelerator but no need of one: still a
    fault of the class."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        raise RuntimeError("momentum buffer could not be allocated like the CUDA one")


def test_a_class_that_needs_cuda_is_inconclusive_without_it(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: these classes are judged like any other")
    stepping = build_checks.check_dense_step(context(f"{__name__}:CudaSynchronisingSGD", tmp_path))
    assert stepping.status == "skip", stepping.detail
    assert "steps only with a CUDA device (torch.cuda.is_available() is False here)" in stepping.detail
    building = build_checks.check_construct(context(f"{__name__}:CudaStateSGD", tmp_path))
    assert building.status == "skip" and "builds only with a CUDA device" in building.detail, building.detail
    own = build_checks.check_construct(context(f"{__name__}:OwnDeviceRefusalSGD", tmp_path))
    assert own.status == "skip", own.detail
    assert "builds only with a GPU, which its own error names" in own.detail
    assert "CPU Offload currently only supports CUDA & XPU" in own.detail
    own_step = build_checks.check_dense_step(context(f"{__name__}:OwnStepRefusalSGD", tmp_path))
    assert own_step.status == "skip" and "steps only with a GPU" in own_step.detail, own_step.detail
    other = build_checks.check_construct(context(f"{__name__}:AlwaysRaisingSGD", tmp_path))
    assert other.status == "fail" and "GPU" not in other.detail, other.detail


class OwnRateSGD(PlainSGD):
    """Sets its own step size unless told otherwise, as transformers' Adafactor does with
    relative_step=True, and then refuses a manual lr in the constructor."""

    def __init__(self, params: object, lr: float | None = None, relative_step: bool = True) -> None:
        if lr is not None and relative_step:
            raise ValueError("Cannot combine a manual lr and relative_step=True")
        super().__init__(params, {"lr": lr, "relative_step": relative_step})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            rate = 0.01 if group["relative_step"] else group["lr"]
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(rate * p.grad)
        return None


def test_a_class_that_refuses_a_rate_in_its_configuration_is_not_given_one(tmp_path: Path) -> None:
    from jobs.checks import torch_only

    own_rate = context(f"{__name__}:OwnRateSGD", tmp_path)
    schedule = rate_checks.check_schedule(own_rate)
    assert schedule.status == "skip" and "refuses a learning rate" in schedule.detail, schedule.detail
    assert "Cannot combine a manual lr" in schedule.detail
    assert state_checks.check_config_roundtrip(own_rate).status == "pass"
    assert torch_only.check_param_groups(own_rate).status == "pass"
    # Told to take a rate, it is held to it like any other class.
    given = context(f"{__name__}:OwnRateSGD", tmp_path, lr=0.05, relative_step=False)
    outcome = rate_checks.check_schedule(given)
    assert outcome.status == "pass", outcome.detail


class NoneKeptSGD(PlainSGD):
    """Keeps 'lr': None in its groups whatever lr it is given: a schedule never reaches it."""

    def __init__(self, params: object, lr: float | None = None) -> None:
        super().__init__(params, {"lr": None, "rate": 0.01 if lr is None else lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["rate"] * p.grad)
        return None


def test_a_class_computing_its_own_step_at_its_none_default_is_scheduled_once_given_a_rate(
    tmp_path: Path,
) -> None:
    """Built with lr and 2 lr to see whether it ignores its rate, it had been put in its other mode and
    failed ("holds 'lr': None ... no schedule has a rate to scale")."""
    outcome = rate_checks.check_schedule(context("tests.checks.own_step_size:RelativeStepSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert outcome.detail.startswith(
        "at lr=None, the class's default, it computes its own step size (its param groups hold 'lr': None)"
    )
    assert "a schedule applies once an lr is given, and given lr=0.001: " in outcome.detail
    # The mode a schedule reaches is judged, left at the default too: a rate cached when given fails.
    cached = rate_checks.check_schedule(
        context("tests.checks.own_step_size:CachedRateWhenGivenSGD", tmp_path)
    )
    assert cached.status == "fail", cached.detail
    given = rate_checks.check_schedule(
        context("tests.checks.own_step_size:RelativeStepSGD", tmp_path, lr=0.01)
    )
    assert given.status == "pass", given.detail
    # An lr given that never reaches the groups still fails.
    kept = rate_checks.check_schedule(context(f"{__name__}:NoneKeptSGD", tmp_path, lr=0.01))
    assert kept.status == "fail" and "holds 'lr': None" in kept.detail, kept.detail


class SelfDeprecatingSGD(PlainSGD):
    """Announces its own deprecation, as GaLore's copy of transformers' AdamW does."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        import warnings

        # stacklevel=2 points the warning at the caller (optlab): the class's own frame still tells.
        notice = "SelfDeprecatingSGD is deprecated; use torch.optim.SGD instead"
        warnings.warn(notice, FutureWarning, stacklevel=2)
        super().__init__(params, {"lr": lr})


def test_a_deprecation_notice_the_class_issues_itself_is_not_a_deprecated_call(tmp_path: Path) -> None:
    outcome = cost_checks.check_deprecations(context(f"{__name__}:SelfDeprecatingSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert "1 that the class issues itself were not counted" in outcome.detail
    assert "use torch.optim.SGD instead" in outcome.detail


class SoftClippedSGD(PlainSGD):
    """Requires max_norm > 1 only when it steps (adam-atan2's AdamAtan2ClipGrok asserts it)."""

    def __init__(self, params: object, lr: float = 0.1, max_norm: float = 2.0) -> None:
        super().__init__(params, {"lr": lr, "max_norm": max_norm})

    def step(self, closure: Any = None) -> Any:
        assert all(group["max_norm"] > 1.0 for group in self.param_groups)
        return super().step(closure)


def test_param_groups_leaves_alike_a_value_one_group_alone_cannot_take(tmp_path: Path) -> None:
    from jobs.checks import torch_only

    outcome = torch_only.check_param_groups(context(f"{__name__}:SoftClippedSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert "lr=0.05" in outcome.detail and "max_norm" not in outcome.detail


class DividedRateSGD(PlainSGD):
    """Stores lr / (1 + lamb) in its groups, as GrokFastAdamW does: a group's own lr is used as given."""

    def __init__(self, params: object, lr: float = 0.1, lamb: float = 2.0) -> None:
        super().__init__(params, {"lr": lr / (1.0 + lamb), "lamb": lamb})


def test_param_groups_names_a_value_the_constructor_stores_transformed(tmp_path: Path) -> None:
    from jobs.checks import torch_only

    outcome = torch_only.check_param_groups(context(f"{__name__}:DividedRateSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "the constructor stores lr=0.05 as 0.025" in outcome.detail, outcome.detail
    assert "store each hyperparameter in the param groups as given" in outcome.detail


class OldBaseCallSGD(PlainSGD):
    """Calls its base's constructor with a keyword torch's Optimizer never took."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, defaults={"lr": lr}, lr=lr)  # type: ignore[call-arg]


class TwoListsSGD(PlainSGD):
    """Takes two lists of parameters (as adam-atan2's MuonAdamAtan2): the checks cannot guess them."""

    def __init__(self, matrices: object, params: object, lr: float = 0.1) -> None:
        super().__init__([*matrices, *params], {"lr": lr})  # type: ignore[misc]


def test_a_base_constructor_the_class_calls_wrongly_is_a_construct_fail(tmp_path: Path) -> None:
    outcome = build_checks.check_construct(context(f"{__name__}:OldBaseCallSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "in the constructor of a base class, called by the class's own __init__" in outcome.detail
    assert "unexpected keyword argument 'lr'" in outcome.detail
    # A call of the class itself that the checks' arguments do not fit stays inconclusive.
    outcome = build_checks.check_construct(context(f"{__name__}:TwoListsSGD", tmp_path))
    assert outcome.status == "skip" and "cannot guess" in outcome.detail, outcome.detail


class TensorRateSGD(PlainSGD):
    """Keeps lr as a tensor in its groups, as torchao's optimizers do (to compile their step once), and
    refuses a float put in its place: a schedule must fill_ it, as torch's LRScheduler does."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": torch.tensor(lr)})

    def step(self, closure: Any = None) -> Any:
        if not all(isinstance(group["lr"], torch.Tensor) for group in self.param_groups):
            raise RuntimeError("lr was changed to a non-Tensor object; use group['lr'].fill_(new_lr)")
        return super().step(closure)


def test_a_tensor_rate_is_scheduled_in_place_as_an_lr_scheduler_does(tmp_path: Path) -> None:
    outcome = rate_checks.check_schedule(context(f"{__name__}:TensorRateSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail


class PortedMomentum(PlainSGD):
    """A port from Keras: the constructor takes `learning_rate`, the groups keep it as torch's `lr`
    (so LR schedulers reach it)."""

    def __init__(self, params: object, learning_rate: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": learning_rate, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            self.momentum_step(group, group["lr"])  # the key read here: what the catalogue reads
        return None

    def momentum_step(self, group: dict[str, Any], lr: float) -> None:
        for p in (p for p in group["params"] if p.grad is not None):
            velocity = self.state[p].setdefault("velocity", torch.zeros_like(p))
            velocity.mul_(group["momentum"]).add_(p.grad)
            p.sub_(lr * velocity)


class KeyedMomentum(PortedMomentum):
    """The same kept as group['learning_rate']: no torch LR scheduler sets that key."""

    def __init__(self, params: object, learning_rate: float = 0.01, momentum: float = 0.9) -> None:
        PlainSGD.__init__(self, params, {"learning_rate": learning_rate, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            self.momentum_step(group, group["learning_rate"])
        return None


def test_a_rate_taken_as_learning_rate_is_scheduled_where_lr_schedulers_set_it(tmp_path: Path) -> None:
    """Set as `lr`, as an LRScheduler and every job set it (it had been set under the argument's
    name, which the class never reads: a false "never applied")."""
    ported = context(f"{__name__}:PortedMomentum", tmp_path / "ported")
    outcome = rate_checks.check_schedule(ported)
    assert outcome.status == "pass", outcome.detail
    config = state_checks.check_config_roundtrip(ported)
    assert config.status == "pass" and "not in any group" not in config.detail, config.detail
    assert ported.target.entry.group_kwargs({"lr": 0.02}) == {"lr": 0.02}  # a job's group recipe too
    keyed = rate_checks.check_schedule(context(f"{__name__}:KeyedMomentum", tmp_path / "keyed"))
    assert keyed.status == "fail"
    assert (
        "param_groups[0] holds its rate as 'learning_rate' and no 'lr', the key every torch" in keyed.detail
    )
    assert "Fix: keep the rate in each param group as 'lr'" in keyed.detail


class DefaultsBetasAdam(PlainSGD):
    """Adam reading its betas from self.defaults: a second group's own betas are ignored. Seen only
    when the gradients change between the steps compared: Adam's step is the same for any betas while
    the gradient is."""

    def __init__(self, params: object, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        beta1, beta2 = self.defaults["betas"]
        return self._update(beta1, beta2)

    def _update(self, beta1: float, beta2: float) -> None:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["step"])
                p.sub_(group["lr"] * m_hat / (v_hat.sqrt() + 1e-8))
        return None


class WarmupCachedRateAdam(PlainSGD):
    """Steps nothing for its first four steps (state only, as RAdam_4step), then caches each step's
    size by step number across its groups: the first group's rate and betas are every group's."""

    def __init__(self, params: object, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})
        self.cached: dict[int, float] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                if state["step"] <= 4:
                    continue
                size = self.cached.setdefault(state["step"], group["lr"] / (1 - beta1 ** state["step"]))
                p.addcdiv_(state["m"], state["v"].sqrt().add_(1e-8), value=-size)
        return None


def test_a_group_value_lost_after_a_warm_up_that_steps_nothing_fails_param_groups(tmp_path: Path) -> None:
    """Two steps compared nothing: RAdam_4step moves no parameter for four."""
    outcome = torch_only.check_param_groups(context(f"{__name__}:WarmupCachedRateAdam", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "does not step like a single-group optimizer" in outcome.detail


class DefaultsBetasAdamWithNotes(DefaultsBetasAdam):
    """The same read, below a docstring and a comment that name such reads: the location is the code's."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Unlike torch's Adam, which never reads self.param_groups[0] for every group."""
        # was: beta1 = self.defaults["beta1"]
        beta1, beta2 = self.defaults["betas"]
        return self._update(beta1, beta2)


@pytest.mark.parametrize("cls", [DefaultsBetasAdam, DefaultsBetasAdamWithNotes])
def test_betas_read_from_the_defaults_fail_param_groups(tmp_path: Path, cls: type) -> None:
    outcome = torch_only.check_param_groups(context(f"{__name__}:{cls.__name__}", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "a second param group with lr=0.0005, betas=(0.45, 0.4995) does not step like" in outcome.detail
    # Pointed at the read, not at `def step`: where the fix goes.
    assert (
        '`beta1, beta2 = self.defaults["betas"]` in step() reads one value for every group' in outcome.detail
    )
    step = inspect.unwrap(cls.step)  # type: ignore[attr-defined]
    line = inspect.getsource(step).splitlines().index('        beta1, beta2 = self.defaults["betas"]')
    assert outcome.where == f"{__file__}:{inspect.getsourcelines(step)[1] + line}"


class DerivedBetasAdam(PlainSGD):
    """Resolves a default from another argument once, in __init__, as timm's Mars does
    (`betas_1d=betas_1d or betas`): a group given its own betas keeps the constructor's for its
    1-D parameters."""

    def __init__(
        self,
        params: object,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        betas_1d: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "betas_1d": betas_1d or betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                beta, _ = group["betas"] if p.ndim >= 2 else group["betas_1d"]
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(beta).add_(p.grad, alpha=1 - beta)
                p.sub_(group["lr"] * state["m"])
        return None


class SnapshotDecaySGD(PlainSGD):
    """Snapshots the constructor's lr into every group's defaults (timm's AdamWLegacy with
    corrected_weight_decay), and fills it in for old pickles in __setstate__, which no step runs."""

    def __init__(self, params: object, lr: float = 0.1, weight_decay: float = 0.5) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "max_lr": float(lr)}
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.setdefault("max_lr", float(self.defaults["lr"]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.mul_(1 - group["weight_decay"] * group["lr"] ** 2 / group["max_lr"])
        return super().step(closure)


class DerivedButDefaultsBetasAdam(DefaultsBetasAdam):
    """Derives a value it never reads, and reads its betas from self.defaults: the read is the cause."""

    def __init__(self, params: object, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "betas": betas, "beta_sum": sum(betas)})


class AttributeMomentumSGD(PlainSGD):
    """Steps with the constructor's momentum kept as an attribute; its __setstate__ (which no step
    runs) reads self.defaults for old pickles."""

    def __init__(self, params: object, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.momentum = momentum

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.setdefault("dampening", float(self.defaults["momentum"]))  # pickled before it had one

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                state["m"] = state.get("m", torch.zeros_like(p)).mul_(self.momentum).add_(p.grad)
                p.sub_(group["lr"] * state["m"])
        return None


@pytest.mark.parametrize(
    ("cls", "says", "line"),
    [
        (DerivedBetasAdam, "the constructor derives betas_1d from the values it is given", "betas_1d"),
        (SnapshotDecaySGD, "the constructor derives max_lr from the values it is given", "max_lr"),
        (
            DerivedButDefaultsBetasAdam,
            '`beta1, beta2 = self.defaults["betas"]` in step() reads one value for every group',
            "self.defaults",
        ),
        # A read in __setstate__ is no cause: the fail points at the update instead (its first line).
        (AttributeMomentumSGD, "does not step like a single-group optimizer", "@torch.no_grad()"),
    ],
)
def test_param_groups_names_a_default_the_constructor_derives_where_it_does(
    cls: type, says: str, line: str, tmp_path: Path
) -> None:
    """Mars's fail had said to read hyperparameters from the group (which it does) at `def step`;
    AdamWLegacy's had blamed its __setstate__, which never runs in the check."""
    outcome = torch_only.check_param_groups(context(f"{__name__}:{cls.__name__}", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert says in outcome.detail, outcome.detail
    path, number = outcome.where.rsplit(":", 1)
    assert line in Path(path).read_text().splitlines()[int(number) - 1], outcome.where
    assert "__setstate__" not in outcome.detail


class TensorDefaultSGD(PlainSGD):
    """Its default rate a float32 tensor (torch allows one): halved, 0.0005000000237487257 as a float."""

    def __init__(self, params: object, lr: Any = torch.tensor(1e-3)) -> None:  # noqa: B008
        super().__init__(params, {"lr": lr})


def test_param_groups_shows_a_halved_float32_rate_as_the_number_it_is(tmp_path: Path) -> None:
    outcome = torch_only.check_param_groups(context(f"{__name__}:TensorDefaultSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert "a second group with lr=0.0005 steps like" in outcome.detail


class PackedState(torch.Tensor):
    """A state tensor kept packed, as torchao's 8-bit, 4-bit and FP8 optimizers keep their moments:
    it refuses .numpy() and gives its values through dequantize()."""

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(".numpy() is not supported for tensor subclasses.")

    def dequantize(self) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


class PackedMomentumSGD(PlainSGD):
    """SGD with momentum kept in a PackedState."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        lr = self.param_groups[0]["lr"]
        for p in (p for group in self.param_groups for p in group["params"] if p.grad is not None):
            momentum = self.state[p].setdefault("momentum", torch.zeros_like(p).as_subclass(PackedState))
            momentum.mul_(0.9).add_(p.grad)
            p.sub_(lr * momentum.dequantize())
        return None


def test_packed_state_tensors_are_read_through_their_values(tmp_path: Path) -> None:
    outcome = build_checks.check_dense_step(context(f"{__name__}:PackedMomentumSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail


class MomentumRequiredSGD(PlainSGD):
    """Defaults momentum to 0 and refuses it, as bitsandbytes' SGD8bit ("SGD without momentum is not
    supported!"): momentum is required in effect."""

    def __init__(self, params: object, lr: float = 0.1, momentum: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if momentum == 0:
            raise NotImplementedError("SGD without momentum is not supported!")
        super().__init__(params, {"lr": lr, "momentum": momentum})


def test_a_default_the_class_refuses_is_judged_with_the_value_given(tmp_path: Path) -> None:
    alone = build_checks.check_construct(context(f"{__name__}:MomentumRequiredSGD", tmp_path))
    assert alone.status == "fail" and "without momentum is not supported" in alone.detail, alone.detail
    given = build_checks.check_construct(context(f"{__name__}:MomentumRequiredSGD", tmp_path, momentum=0.9))
    assert given.status == "pass", given.detail
    assert "(its defaults alone raise NotImplementedError" in given.detail
    assert "momentum must be given" in given.detail


class FullPrecisionSGD(PlainSGD):
    """Refuses a given value that does not fit the parameters, naming it, as pytorch-optimizer's
    FlashAdamW does ("master_weight_bits has no effect when all parameters are fp32"); its `beta`
    has a declared range, which the class must honour."""

    optlab_hyperparameters: ClassVar[dict[str, Param]] = {"beta": unit_interval("beta")}

    def __init__(
        self, params: object, lr: float = 0.1, master_bits: int | None = None, beta: float = 0.0
    ) -> None:
        params = list(params)  # type: ignore[call-overload]
        if not lr > 0:
            raise ValueError(f"lr must be a number > 0; received {lr}")
        if master_bits is not None and all(p.dtype == torch.float32 for p in params):
            raise ValueError("master_bits has no effect when all parameters are fp32")
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1); received {beta}")
        if beta == 0.5:
            raise ValueError("beta must not be 0.5")  # inside the range it declares: a fault
        super().__init__(params, {"lr": lr})


def test_a_given_value_the_class_refuses_by_name_is_not_its_fault(tmp_path: Path) -> None:
    target = f"{__name__}:FullPrecisionSGD"
    assert build_checks.check_construct(context(target, tmp_path)).status == "pass"
    refused = build_checks.check_construct(context(target, tmp_path, master_bits=24))
    assert refused.status == "skip", refused.detail
    assert "refuses the given master_bits=24" in refused.detail and "no effect when all" in refused.detail
    declared = build_checks.check_construct(context(target, tmp_path, beta=0.5))
    assert declared.status == "fail" and "beta must not be 0.5" in declared.detail, declared.detail


class PerturbedLossSGD(PlainSGD):
    """Calls the closure at the weights given and again at a perturbed point, as pytorch-optimizer's
    BSAM does, and returns the second loss (`scaled`: twice it, a loss no call gave)."""

    def __init__(self, params: object, lr: float = 0.1, scaled: bool = False) -> None:
        super().__init__(params, {"lr": lr})
        self.scaled = scaled

    def step(self, closure: Any = None) -> Any:
        with torch.enable_grad():
            closure()
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.add_(0.01 * p.grad.sign())
        with torch.enable_grad():
            loss = closure()
        super().step()
        return loss * 2 if self.scaled else loss


def test_step_closure_may_return_the_loss_of_any_of_its_closure_calls(tmp_path: Path) -> None:
    outcome = CHECKS["closure"](context(f"{__name__}:PerturbedLossSGD", tmp_path))
    assert outcome.status == "pass" and "(of call 2)" in outcome.detail, outcome.detail
    scaled = CHECKS["closure"](context(f"{__name__}:PerturbedLossSGD", tmp_path, scaled=True))
    assert scaled.status == "fail" and "from its 2 call(s)" in scaled.detail, scaled.detail


def test_a_line_search_is_judged_within_what_its_rounding_allows(tmp_path: Path) -> None:
    """torch's LBFGS with its strong-Wolfe line search: once it has a curvature history, a step at
    rate 0 divides by the zero-length interval it brackets (ZeroDivisionError), and its branches on
    the loss turn a rounding-level change of the start into 1e-4..1e-3 within three steps. Neither is
    a fault: `schedule` keeps its rates above 0, and `graph_mode` does not warn of a compiled step
    that differs from eager by what rounding alone does to it (both had failed and warned)."""
    ctx = context("torch.optim:LBFGS", tmp_path, line_search_fn="strong_wolfe")
    schedule = CHECKS["schedule"](ctx)
    assert schedule.status == "pass" and "rates kept above 0" in schedule.detail, schedule.detail
    graph = CHECKS["graph_mode"](ctx)
    assert graph.status in ("pass", "skip"), graph.detail  # compiled may round alike on another CPU
    assert graph.status == "pass" or "amplifies rounding" in graph.detail
    torch.manual_seed(0)
    batch, start = torch_only._batch(), torch_only._tiny_model()
    # A plain update keeps a rounding-level nudge at rounding level: nothing to excuse a difference.
    # The line search amplifies it 100 to 10,000 times more, by the start (7e-6 to 6e-4 over 8 seeds).
    plain, computed_in = torch_only._rounding_sensitivity(
        context("torch.optim:SGD", tmp_path, momentum=0.9), start, batch
    )
    assert plain < 1e-6 and computed_in == torch.float32
    assert torch_only._rounding_sensitivity(ctx, start, batch)[0] > 10 * plain


def test_a_step_that_returns_none_for_the_closure_s_loss_is_a_warning(tmp_path: Path) -> None:
    """torch declares step() -> float | None and optlab's jobs ignore it: published SAMs return None.
    A fact worth knowing (a `loss = opt.step(closure)` loop gets None), not a fault."""
    outcome = CHECKS["closure"](broken("torch_closure_loss", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "returned None, not the closure's loss" in outcome.detail
    assert "Fix: return the closure's loss" in outcome.detail


class NoGradClosureSGD(torch.optim.Optimizer):
    """Calls its closure inside its @torch.no_grad() step without re-enabling grad: a user's plain
    closure (`loss.backward()`) raises there; optlab's closure enables grad itself."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)
        return loss


def test_a_closure_called_with_grad_disabled_is_a_warning_with_the_fix(tmp_path: Path) -> None:
    outcome = CHECKS["closure"](context(f"{__name__}:NoGradClosureSGD", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "called the closure with grad disabled" in outcome.detail
    assert "element 0 of tensors does not require grad" in outcome.detail
    assert "with torch.enable_grad(): loss = closure()" in outcome.detail
    # The line that calls it, where the fix goes, not the decorator that starts step()'s source.
    call = (
        inspect.getsource(NoGradClosureSGD.step)
        .splitlines()
        .index("        loss = None if closure is None else closure()")
    )
    assert outcome.where == f"{__file__}:{inspect.getsourcelines(NoGradClosureSGD.step)[1] + call}"


class Float32OnlySGD(StepWithoutClosure):
    """Written for float32 training: refuses low-precision parameters in words, in its own code."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.float64):
                    raise TypeError(f"Float32OnlySGD supports only float32/float64 parameters, got {p.dtype}")
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)
        return None


class Float32StateSGD(StepWithoutClosure):
    """Keeps a float32 buffer and mixes it with a bf16 gradient in an op that refuses mixed dtypes:
    torch's own error, with 'dtype' in its message, from inside the op. A fault, not a refusal."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buffer"] = torch.ones(p.numel(), dtype=torch.float32)
                scale = torch.dot(p.grad.flatten(), state["buffer"])
                p.sub_(group["lr"] * p.grad * (1 + 0 * scale))
        return None


class Float32CopySGD(StepWithoutClosure):
    """Steps a float32 copy of each parameter (`p.detach().float()`), and writes it back only where
    `write_back`: on float32 parameters `.float()` is the parameter itself, so only bf16 ones stay put.
    `lr` small enough (1e-6) rounds a right bf16 update away, which is no fault."""

    def __init__(self, params: Any, lr: float = 0.1, write_back: bool = False) -> None:
        super().__init__(params, lr)
        self.write_back = write_back

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_fp32 = p.detach().float()
                param_fp32.add_(p.grad.float(), alpha=-group["lr"])
                if self.write_back:
                    p.copy_(param_fp32)
        return None


@pytest.mark.parametrize(
    ("name", "status", "words", "params"),
    [
        ("Float32OnlySGD", "pass", "refuses bfloat16 parameters with a clear error", {}),
        ("Float32StateSGD", "fail", "expected both vectors to have same dtype", {}),
        ("Float32CopySGD", "fail", "the update never reaches the bfloat16 parameters", {}),
        ("Float32CopySGD", "pass", "a step on bfloat16 parameters", {"write_back": True}),
        ("Float32CopySGD", "pass", "a step on bfloat16 parameters", {"write_back": True, "lr": 1e-6}),
        ("Float32CopySGD", "pass", "a step on bfloat16 parameters", {"lr": 1e-6}),
    ],
)
def test_mixed_precision_on_bfloat16_parameters(
    name: str, status: str, words: str, params: dict[str, Any], tmp_path: Path
) -> None:
    from jobs.checks.runner import _outcome

    outcome = _outcome("mixed_precision", CHECKS, context(f"{__name__}:{name}", tmp_path, **params))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail


@torch.compile(fullgraph=True, dynamic=False)
def _compiled_update(param: Any, grad: Any, lr: float, correction: float) -> None:
    param.sub_(grad * (lr / correction))


class CompiledOnFloats(StepWithoutClosure):
    """Its compiled update takes the step's bias correction as a Python float (a new value every step):
    compiled anew each step until torch's recompile limit, where fullgraph=True raises
    FailOnRecompileLimitHit, whose message says only "Hard failure due to fullgraph=True"."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    _compiled_update(p, p.grad, group["lr"], 1 - 0.9 ** state["step"])
        return None


def test_a_compiled_step_at_the_recompile_limit_is_told_why_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It had been told only "the error above and its line say why"."""
    from jobs.checks.runner import _outcome

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # the limit's cause, in fewer compiles

    outcome = _outcome("descends", CHECKS, context(f"{__name__}:CompiledOnFloats", tmp_path))
    assert outcome.status == "fail" and "FailOnRecompileLimitHit" in outcome.detail, outcome.detail
    fix = outcome.detail.split("Fix:")[1]
    assert "compiled again for each new value of a Python number" in fix
    assert "as tensors" in fix and "dynamic=True" in fix


class KwargsSGD(torch.optim.Optimizer):
    """Takes its hyperparameters as **kwargs (no `lr` argument to catalogue); its groups hold 'lr'.
    `cached` reads the rate once into self.lr, so no scheduler reaches the update: the fault."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        lr = kwargs.get("lr", 0.05)
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})
        self.lr = lr
        self.cached = bool(kwargs.get("cached", False))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_((self.lr if self.cached else group["lr"]) * p.grad)
        return None


class KwargsCachedRateSGD(KwargsSGD):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs, cached=True)


@pytest.mark.parametrize(("name", "status"), [("KwargsSGD", "pass"), ("KwargsCachedRateSGD", "fail")])
def test_a_rate_taken_through_kwargs_into_the_groups_is_scheduled(
    name: str, status: str, tmp_path: Path
) -> None:
    outcome = CHECKS["schedule"](context(f"{__name__}:{name}", tmp_path))
    assert outcome.status == status, outcome.detail
    assert status == "pass" or "never applied" in outcome.detail


class RecordingInPlaceSGD(StepWithoutClosure):
    """Updates in place with autograd recording (no @torch.no_grad()): torch refuses the leaf."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)
        return None


def test_an_in_place_update_under_autograd_is_told_to_use_no_grad(tmp_path: Path) -> None:
    outcome = CHECKS["dense_step"](context(f"{__name__}:RecordingInPlaceSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "leaf Variable that requires grad" in outcome.detail
    assert "decorate step() with @torch.no_grad()" in outcome.detail


class GradientAsMomentumSGD(StepWithoutClosure):
    """Keeps the gradient tensor itself as its momentum buffer (no clone), then updates it in place:
    right under zero_grad(set_to_none=True) only, and it rewrites the caller's gradient."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = p.grad
                else:
                    state["momentum_buffer"].mul_(0.9).add_(p.grad)
                p.sub_(group["lr"] * state["momentum_buffer"])
        return None


def test_state_that_is_the_gradient_itself_is_a_warning_naming_it(tmp_path: Path) -> None:
    outcome = CHECKS["dense_step"](context(f"{__name__}:GradientAsMomentumSGD", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "state[param 0]['momentum_buffer']" in outcome.detail and "not a copy" in outcome.detail
    assert "p.grad.clone()" in outcome.detail
    assert CHECKS["dense_step"](context("torch.optim:SGD", tmp_path, momentum=0.9)).status == "pass"


class SetstateWithoutSuperSGD(torch.optim.SGD):
    """Back-fills a flag for older saves in __setstate__ but never calls super().__setstate__:
    load_state_dict() sets the state through it, so nothing is loaded."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        for group in state.get("param_groups", []):
            group.setdefault("flag", True)


def test_a_setstate_override_that_loads_nothing_is_named_with_its_fix(tmp_path: Path) -> None:
    outcome = CHECKS["state_roundtrip"](
        context(f"{__name__}:SetstateWithoutSuperSGD", tmp_path, momentum=0.9)
    )
    assert outcome.status == "fail", outcome.detail
    assert "nothing was loaded, and the class overrides __setstate__" in outcome.detail
    assert "Fix: call super().__setstate__(state) in __setstate__" in outcome.detail


class StateMadeInInitSGD(torch.optim.Optimizer):
    """Creates each parameter's state in __init__ only: a group added later has none, and its step
    raises KeyError."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buffer = self.state[p]["momentum_buffer"]
                    buffer.mul_(0.9).add_(p.grad)
                    p.sub_(group["lr"] * buffer)
        return None


def test_state_made_only_in_init_is_told_to_be_made_in_step(tmp_path: Path) -> None:
    outcome = CHECKS["param_groups"](context(f"{__name__}:StateMadeInInitSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "raised KeyError: 'momentum_buffer'" in outcome.detail
    assert "Fix: create a parameter's state in step() when it has none" in outcome.detail


class GroupBetaSGD(PlainSGD):
    """Gives the constructor's groups a key its defaults lack: torch's add_param_group fills a group
    added later from the defaults, so that group has none."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            group["beta"] = 0.5

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.sub_(group["lr"] * group["beta"] * p.grad)
        return None


def test_a_group_key_the_defaults_lack_is_told_to_be_set_in_defaults(tmp_path: Path) -> None:
    outcome = CHECKS["param_groups"](context(f"{__name__}:GroupBetaSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert (
        "raised KeyError: 'beta': 'beta' is a key of the constructor's param groups that a group added"
        in (outcome.detail)
    )
    assert (
        "torch's add_param_group fills a new group from self.defaults, which do not hold it" in outcome.detail
    )
    assert "Fix: set the key in add_param_group (param_group.setdefault('beta', ...)) or in defaults" in (
        outcome.detail
    )
    method = GroupBetaSGD.__init__
    assert outcome.where == f"{__file__}:{inspect.getsourcelines(method)[1]}", outcome.where


class SkipsInitSGD(PlainSGD):
    """Never runs torch.optim.Optimizer.__init__."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state = {}


def _attribute_error(call: Callable[[], Any]) -> AttributeError:
    with pytest.raises(AttributeError) as raised:
        call()
    return raised.value


def test_a_missing_init_attribute_is_blamed_on_init_only_where_the_hooks_are_missing() -> None:
    from jobs.frameworks.torch_driver import never_ran_optimizer_init

    params = [torch.nn.Parameter(torch.ones(2))]
    assert never_ran_optimizer_init(_attribute_error(SkipsInitSGD(params).state_dict))
    assert never_ran_optimizer_init(
        _attribute_error(lambda: SkipsInitSGD(params).add_param_group({"params": []}))
    )
    ran = torch.optim.SGD(params, lr=0.1)
    del ran.defaults  # an attribute __init__ sets, gone from a class that ran it: another cause
    assert not never_ran_optimizer_init(_attribute_error(lambda: ran.add_param_group({"params": []})))
    assert not never_ran_optimizer_init(_attribute_error(lambda: SkipsInitSGD(params).momentum))


class InnerMomentumSGD(torch.optim.Optimizer):
    """Steps an SGD with momentum of its own, over its groups: that inner optimizer's momentum is in
    no state this class saves."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})
        self.inner = torch.optim.SGD(self.param_groups, lr=lr, momentum=0.9)

    def step(self, closure: Any = None) -> Any:
        return self.inner.step(closure)


def test_an_inner_optimizers_unsaved_state_is_named(tmp_path: Path) -> None:
    outcome = CHECKS["state_roundtrip"](context(f"{__name__}:InnerMomentumSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "self.inner is an optimizer of its own (SGD) whose state the save does not hold" in outcome.detail


class TrustRatioSGD(StepWithoutClosure):
    """Scales each update by ||w|| / ||g|| with no fallback where ||w|| is 0 (LAMB without its
    reference code's trust ratio of 1): a zero-initialised bias never moves."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.sub_(group["lr"] * ratio * p.grad)
        return None


def test_a_zero_variable_that_never_moves_is_a_warning_with_both_readings(tmp_path: Path) -> None:
    outcome = CHECKS["dense_step"](context(f"{__name__}:TrustRatioSGD", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "a variable of zeros ((3,), as a bias or a LayerNorm shift starts) did not move" in outcome.detail
    assert "Madam) keeps zeros by design" in outcome.detail and "take a trust ratio of 1" in outcome.detail


def _compiled_step_raising(message: str) -> Callable[..., Callable[..., None]]:
    """A stand-in for torch.compile whose step fails inside torch's own code with `message`, as
    dynamo's guard check failed on apple's AdEMAMix with its warm-ups set (torch 2.x)."""

    def compile_(step: Callable[..., Any], **_: Any) -> Callable[..., None]:
        def compiled_step(*args: Any) -> None:
            torch._assert(False, message)

        return compiled_step

    return compile_


@pytest.mark.parametrize(
    ("message", "status", "words"),
    [
        (
            "Guard failed on the same frame it was created. This is a bug - please create an issue.",
            "skip",
            "inconclusive: torch's compiler failed on step(), and its message says the fault is torch's",
        ),
        ("Cannot trace a data-dependent branch", "warn", "Fix: keep step() traceable"),
    ],
    ids=["torch_bug", "untraceable"],
)
def test_a_compiler_error_torch_calls_its_own_bug_is_not_blamed_on_the_class(
    message: str, status: str, words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "compile", _compiled_step_raising(message))
    outcome = CHECKS["graph_mode"](context("torch.optim:SGD", tmp_path))
    assert outcome.status == status, outcome.detail
    assert words in outcome.detail and message in outcome.detail, outcome.detail
    assert (".item()" in outcome.detail) == (status == "warn"), outcome.detail


COMPILES_ITS_OWN_HELPER = '''
import torch


def in_bfloat16(graph, example_inputs):
    """A compiler that runs the graph in bfloat16: compiled code that rounds otherwise than eager."""

    def run(*args):
        low = [a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return [o.float() if isinstance(o, torch.Tensor) else o for o in graph(*low)]

    return run


@torch.compile(backend=in_bfloat16)
def direction(grad):
    return grad / (grad.norm() + 1e-8)


class NormalizedSGD(torch.optim.Optimizer):
    """Steps along the normalized gradient, computed by a helper compiled as the reference Muon
    compiles its Newton-Schulz iteration."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(direction(p.grad), alpha=-group["lr"])


class CountingNormalizedSGD(torch.optim.Optimizer):
    """The same, with its step size taken from a Python counter, which dynamo bakes into the trace."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(direction(p.grad), alpha=-group["lr"] * self.calls)


class CompiledStepSGD(torch.optim.Optimizer):
    """Its whole step compiled by the class itself."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.compile(backend="eager")
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
'''


def test_a_step_the_class_compiles_itself_is_inconclusive_not_a_warn(tmp_path: Path) -> None:
    """torch cannot compile a compiled step again ("compile_wrapper already has a get_compiler_config
    attribute"): that had been a warn telling the class to keep its step traceable."""
    path = tmp_path / "compiles_its_own_helper.py"
    path.write_text(COMPILES_ITS_OWN_HELPER)
    outcome = CHECKS["graph_mode"](context(f"{path}:CompiledStepSGD", tmp_path))
    assert outcome.status == "skip", outcome.detail
    assert "the class compiles its whole step itself" in outcome.detail
    # The wrapper torch puts on a step it has compiled once (dynamo told to leave it alone) is not
    # the class's compile: LBFGS checked after another test had compiled it had been skipped.
    CHECKS["graph_mode"](context("torch.optim:LBFGS", tmp_path))
    assert not torch_only._compiled_by_the_class(torch.optim.LBFGS.step)


@pytest.mark.parametrize(("name", "status"), [("NormalizedSGD", "pass"), ("CountingNormalizedSGD", "warn")])
def test_a_step_that_compiles_its_own_helper_is_compared_with_that_compile_made_eager(
    name: str, status: str, tmp_path: Path
) -> None:
    """The eager step already runs the helper compiled (inductor by default, here bfloat16), which the
    trace of the whole step does not: compared as they were, they differed by the helper's rounding,
    which had been a warn telling of hidden state. With the helper run eagerly in the eager steps the
    two match, and hidden state still shows."""
    path = tmp_path / "compiles_its_own_helper.py"
    path.write_text(COMPILES_ITS_OWN_HELPER)
    outcome = CHECKS["graph_mode"](context(f"{path}:{name}", tmp_path))
    assert outcome.status == status, outcome.detail
    assert "the class compiles part of its step itself" in outcome.detail, outcome.detail


class HalfPrecisionSumSGD(PerParameter):
    """Computes its update in bfloat16 and, traced, sums it in another order: as the compiled graph's
    decompositions of a fused bfloat16 `addmm` round otherwise than eager's (timm's AdaMuon, whose
    Newton-Schulz iteration runs in bfloat16, differed by 2.5e-5)."""

    def update(self, p: Any, lr: float) -> None:
        g = p.grad.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            u = g + (g * 0.1 + g * 0.01)
        else:
            u = g + g * 0.1 + g * 0.01
        p.sub_(lr * u.to(p.dtype))


class HalfMomentumCompiledOtherwiseSGD(PerParameter):
    """Keeps its momentum in bfloat16 (a common memory saving), and its compiled update is 2% larger
    than its eager one: a true graph_mode fault, which bfloat16 state must not excuse."""

    def update(self, p: Any, lr: float) -> None:
        factor = 1.02 if torch.compiler.is_compiling() else 1.0
        momentum = self.state[p].setdefault("momentum", torch.zeros_like(p, dtype=torch.bfloat16))
        both = momentum.float().mul_(0.9).add_(p.grad)
        momentum.copy_(both)
        p.sub_(lr * factor * both)


def test_a_step_computing_in_bfloat16_is_judged_within_bfloat16_rounding(tmp_path: Path) -> None:
    """What rounding alone does to a step computing in bfloat16 is measured by the same steps with
    their bfloat16 made float32: float32's nudge alone had made its rounding a warn of hidden state.
    A compiled step that differs by more (2% of the update) still warns."""
    ctx = context(f"{__name__}:HalfPrecisionSumSGD", tmp_path, lr=0.1)
    outcome = CHECKS["graph_mode"](ctx)
    assert outcome.status == "skip", outcome.detail
    assert "or with their bfloat16 made float32" in outcome.detail
    assert "the step computes in bfloat16" in outcome.detail
    torch.manual_seed(0)
    start, batch = torch_only._tiny_model(), torch_only._batch()
    assert torch_only._rounding_sensitivity(ctx, start, batch)[1] == torch.bfloat16
    faulty = CHECKS["graph_mode"](context(f"{__name__}:HalfMomentumCompiledOtherwiseSGD", tmp_path))
    assert faulty.status == "warn", faulty.detail


class ForwardingModeSGD(torch.optim.SGD):
    """Forwards train()/eval() to the optimizer it holds, for schedule-free ones, as heavyball's
    SAMWrapper does; the one it holds here has neither."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.inner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)

    def train(self, mode: bool = True) -> Any:
        return self.inner.train(mode)  # type: ignore[attr-defined]

    def eval(self) -> Any:
        return self.train(False)


def test_a_train_that_raises_is_named_not_the_step(tmp_path: Path) -> None:
    """It had read "the first step ... raised", and a plain loop never calls train()."""
    outcome = build_checks.check_dense_step(context(f"{__name__}:ForwardingModeSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert outcome.detail.startswith("optimizer.train(), which a job calls before each training step, raised")
    assert "AttributeError" in outcome.detail and "the first step" not in outcome.detail
    assert "--needs '{\"train_eval\": false}'" in outcome.detail


class PrivateProbeSGD(PerParameter):
    """Draws Hutchinson-style ±1 probes from a generator of its own, which state_dict() never saves
    (timm's Adahessian): the probes scale a curvature term that the checks' quadratic loss, whose
    Hessian is the identity, makes 1 whatever is drawn."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, lr)
        self.generator = torch.Generator().manual_seed(2147483647)

    def update(self, p: Any, lr: float) -> None:
        z = torch.randint(0, 2, p.shape, generator=self.generator).to(p.dtype) * 2 - 1
        p.sub_(lr * p.grad * (z * z))


def test_a_generator_the_save_misses_is_named_though_the_next_step_matched(tmp_path: Path) -> None:
    """state_roundtrip had passed it: only a differing next step had it read the attributes."""
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:PrivateProbeSGD", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert "the next step after reloading matched the uninterrupted one, but self.generator is a random" in (
        outcome.detail
    )


class IdleGeneratorSGD(PlainSGD):
    """Holds an unseeded generator it draws from only when built with noise (off by default)."""

    def __init__(self, params: object, lr: float = 0.1, noise: float = 0.0) -> None:
        super().__init__(params, {"lr": lr})
        self.noise, self.generator = noise, torch.Generator()
        self.generator.seed()  # a nondeterministic seed: each build draws otherwise

    def step(self, closure: Any = None) -> Any:
        if self.noise:
            for p in (p for group in self.param_groups for p in group["params"]):
                p.add_(torch.randn(p.shape, generator=self.generator), alpha=self.noise)
        return super().step(closure)


def test_a_generator_no_step_drew_from_is_no_warning(tmp_path: Path) -> None:
    outcome = state_checks.check_state_roundtrip(context(f"{__name__}:IdleGeneratorSGD", tmp_path))
    assert outcome.status == "pass", outcome.detail


class OwnSaveAdamW(torch.optim.AdamW):
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict()


def test_the_save_overrides_named_are_the_users_own() -> None:
    """torch's AdamW defines __setstate__ itself: a subclass had been told to change "its own"."""
    from jobs.frameworks.torch_driver import TorchDriver

    params = [torch.nn.Parameter(torch.ones(2))]
    assert TorchDriver().save_overrides(torch.optim.AdamW(params)) == []
    assert TorchDriver().save_overrides(OwnSaveAdamW(params)) == ["state_dict"]


class BrokenSwitchSGD(PlainSGD):
    """A schedule-free-style switch with a bug of its own: turning the switch off is no fix."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def train(self, mode: bool = True) -> Any:
        raise RuntimeError("the averaged point was never set")

    def eval(self) -> Any:
        return self.train(False)


def test_a_broken_switch_of_its_own_is_not_told_to_turn_the_switch_off(tmp_path: Path) -> None:
    outcome = build_checks.check_dense_step(context(f"{__name__}:BrokenSwitchSGD", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert outcome.detail.startswith("optimizer.train(), which a job calls before each training step, raised")
    assert "train_eval" not in outcome.detail and "Fix: make train() work" in outcome.detail


TORCH_NON_FINITE = """
import math

import torch


class BestLossSGD(torch.optim.Optimizer):
    '''SGD keeping the lowest loss a callback reported: +inf, by design, until one does.'''

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p]["best"] = torch.tensor(math.inf)
                p.add_(p.grad, alpha=-group["lr"])


class InfScaleSGD(torch.optim.Optimizer):
    '''SGD whose state goes to +inf at its first step and is written in place at every step after it
    (inf stays inf): no sentinel, a step gone wrong.'''

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p]["scale"] = torch.ones_like(p) / 0.0
                self.state[p]["scale"].mul_(0.5)
                p.add_(p.grad, alpha=-group["lr"])


class InfRatioSGD(torch.optim.Optimizer):
    '''SGD keeping a ratio over a zero denominator: +-inf, replaced by a new tensor at every step.'''

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["ratio"] = p.grad.abs() / torch.zeros_like(p)
                p.add_(p.grad, alpha=-group["lr"])


class OffByOneAdam(torch.optim.Optimizer):
    '''Adam's bias correction at the step before this one: 1 - beta**0 is 0, the first update NaN.'''

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                t = state["step"]
                state["step"] += 1
                state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                corrected = (state["m"] / (1 - 0.9**t)) / (state["v"] / (1 - 0.999**t)).sqrt()
                p.add_(corrected, alpha=-group["lr"])
"""


@pytest.mark.parametrize(
    ("class_name", "status"),
    [("BestLossSGD", "pass"), ("OffByOneAdam", "fail")],
)
def test_distributed_judges_non_finite_values_by_what_was_finite_before_any_step(
    class_name: str, status: str, tmp_path: Path
) -> None:
    """State kept at +inf from its first step on ranks and one process alike had failed as "the update
    itself makes non-finite values" (it had passed before that fail was added); parameters made NaN
    by the update (a bias correction off by one) still fail so."""
    from jobs.checks.fresh import distributed

    path = tmp_path / "non_finite.py"
    path.write_text(TORCH_NON_FINITE)
    outcome = distributed(context(f"{path}:{class_name}", tmp_path))
    assert outcome.status == status, outcome
    if status == "fail":
        assert "the update itself makes non-finite values, on one process too" in outcome.detail, (
            outcome.detail
        )
        assert "beyond rounding" not in outcome.detail, outcome.detail
    else:
        assert "max abs difference to one process 0 " in outcome.detail, outcome.detail


@pytest.mark.parametrize(
    ("class_name", "status", "said"),
    [
        (
            "BestLossSGD",
            "pass",
            "state finite but for state[param 0]['best'], state[param 1]['best'], state[param 2]['best'], "
            "non-finite as a step set it and no step since wrote it: a sentinel",
        ),
        (
            "InfScaleSGD",
            "fail",
            "after 2 steps these are not finite: state[param 0]['scale'] (non-finite since step 1)",
        ),
        (
            "InfRatioSGD",
            "fail",
            "after 2 steps these are not finite: state[param 0]['ratio'] (non-finite since step 1)",
        ),
        ("OffByOneAdam", "fail", "after one step these are not finite: variable"),
    ],
)
def test_dense_step_tells_a_sentinel_torch_state_from_state_the_steps_keep_non_finite(
    class_name: str, status: str, said: str, tmp_path: Path
) -> None:
    """torch makes its state in the first step, so state at +inf by design (a lowest loss seen, until
    a loss comes) had failed dense_step as "not finite after one step": state a step set non-finite
    and the next steps never wrote is a sentinel. State the steps write while it stays infinite, in
    place or replaced, still fails, named with the step that first made it non-finite."""
    path = tmp_path / "non_finite.py"
    path.write_text(TORCH_NON_FINITE)
    outcome = build_checks.check_dense_step(context(f"{path}:{class_name}", tmp_path))
    assert outcome.status == status, outcome
    assert said in outcome.detail, outcome.detail


def test_checks_after_dense_step_blame_a_non_finite_update_not_a_cause_of_their_own(tmp_path: Path) -> None:
    """An update that makes NaN (a bias correction off by one) had been told by descends to check its
    signs, by param_groups to keep no bookkeeping outside param_groups and by mixed_precision to make
    its state with zeros_like, and graph_mode had warned of a compiled difference of nan: once
    dense_step has seen plain steps make non-finite values, each says it is the update's and gives
    dense_step's fix (graph_mode wherever eager and compiled steps both end non-finite)."""
    path = tmp_path / "non_finite.py"
    path.write_text(TORCH_NON_FINITE)
    ctx = context(f"{path}:OffByOneAdam", tmp_path)
    assert CHECKS["dense_step"](ctx).status == "fail"
    for check_id in ("descends", "schedule", "param_groups", "mixed_precision", "graph_mode"):
        outcome = CHECKS[check_id](ctx)
        assert outcome.status == "fail", (check_id, outcome)
        assert "the update itself makes non-finite values" in outcome.detail, (check_id, outcome.detail)
        assert "guard divisions and square roots with an epsilon" in outcome.detail, (
            check_id,
            outcome.detail,
        )


def test_a_rate_too_large_for_the_quadratic_keeps_descends_own_fix(tmp_path: Path) -> None:
    """SGD at a rate that overshoots a quadratic more each step overflows to non-finite values over
    many steps, while its first steps are finite (dense_step passes): that is the rate, as descends says."""
    ctx = context("torch.optim:SGD", tmp_path, lr=3.0)
    assert CHECKS["dense_step"](ctx).status == "pass"
    outcome = CHECKS["descends"](ctx)
    assert outcome.status == "fail", outcome
    assert "not far too large" in outcome.detail and "makes non-finite values" not in outcome.detail, outcome


class InferenceModeSGD(StepWithoutClosure):
    """Heavy-ball SGD stepping under torch.inference_mode(): its state is inference tensors, which
    count no writes (reading their version counter raises)."""

    @torch.inference_mode()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buffer = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    buffer.mul_(0.9).add_(p.grad)
                    p.sub_(group["lr"] * buffer)
        return None


def test_dense_step_passes_state_made_under_inference_mode(tmp_path: Path) -> None:
    """Watching state for sentinels read each tensor's version counter, which an inference tensor
    refuses: the check had stopped with "optlab's check failed"."""
    outcome = build_checks.check_dense_step(context(f"{__name__}:InferenceModeSGD", tmp_path))
    assert outcome.status == "pass", outcome
