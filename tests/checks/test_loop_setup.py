"""What the checks are told beyond hyperparameters, as a job spec states it (`LoopSetup`; `--needs`,
`--param-groups`, `--base`): stated needs step the class as the job would, a wrapper is built
around its base and stepped with the base's needs too, and bad options are usage errors naming the
option and what is allowed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from jobs.checks.__main__ import main
from jobs.checks.context import CheckContext, LoopSetup
from jobs.checks.runner import run_checks
from jobs.checks.target import UsageError
from tests.checks.tables import target_of

pytest.importorskip("pytorch_optimizer")

PO = "pytorch_optimizer.optimizer"
LOOKAHEAD = f"{PO}.lookahead:Lookahead"
ADA_HESSIAN = {"name": f"{PO}.adahessian:AdaHessian", "params": {"lr": 0.1}}
# What a wrapper's checks mean to serve: building it around the base and stepping it as the loop does.
STEPPED = ["construct", "dense_step", "descends", "none_grads", "state_roundtrip", "resume_exact"]

UNDETECTED_CLOSURE = '''
import torch


class NeedsAClosure(torch.optim.Optimizer):
    """Calls the closure it is given; its signature says it is optional, so detection cannot tell."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss
'''

# timm's Lookahead convention: no parameters argument; the first, `base_optimizer`, is the built base,
# whose param groups it shares and in whose state it keeps its own, leaving `self.state` empty (SAM's
# `base_optimizer` follows the parameters: a class).
BASE_FIRST_LOOKAHEAD = """
import torch


class BaseFirstLookahead(torch.optim.Optimizer):
    def __init__(self, base_optimizer, alpha=0.5, k=2):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1]; received {alpha}")
        self.base, self.alpha, self.k = base_optimizer, alpha, k
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}  # no super().__init__()
        self.defaults = base_optimizer.defaults
        self.param_groups = base_optimizer.param_groups
        self.state = {}

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state_dict):
        self.base.load_state_dict(state_dict)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] = group.get("lookahead_step", 0) + 1
            for p in group["params"]:
                slow = self.base.state[p].setdefault("slow", p.detach().clone())
                if group["lookahead_step"] % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss
"""


def test_a_wrapper_whose_first_argument_is_the_base_gets_it_built(tmp_path: Path) -> None:
    path = tmp_path / "base_first_lookahead.py"
    path.write_text(textwrap.dedent(BASE_FIRST_LOOKAHEAD))
    target = target_of(f"{path}:BaseFirstLookahead")
    assert target.entry.needs.base_optimizer == "base_optimizer"
    setup = LoopSetup(base={"name": "adamw", "params": {"lr": 0.01}})
    only = [*STEPPED, "state_untrainable", "step_cost"]
    report = run_checks(target, {}, only=only, setup=setup, workdir=tmp_path)
    assert {r.id: r.status for r in report.checks} == dict.fromkeys(only, "pass"), report.checks
    # Its state is what its state_dict() saves (the base's): for each of the 3 variables AdamW's step
    # and two moments, and its own slow copy.
    assert "none of 12 optimizer state tensors" in report.checks[-2].detail, report.checks[-2].detail
    # A wrapper is timed against its base alone: what it adds is its cost.
    assert "its base adamw alone" in report.checks[-1].detail, report.checks[-1].detail


# michaelrzhang's Lookahead convention: never runs torch.optim.Optimizer.__init__, so it has no
# self.defaults, and lends its base's param groups through a property.
LENDING_LOOKAHEAD = """
from collections import defaultdict

import torch


class LendingLookahead(torch.optim.Optimizer):
    def __init__(self, optimizer, alpha=0.5, k=2):
        self.optimizer, self.alpha, self.k, self.steps = optimizer, alpha, k, 0
        self.state = defaultdict(dict)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.state[p].setdefault("slow", p.detach().clone())
                if self.steps % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss
"""


def test_a_wrapper_without_defaults_is_told_what_add_param_group_lacks(tmp_path: Path) -> None:
    """Not optlab's own AttributeError on `self.defaults` blamed on the class: its groups are judged,
    and the add_param_group it inherits from torch, which reads self.defaults, fails saying why."""
    path = tmp_path / "lending_lookahead.py"
    path.write_text(LENDING_LOOKAHEAD)
    setup = LoopSetup(base={"name": "adamw", "params": {"lr": 0.01}})
    target = target_of(f"{path}:LendingLookahead")
    (result,) = run_checks(target, {}, only=["param_groups"], setup=setup, workdir=tmp_path).checks
    assert result.status == "fail", result.detail
    assert "add_param_group(lr=0.0025) after 2 steps, then a step, raised AttributeError" in result.detail
    assert "never ran torch.optim.Optimizer.__init__, which sets the self.defaults" in result.detail
    assert "Fix: call super().__init__(params, defaults)" in result.detail
    assert result.where == f"{path}:8", result.where  # its __init__


# Lookahead v2 before its fix: the constructor's groups get the wrapper's own group keys, a group
# added later does not (its add_param_group hands it to the base as it is).
GROUP_KEY_LOOKAHEAD = """
from collections import defaultdict

import torch
from torch.optim.optimizer import Optimizer


class GroupKeyLookahead(Optimizer):
    def __init__(self, optimizer, k=2, alpha=0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        groups = optimizer.param_groups
        Optimizer.__setstate__(
            self, {"defaults": optimizer.defaults, "state": defaultdict(dict), "param_groups": groups}
        )
        for group in self.param_groups:
            group["counter"] = 0
            group.setdefault("lookahead_alpha", alpha)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                for p in group["params"]:
                    slow = self.state[p].setdefault("slow", p.detach().clone())
                    slow.add_(p - slow, alpha=group["lookahead_alpha"])
                    p.copy_(slow)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss

    def add_param_group(self, param_group):
        param_group["counter"] = 0
        self.optimizer.add_param_group(param_group)
"""


@pytest.mark.parametrize("fixed", [False, True], ids=["add_param_group without the key", "with it"])
def test_a_group_key_an_added_group_lacks_is_told_to_be_set_in_add_param_group(
    tmp_path: Path, fixed: bool
) -> None:
    """Not "create a parameter's state in step()": the KeyError's key is a group key the constructor's
    groups hold and the added group lacks, so the fix is to set it where groups are added."""
    text = GROUP_KEY_LOOKAHEAD
    if fixed:
        sets = '        param_group.setdefault("lookahead_alpha", self.alpha)\n'
        text = text.replace(
            '        param_group["counter"] = 0\n', '        param_group["counter"] = 0\n' + sets
        )
    path = tmp_path / "group_key_lookahead.py"
    path.write_text(text)
    setup = LoopSetup(base={"name": "adamw", "params": {"lr": 0.01}})
    target = target_of(f"{path}:GroupKeyLookahead")
    (result,) = run_checks(target, {}, only=["param_groups"], setup=setup, workdir=tmp_path).checks
    if fixed:
        assert "KeyError" not in result.detail, result.detail
        return
    assert result.status == "fail", result.detail
    assert (
        "raised KeyError: 'lookahead_alpha': 'lookahead_alpha' is a key of the constructor's param groups"
        in (result.detail)
    )
    assert "the class's own add_param_group() does not set it" in result.detail
    assert (
        "Fix: set the key in add_param_group (param_group.setdefault('lookahead_alpha', ...)) or in defaults"
        in (result.detail)
    )
    assert "create a parameter's state in step()" not in result.detail
    line = next(n for n, code in enumerate(text.splitlines(), 1) if "def add_param_group" in code)
    assert result.where == f"{path}:{line}", result.where


# lonePatient's Lookahead v1: takes over its base's param_groups and makes a state of its own, and
# never runs torch.optim.Optimizer.__init__, so it lacks the hook dicts torch's methods read.
UNINITIALISED_LOOKAHEAD = """
from collections import defaultdict

import torch
from torch.optim.optimizer import Optimizer


class UninitialisedLookahead(Optimizer):
    def __init__(self, optimizer, k=2, alpha=0.5):
        self.optimizer, self.k, self.alpha, self.steps = optimizer, k, alpha, 0
        self.param_groups = optimizer.param_groups
        self.state = defaultdict(dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.state[p].setdefault("slow", p.detach().clone())
                if self.steps % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def state_dict(self):
        return {"fast": self.optimizer.state_dict(), "slow": super().state_dict()}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["fast"])
        super().load_state_dict(state_dict["slow"])

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)
"""
KEEPS_HOOKS = (
    "        self.state = defaultdict(dict)\n",
    "        Optimizer.__setstate__(self, {'defaults': optimizer.defaults, 'state': defaultdict(dict), "
    "'param_groups': optimizer.param_groups})\n        self.steps = 0\n",
)


@pytest.mark.parametrize(
    "initialised", [False, True], ids=["never runs Optimizer.__init__", "keeps its hooks"]
)
def test_a_class_that_never_runs_optimizer_init_is_told_so_at_its_init(
    tmp_path: Path, initialised: bool
) -> None:
    """Not a cascade of AttributeErrors on torch's hook dicts, each at whatever line met one, with the
    generic fix: the one cause, at the class's __init__, with the call to make."""
    text = UNINITIALISED_LOOKAHEAD.replace(*KEEPS_HOOKS) if initialised else UNINITIALISED_LOOKAHEAD
    path = tmp_path / "uninitialised_lookahead.py"
    path.write_text(text)
    setup = LoopSetup(base={"name": "adamw", "params": {"lr": 0.01}})
    only = ["config_roundtrip", "state_roundtrip", "resume_exact"]
    report = run_checks(
        target_of(f"{path}:UninitialisedLookahead"), {}, only=only, setup=setup, workdir=tmp_path
    )
    if initialised:  # a class that has what __init__ sets is never told it lacks it
        assert all("never ran" not in r.detail for r in report.checks), report.checks
        return
    line = next(n for n, code in enumerate(text.splitlines(), 1) if "def __init__" in code)
    for result in report.checks:
        assert result.status == "fail", result.detail
        assert (
            "object has no attribute '_optimizer_" in result.detail or "attribute 'defaults'" in result.detail
        )
        assert (
            "the class never ran torch.optim.Optimizer.__init__, which sets self.defaults and the hook dicts"
            in (result.detail)
        )
        assert "Fix: call super().__init__(params, defaults) in __init__; a wrapper" in result.detail
        assert result.where == f"{path}:{line}", (result.id, result.where)


def test_a_wrapper_over_a_base_with_modes_is_timed_against_the_base_in_training_mode(tmp_path: Path) -> None:
    # facebookresearch's schedule-free AdamW refuses to step until optimizer.train(): the base alone,
    # timed as the yardstick, is switched to training as the wrapper's base is.
    pytest.importorskip("schedulefree")
    setup = LoopSetup(base={"name": "schedulefree:AdamWScheduleFree", "params": {"lr": 0.01}})
    (result,) = run_checks(target_of(LOOKAHEAD), {}, only=["step_cost"], setup=setup, workdir=tmp_path).checks
    assert result.status in ("pass", "warn") and "its base" in result.detail, result.detail


def test_lookahead_over_ada_hessian_is_checked_with_the_graph_its_base_needs(tmp_path: Path) -> None:
    setup = LoopSetup(base=ADA_HESSIAN)
    context = CheckContext(target=target_of(LOOKAHEAD), params={"k": 5}, workdir=tmp_path, setup=setup)
    assert not context.target.entry.needs.create_graph and context.needs.create_graph
    assert context.lr == 0.1  # the base's: Lookahead has no rate of its own
    report = run_checks(target_of(LOOKAHEAD), {"k": 5}, only=STEPPED, setup=setup, workdir=tmp_path)
    assert {r.id: r.status for r in report.checks} == dict.fromkeys(STEPPED, "pass"), report.checks
    assert report.to_json()["setup"] == {"base": ADA_HESSIAN}


def test_without_the_bases_graph_the_step_fails(tmp_path: Path) -> None:
    """The evidence for the merge: the base's need stated away, AdaHessian's Hessian-vector product
    has no graph to differentiate."""
    setup = LoopSetup(base={**ADA_HESSIAN, "needs": {"create_graph": False}})
    report = run_checks(target_of(LOOKAHEAD), {"k": 5}, only=["dense_step"], setup=setup, workdir=tmp_path)
    assert report.checks[0].status == "fail" and "grad" in report.checks[0].detail


def test_a_stated_closure_is_served(tmp_path: Path) -> None:
    path = tmp_path / "needs_a_closure.py"
    path.write_text(textwrap.dedent(UNDETECTED_CLOSURE))
    target = target_of(f"{path}:NeedsAClosure")
    assert not target.entry.needs.closure
    only = ["dense_step", "descends"]
    plain = run_checks(target, {}, only=only, workdir=tmp_path)
    # step() without the closure it calls: one fail, and the later check is not run (one cause, one flag)
    assert [r.status for r in plain.checks] == ["fail", "skip"]
    stated = run_checks(target, {}, only=only, setup=LoopSetup(needs={"closure": True}), workdir=tmp_path)
    assert [r.status for r in stated.checks] == ["pass", "pass"], stated.checks


def test_a_class_that_runs_backward_on_its_closures_loss_fails_no_check(tmp_path: Path) -> None:
    # Its closure must return the loss with its graph: stepped as torch's convention has it (the
    # closure runs backward and returns the loss's value), its first step raised "element 0 of
    # tensors does not require grad" in dense_step.
    target = target_of("tests.checks.closure_contracts:OwnBackwardSGD")
    assert target.entry.needs.backward_in_step and target.entry.needs.closure
    report = run_checks(target, {}, workdir=tmp_path)
    statuses = {r.id: r.status for r in report.checks}
    assert "fail" not in statuses.values() and "warn" not in statuses.values(), report.checks
    for check_id in ("dense_step", "sparse", "resume_exact", "distributed", "closure", "param_groups"):
        assert statuses[check_id] == "pass", check_id
    (cost,) = [r for r in report.checks if r.id == "step_cost"]
    assert cost.status == "skip" and "stepped with a closure" in cost.detail  # not a TypeError quoted


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--needs", '{"closur": true}'], "--needs: unknown need 'closur'; known: closure, create_graph, "),
        (["--needs", '{"closure": "yes"}'], "--needs: need 'closure' must be bool; received 'yes'"),
        (["--needs", "[]"], "--needs must be a JSON object such as '{\"closure\": true}'"),
        (["--param-groups", '[{"match": {"ndim": "two"}}]'], "--param-groups[0].match.ndim: ndim must be"),
        (["--param-groups", '{"match": "rest"}'], "--param-groups must be a JSON list"),
        (
            ["--param-groups", '[{"match": {"ndim": ">=2"}, "params": {"momentun": 0.9}}]'],
            "--param-groups[0]: optimizer 'sgd' has no hyperparameter 'momentun'",
        ),
        (
            ["--param-groups", '[{"match": {"ndim": ">=2"}}, {"match": "rest", "params": {"lr": -1}}]'],
            "--param-groups[1]: lr must be a number > 0; received -1",
        ),
        (
            ["--base", '{"name": "adamw", "style": "torch"}'],
            "--base takes name, params and needs; received 'style'",
        ),
        (["--base", '{"name": "nope"}'], "--base: no optimizer named 'nope'"),
        (
            ["--base", '{"name": "adamw", "params": {"lr": -1}}'],
            "--base: optimizer 'adamw' (torch): lr must be a number > 0; received -1",
        ),
    ],
    ids=[
        "unknown need",
        "mistyped need",
        "not an object",
        "bad ndim",
        "not a list",
        "misspelt group key",
        "group lr",
        "base key",
        "base",
        "base lr",
    ],
)
def test_a_bad_option_is_a_usage_error_naming_it(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Class references: a name found in no style would re-run the checker for legacy tf.keras.
    target = LOOKAHEAD if "--base" in argv else "torch.optim:SGD"
    assert main([target, "--only", "construct", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_need_a_keras_step_cannot_serve_is_refused(tmp_path: Path) -> None:
    # Stated, it had been ignored: the Keras checks stepped the class as if it needed nothing.
    stated = LoopSetup(needs={"backward_in_step": True})
    with pytest.raises(UsageError, match="--needs: optimizer 'SGD' needs closure and backward_in_step"):
        run_checks(target_of("keras.optimizers:SGD"), {}, only=["construct"], setup=stated, workdir=tmp_path)


def test_a_recipe_for_a_keras_optimizer_is_refused(tmp_path: Path) -> None:
    recipe = LoopSetup(param_groups=[{"match": "rest", "params": {}}])
    with pytest.raises(UsageError, match="--param-groups: param groups are served for torch optimizers"):
        run_checks(target_of("keras.optimizers:SGD"), {}, only=["construct"], setup=recipe, workdir=tmp_path)


def test_the_setup_survives_its_json_form() -> None:
    setup = LoopSetup(
        needs={"closure": True},
        param_groups=[{"match": "rest", "params": {"use_muon": False}}],
        base=ADA_HESSIAN,
    )
    assert LoopSetup.from_json(setup.to_json()) == setup
    assert LoopSetup.from_json(None) == LoopSetup()
