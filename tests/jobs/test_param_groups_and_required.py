"""Param-group recipes (matching over (name, shape), the torch job's groups, the API's 422s) and
required hyperparameters (catalogued, refused when omitted, by the API and by the job)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from jobs.spec import Catalogue, CheckSpec, JobSpec, catalogue_errors, check_errors, optimizer_errors
from optimizers.param_groups import GroupRule, assign_groups
from optimizers.registry import Registry, entry_for_class, load_registry

from .helpers import digits_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MakeJob = Callable[..., Any]

DIGITS_MLP = [
    ("hidden_1.weight", (64, 64)),
    ("hidden_1.bias", (64,)),
    ("hidden_2.weight", (64, 64)),
    ("hidden_2.bias", (64,)),
    ("logits.weight", (10, 64)),
    ("logits.bias", (10,)),
]
# No weight decay on biases (and norms: any tensor under 2-d); half the rate for the head.
RECIPE = [
    {"match": {"ndim": "<2"}, "params": {"weight_decay": 0.0}},
    {"match": {"name": "logits.*"}, "params": {"lr": 0.005}},
]
ADAMW = {"name": "adamw", "params": {"lr": 0.01, "weight_decay": 0.01}, "param_groups": RECIPE}


def test_first_match_wins_and_the_rest_keep_the_optimizers_params() -> None:
    rules = [(GroupRule(ndim="<2"), {"weight_decay": 0.0}), (GroupRule(name="logits.*"), {"lr": 0.5})]
    groups = assign_groups(rules, DIGITS_MLP)
    assert [group.names for group in groups] == [
        ["hidden_1.bias", "hidden_2.bias", "logits.bias"],  # logits.bias is 1-d: the first rule takes it
        ["logits.weight"],
        ["hidden_1.weight", "hidden_2.weight"],
    ]
    assert [dict(group.params) for group in groups] == [{"weight_decay": 0.0}, {"lr": 0.5}, {}]
    both = assign_groups([(GroupRule(ndim=">=2", name="hidden_*"), {})], DIGITS_MLP)
    assert both[0].names == ["hidden_1.weight", "hidden_2.weight"]


def test_a_rule_that_matches_nothing_is_an_error_listing_the_parameters() -> None:
    rules = [(GroupRule(ndim="<2"), {}), (GroupRule(name="*.bias"), {})]  # the biases went to the first
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[1\] matches no parameter.*logits\.bias"):
        assign_groups(rules, DIGITS_MLP)


def test_a_job_with_a_recipe_has_the_groups_trains_and_verifies_its_checkpoints(make_job: MakeJob) -> None:
    job = make_job(digits_spec(optimizer=ADAMW, steps=60, checkpoint_every=25, eval_every=60))
    optimizer = job.session.build().optimizer
    shapes = [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups]
    assert shapes == [[(64,), (64,), (10,)], [(10, 64)], [(64, 64), (64, 64)]]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.01, 0.0),
        (0.005, 0.01),
        (0.01, 0.01),
    ]
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 3
    assert result.final["val_accuracy"] >= 0.9


def test_a_recipe_that_matches_nothing_fails_the_job_by_name(make_job: MakeJob) -> None:
    optimizer = {**ADAMW, "param_groups": [{"match": {"name": "encoder.*"}, "params": {"lr": 0.1}}]}
    with pytest.raises(ValueError, match=r"param_groups\[0\] matches no parameter of the model"):
        make_job(digits_spec(optimizer=optimizer, steps=2)).run()


@pytest.fixture(scope="module")
def catalogue(catalogue_data: dict[str, Any]) -> Catalogue:
    from pytorch_optimizer import Muon, Prodigy

    registry = load_registry(plugin_dirs=[], styles=["torch"])
    registry.add(entry_for_class(NeedsBeta, source="test"))
    registry.add(entry_for_class(Muon, source="test"))
    registry.add(entry_for_class(Prodigy, source="test"))
    registry.add(entry_for_class(AuxAdamLike, source="test"))
    return Catalogue.model_validate(
        {**catalogue_data, "optimizers": [entry.describe() for entry in registry.entries.values()]}
    )


def test_a_bad_group_param_gets_a_named_422(catalogue: Catalogue) -> None:
    optimizer = {**ADAMW, "param_groups": [RECIPE[0], {"match": {"ndim": "2"}, "params": {"lr": -1.0}}]}
    errors = optimizer_errors(
        JobSpec.model_validate({**_job(), "optimizer": optimizer}).optimizer, "torch", catalogue
    )
    assert [e.loc for e in errors] == [["body", "optimizer", "param_groups", 1, "params", "lr"]]
    assert "lr must be a number > 0; received -1.0" in errors[0].msg
    unknown = {**ADAMW, "param_groups": [{"match": {"ndim": "<2"}, "params": {"rho": 0.1}}]}
    errors = optimizer_errors(
        JobSpec.model_validate({**_job(), "optimizer": unknown}).optimizer, "torch", catalogue
    )
    assert errors[0].loc[-1] == "rho" and "accepted: lr" in errors[0].msg


def test_a_wrappers_groups_carry_its_bases_params(make_job: MakeJob) -> None:
    from pytorch_optimizer import Lookahead

    registry = load_registry(plugin_dirs=[], styles=["torch"])
    registry.add(entry_for_class(Lookahead, source="test"))
    base = {"name": "adamw", "params": ADAMW["params"]}
    optimizer = {"name": "lookahead", "params": {"k": 5}, "base": base, "param_groups": RECIPE}
    job = make_job(
        digits_spec(
            optimizer=optimizer,
            steps=50,
            checkpoint_every=25,
            eval_every=50,
        ),
        with_registry=registry,
    )
    groups = job.session.build().optimizer.optimizer.param_groups  # the AdamW that Lookahead wraps
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.01, 0.0), (0.005, 0.01), (0.01, 0.01)]
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2


@pytest.mark.parametrize(
    ("match", "says"),
    [({"ndim": "two"}, "ndim must be a comparison"), ({}, "match needs ndim"), ({"size": 2}, "Extra inputs")],
)
def test_a_malformed_match_is_refused_by_the_spec(match: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        JobSpec.model_validate({**_job(), "optimizer": {**ADAMW, "param_groups": [{"match": match}]}})


def test_a_bases_own_recipe_is_refused(catalogue: Catalogue) -> None:
    optimizer = {"name": "adamw", "params": {}, "base": ADAMW}
    choice = JobSpec.model_validate({**_job(), "optimizer": optimizer}).optimizer
    assert ["body", "optimizer", "base", "param_groups"] in [
        e.loc for e in optimizer_errors(choice, "torch", catalogue)
    ]


def test_tensorflow_jobs_take_no_param_groups(catalogue_data: dict[str, Any]) -> None:
    choice = JobSpec.model_validate({**_job(), "framework": "tensorflow", "optimizer": ADAMW}).optimizer
    errors = optimizer_errors(choice, "tensorflow", Catalogue.model_validate(catalogue_data))
    assert [e.loc for e in errors] == [["body", "optimizer", "param_groups"]]


# -- "rest", and group keys an optimizer reads without cataloguing them (the Muon family) ----------

# pytorch-optimizer's Muon steps each group by its `use_muon` flag (Newton-Schulz orthogonalised
# momentum for matrices, AdamW for the rest) and refuses a group without one; `use_muon` and the
# AdamW groups' `betas`/`eps` are group keys, not constructor arguments.
MUON = {
    "name": "muon",
    "params": {"lr": 0.02, "adamw_lr": 0.003},
    "param_groups": [
        {"match": {"ndim": ">=2"}, "params": {"use_muon": True}},
        {"match": "rest", "params": {"use_muon": False, "betas": [0.9, 0.99]}},
    ],
}


def test_rest_takes_every_parameter_left_and_must_come_last() -> None:
    spec = JobSpec.model_validate({**_job(), "optimizer": MUON})
    groups = assign_groups(spec.optimizer.group_rules(), DIGITS_MLP)
    assert [group.names for group in groups] == [
        ["hidden_1.weight", "hidden_2.weight", "logits.weight"],
        ["hidden_1.bias", "hidden_2.bias", "logits.bias"],
    ]
    reversed_groups = {**MUON, "param_groups": MUON["param_groups"][::-1]}
    with pytest.raises(ValueError, match=r'param_groups\[0\]: "rest" takes every parameter left'):
        JobSpec.model_validate({**_job(), "optimizer": reversed_groups})


def test_a_group_key_the_class_reads_passes_as_given_and_a_typo_gets_a_named_422(
    catalogue: Catalogue,
) -> None:
    choice = JobSpec.model_validate({**_job(), "optimizer": MUON}).optimizer
    assert optimizer_errors(choice, "torch", catalogue) == []
    cases: list[tuple[Any, str]] = [
        ({"use_muonn": True}, "its source reads no group key 'use_muonn'"),
        ({"use_muon": ["yes"]}, "it must be true/false, a number, a string or a list of numbers"),
        ({"use_muon": None}, "received null"),
        ({"params": 1}, "which its match chooses"),
        # torch's own: accepted, `capturable` failed the CPU step and `state` was read by nobody.
        ({"capturable": True}, "does not take 'capturable' as a hyperparameter: it is torch's own"),
        ({"state": 1}, "does not take 'state' as a hyperparameter: it is torch's own"),
        ({"param_groups": "x"}, "does not take 'param_groups' as a hyperparameter"),
    ]
    for params, says in cases:
        groups = [
            {"match": {"ndim": ">=2"}, "params": {"use_muon": True}},
            {"match": "rest", "params": params},
        ]
        bad = JobSpec.model_validate({**_job(), "optimizer": {**MUON, "param_groups": groups}}).optimizer
        errors = optimizer_errors(bad, "torch", catalogue)
        assert [e.loc for e in errors] == [
            ["body", "optimizer", "param_groups", 1, "params", next(iter(params))]
        ]
        assert says in errors[0].msg, errors[0].msg


def test_the_muon_hybrid_job_has_use_muon_groups_trains_to_090_and_verifies_its_checkpoints(
    make_job: MakeJob,
) -> None:
    from pytorch_optimizer import Muon

    registry = load_registry(plugin_dirs=[], styles=["torch"])
    registry.add(entry_for_class(Muon, source="test"))
    job = make_job(
        digits_spec(optimizer=MUON, steps=100, checkpoint_every=25, eval_every=100), with_registry=registry
    )
    groups = job.session.build().optimizer.param_groups
    assert [(g["use_muon"], [tuple(p.shape) for p in g["params"]]) for g in groups] == [
        (True, [(64, 64), (64, 64), (10, 64)]),
        (False, [(64,), (64,), (10,)]),
    ]
    assert groups[1]["betas"] == (0.9, 0.99) and groups[1]["lr"] == 0.003  # the list as a pair
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 4
    assert result.final["val_accuracy"] >= 0.9


def test_the_job_refuses_a_group_key_the_class_never_reads(make_job: MakeJob) -> None:
    typo = {**ADAMW, "param_groups": [{"match": {"ndim": "<2"}, "params": {"weight_decy": 0.0}}]}
    with pytest.raises(ValueError, match=r"param_groups\[0\]: .*reads no group key 'weight_decy'"):
        make_job(digits_spec(optimizer=typo, steps=2)).run()


def test_the_keys_a_class_reads_come_from_its_source_and_its_declaration() -> None:
    from pytorch_optimizer import Muon

    from optimizers.param_groups import read_group_keys

    keys = read_group_keys(Muon)
    assert keys is not None and {"use_muon", "betas", "eps", "ns_steps"} <= keys
    assert "params" not in keys and not any(key.startswith("_") for key in keys)
    assert not keys & {"capturable", "foreach", "state", "param_groups"}  # torch's own, read by its base

    class Declares(torch.optim.SGD):
        optlab_group_keys = ("read_by_name", "maximize")  # a step of its own that reads torch's flag

    assert {"read_by_name", "maximize"} <= (read_group_keys(Declares) or frozenset())
    assert "capturable" not in (read_group_keys(Declares) or frozenset())


class StateAndGroups(torch.optim.Optimizer):
    """Keeps `momentum` in each parameter's state, reads `decay` from its groups and from its state
    alike, and takes a `state` argument elsewhere (which must not make state keys group keys)."""

    def __init__(self, params: Any, lr: float = 0.1, decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "decay": decay})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                    state["decay"] = group["decay"]
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"] * (1 - state["decay"]))


def test_keys_a_class_only_ever_uses_on_a_parameter_s_state_are_no_group_keys() -> None:
    """A group setting SGD's `momentum_buffer` or a plugin's state key had been passed to the groups
    unread: the superset of keys held the state's too, so a name that happens to be a state key
    slipped past as a typo would not."""
    from optimizers.param_groups import read_group_keys

    assert "momentum_buffer" not in (read_group_keys(torch.optim.SGD) or frozenset())
    assert not {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} & (
        read_group_keys(torch.optim.AdamW) or frozenset()
    )
    keys = read_group_keys(StateAndGroups) or frozenset()
    assert "momentum" not in keys
    assert {"lr", "decay"} <= keys  # read from its groups too


class AuxAdamLike(torch.optim.Optimizer):
    """KellerJordan's SingleDeviceMuonWithAuxAdam in miniature: its only argument, `param_groups`, takes
    groups that must each say `use_muon`; the class fills each group's own defaults and refuses any
    other key. Its catalogue had asked for `param_groups` as a required hyperparameter, so no job
    could build it."""

    def __init__(self, param_groups):  # type: ignore[no-untyped-def]
        for group in param_groups:
            assert "use_muon" in group
            group["lr"] = group.get("lr", 0.02 if group["use_muon"] else 0.003)
            assert set(group) == {"params", "lr", "use_muon"}
        super().__init__(param_groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group["use_muon"]:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buffer.mul_(0.9).add_(p.grad)
                p.add_(buffer.sign(), alpha=-group["lr"])


def test_a_class_taking_param_groups_first_trains_with_a_recipe_of_its_groups(
    catalogue: Catalogue, make_job: MakeJob
) -> None:
    optimizer = {
        "name": "aux_adam_like",
        "params": {},
        "param_groups": [
            {"match": {"ndim": ">=2"}, "params": {"use_muon": True}},
            {"match": "rest", "params": {"use_muon": False, "lr": 0.01}},
        ],
    }
    fields = {"optimizer": optimizer, "schedule": {"name": "constant"}}
    assert optimizer_errors(JobSpec.model_validate({**_job(), **fields}).optimizer, "torch", catalogue) == []
    registry = load_registry(plugin_dirs=[], styles=["torch"])
    registry.add(entry_for_class(AuxAdamLike, source="test"))
    job = make_job(
        digits_spec(**fields, steps=40, checkpoint_every=20, eval_every=40), with_registry=registry
    )
    groups = job.session.build().optimizer.param_groups
    assert [(g["use_muon"], g["lr"], len(g["params"])) for g in groups] == [(True, 0.02, 3), (False, 0.01, 3)]
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2
    assert result.final["train_loss"] < 1.5  # it trains: from about ln(10) = 2.3
    # Its rates are in its groups, so a schedule reaches them (the spec had allowed only constant).
    cosine = {**fields, "schedule": {"name": "cosine"}}
    assert catalogue_errors(JobSpec.model_validate({**_job(), **cosine}), catalogue, max_steps=10**6) == []
    scheduled = make_job(
        digits_spec(**cosine, steps=40, checkpoint_every=20, eval_every=40), with_registry=registry
    ).run()
    assert scheduled.checkpoints_verified == 2 and scheduled.final["train_loss"] < 1.5


# -- required hyperparameters ---------------------------------------------------------------------


class NeedsBeta(torch.optim.SGD):
    """SGD with a required beta, to show an argument with no default."""

    def __init__(self, params: Any, beta: float, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.beta = beta


def test_an_argument_with_no_default_and_a_tunable_type_is_catalogued_as_required() -> None:
    entry = entry_for_class(NeedsBeta, source="test")
    assert entry.params["beta"].required and not entry.params["lr"].required
    published = {p["name"]: p for p in entry.describe()["params"]}
    assert published["beta"]["required"] is True and published["beta"]["default"] is None
    assert published["lr"]["required"] is False


def test_a_job_or_check_that_omits_it_is_refused_by_name(catalogue: Catalogue) -> None:
    job = JobSpec.model_validate({**_job(), "optimizer": {"name": "needs_beta", "params": {"lr": 0.1}}})
    errors = optimizer_errors(job.optimizer, "torch", catalogue)
    assert [(e.loc, e.type) for e in errors] == [(["body", "optimizer", "params", "beta"], "missing")]
    assert "requires hyperparameter 'beta' (a number)" in errors[0].msg
    check = CheckSpec.model_validate({"optimizer": {"name": "needs_beta", "params": {}}})
    assert [e.loc for e in check_errors(check, catalogue)] == [["body", "optimizer", "params", "beta"]]
    given = JobSpec.model_validate({**_job(), "optimizer": {"name": "needs_beta", "params": {"beta": 0.5}}})
    assert optimizer_errors(given.optimizer, "torch", catalogue) == []
    # null is no value: the default null a required argument is published with is not one to send.
    null = JobSpec.model_validate({**_job(), "optimizer": {"name": "needs_beta", "params": {"beta": None}}})
    (error,) = optimizer_errors(null.optimizer, "torch", catalogue)
    assert error.loc[-1] == "beta" and "beta must be a number; received null" in error.msg


def test_the_registry_refuses_to_build_without_it_and_passes_it_on() -> None:
    registry = Registry()
    registry.add(entry_for_class(NeedsBeta, source="test"))
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="requires hyperparameter 'beta'"):
        registry.build("needs_beta", params, {"lr": 0.1})
    assert registry.build("needs_beta", params, {"beta": 0.5}).beta == 0.5


def _job() -> dict[str, Any]:
    return {"workload": {"name": "digits_mlp"}, "optimizer": ADAMW, "steps": 10}


# -- optional numbers -----------------------------------------------------------------------------


def test_an_optional_number_is_given_or_left_to_the_class_through_the_api(catalogue: Catalogue) -> None:
    """Prodigy's `beta3: float | None = None` (None: the class takes sqrt(beta2)): left out or null,
    the class decides; a number reaches the class; anything else is a 422 at the argument."""
    from pytorch_optimizer import Prodigy

    entry = entry_for_class(Prodigy, source="test")
    (published,) = [p for p in entry.describe()["params"] if p["name"] == "beta3"]
    assert (published["type"], published["default"], published["required"]) == ("float", None, False)

    def errors(params: dict[str, Any]) -> list[Any]:
        job = JobSpec.model_validate({**_job(), "optimizer": {"name": "prodigy", "params": params}})
        return optimizer_errors(job.optimizer, "torch", catalogue)

    assert errors({}) == errors({"beta3": None}) == errors({"beta3": 0.5}) == []
    (wrong,) = errors({"beta3": "sqrt"})
    assert wrong.loc == ["body", "optimizer", "params", "beta3"] and "beta3 must be a number" in wrong.msg
    params = [torch.zeros(2, requires_grad=True)]
    assert entry.create({"beta3": 0.5}, model_params=params).param_groups[0]["beta3"] == 0.5
    assert entry.create({}, model_params=params).param_groups[0]["beta3"] is None  # the class's own


# -- a hyperparameter that is an enum's member (Distributed Shampoo's `weight_decay_type`) -----------


def test_an_enum_hyperparameter_is_chosen_by_name_by_the_api_the_job_and_a_group(
    make_job: MakeJob, catalogue_data: dict[str, Any]
) -> None:
    from tests.checks.own_types_in_groups import AllowedDecayKind, KindDecaySGD

    registry = load_registry(plugin_dirs=[], styles=["torch"])
    registry.add(entry_for_class(KindDecaySGD, source="test"))
    catalogue = Catalogue.model_validate(
        {**catalogue_data, "optimizers": [entry.describe() for entry in registry.entries.values()]}
    )
    optimizer = {
        "name": "kind_decay_sgd",
        "params": {"lr": 0.05, "decay": "COUPLED"},
        "param_groups": [{"match": {"ndim": "<2"}, "params": {"decay": "DECOUPLED"}}],
    }
    choice = JobSpec.model_validate({**_job(), "optimizer": optimizer}).optimizer
    assert optimizer_errors(choice, "torch", catalogue) == []
    wrong = {**optimizer, "params": {"decay": "SIDEWAYS"}}
    errors = optimizer_errors(
        JobSpec.model_validate({**_job(), "optimizer": wrong}).optimizer, "torch", catalogue
    )
    assert [e.loc for e in errors] == [["body", "optimizer", "params", "decay"]]
    assert 'must be "COUPLED" or "DECOUPLED"' in errors[0].msg
    job = make_job(digits_spec(optimizer=optimizer, steps=20, checkpoint_every=10), with_registry=registry)
    groups = job.session.build().optimizer.param_groups
    assert [g["decay"] for g in groups] == [AllowedDecayKind.DECOUPLED, AllowedDecayKind.COUPLED]
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2
