"""JobSpec validation (strict pydantic) and catalogue_errors against the real catalogue."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.checks.report import CHECK_IDS
from jobs.spec import (
    Catalogue,
    CheckSpec,
    JobSpec,
    catalogue_errors,
    check_errors,
    parse_spec,
    with_resolved_style,
)

EXAMPLE: dict[str, Any] = JobSpec.model_json_schema()["examples"][0]


def example(**overrides: Any) -> dict[str, Any]:
    return {**copy.deepcopy(EXAMPLE), **overrides}


def with_optimizer(name: str = "ema_momentum", **params: Any) -> dict[str, Any]:
    return example(optimizer={"name": name, "params": params})


def test_the_documented_example_is_valid() -> None:
    spec = JobSpec.model_validate(EXAMPLE)
    assert spec.steps == 300
    assert spec.lr == 0.05
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_defaults_fill_in_what_is_left_out() -> None:
    spec = JobSpec.model_validate(
        {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "adam"}, "steps": 5}
    )
    assert (spec.framework, spec.schedule.name, spec.device) == ("torch", "constant", "auto")
    assert spec.lr is None


@pytest.mark.parametrize(
    ("data", "field"),
    [
        pytest.param(example(steps=0), "steps", id="steps zero"),
        pytest.param(example(steps=-5), "steps", id="steps negative"),
        pytest.param(example(steps="300"), "steps", id="steps as a string (strict)"),
        pytest.param(example(steps=300.0), "steps", id="steps as a float (strict)"),
        pytest.param(example(steps=True), "steps", id="steps as a bool (strict)"),
        pytest.param(example(batch_size=0), "batch_size", id="batch_size zero"),
        pytest.param(example(seed=-1), "seed", id="seed negative"),
        pytest.param(example(learning_rate=0.1), "learning_rate", id="unknown top-level field"),
        pytest.param(example(framework="jax"), "framework", id="unknown framework"),
        pytest.param(example(device="gpu"), "device", id="device gpu"),
        pytest.param(example(device="cuda:"), "device", id="device cuda colon"),
        pytest.param(example(device="cuda:123"), "device", id="device index too long"),
        pytest.param(example(device="CPU"), "device", id="device upper case"),
        pytest.param(example(experiment="a\nb"), "experiment", id="experiment with a newline"),
        pytest.param(with_optimizer(lr=float("nan")), "optimizer", id="lr NaN"),
        pytest.param(with_optimizer(lr=float("inf")), "optimizer", id="lr inf"),
        pytest.param(with_optimizer("adam", betas=[0.9, float("-inf")]), "optimizer", id="-inf in a list"),
        pytest.param(with_optimizer(lr={"value": 0.1}), "optimizer", id="hyperparameter not a scalar"),
        pytest.param(example(optimizer={"name": "x" * 101}), "optimizer", id="name too long"),
        pytest.param(example(optimizer={"name": ""}), "optimizer", id="name empty"),
        pytest.param(example(optimizer={"name": "ema momentum"}), "optimizer", id="name with a space"),
        pytest.param(
            example(workload={"name": "digits_mlp", "extra": 1}), "workload", id="unknown component field"
        ),
        pytest.param(
            example(optimizer={"name": "adam", "params": {"k" * 101: 1}}),
            "optimizer",
            id="hyperparameter name too long",
        ),
    ],
)
def test_invalid_specs_are_rejected_at_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(data)
    assert {error["loc"][0] for error in raised.value.errors()} == {field}


def test_a_non_finite_hyperparameter_names_the_key() -> None:
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(with_optimizer(lr=0.1, beta=float("nan")))
    (error,) = raised.value.errors()
    assert error["loc"][:2] == ("optimizer", "params")
    assert "beta" in error["msg"]
    assert "finite" in error["msg"]


def test_longest_allowed_name_is_accepted() -> None:
    assert JobSpec.model_validate(example(optimizer={"name": "x" * 100})).optimizer.name == "x" * 100


@pytest.mark.parametrize(
    ("optimizer", "seed", "expected"),
    [
        ({"name": "ema_momentum", "params": {"lr": 0.05}}, 0, "ema_momentum lr=0.05 digits_mlp seed=0"),
        ({"name": "adam", "params": {"lr": 1}}, 3, "adam lr=1 digits_mlp seed=3"),
        ({"name": "adam"}, 1, "adam digits_mlp seed=1"),
        ({"name": "sgd", "params": {"lr": True}}, 1, "sgd digits_mlp seed=1"),
    ],
)
def test_run_name_reads_well_in_the_ui(optimizer: dict[str, Any], seed: int, expected: str) -> None:
    assert JobSpec.model_validate(example(optimizer=optimizer, seed=seed)).run_name() == expected


def test_a_tensorflow_runs_name_says_its_style() -> None:
    """Its runs and a torch job's of the same optimizer had read alike in one experiment's charts."""
    tensorflow = example(framework="tensorflow", optimizer={"name": "ema_momentum", "params": {"lr": 0.05}})
    assert JobSpec.model_validate(tensorflow).run_name() == "ema_momentum (keras) lr=0.05 digits_mlp seed=0"
    legacy = example(framework="tensorflow", optimizer={"name": "adam", "style": "tf_legacy"})
    assert JobSpec.model_validate(legacy).run_name() == "adam (tf_legacy) digits_mlp seed=0"


def test_flat_params_are_dotted_strings() -> None:
    spec = JobSpec.model_validate(
        example(optimizer={"name": "adam", "params": {"lr": 0.001, "betas": [0.9, 0.99]}})
    )
    flat = spec.flat_params()
    assert flat["optimizer.name"] == "adam"
    assert flat["optimizer.lr"] == "0.001"
    assert flat["optimizer.betas"] == "[0.9, 0.99]"
    assert flat["schedule.name"] == "cosine"
    assert flat["schedule.warmup_steps"] == "20"
    assert flat["workload.name"] == "digits_mlp"
    assert (flat["steps"], flat["seed"], flat["device"]) == ("300", "0", "auto")
    assert all(isinstance(value, str) for value in flat.values())


def test_a_param_longer_than_mlflow_keeps_says_it_was_cut() -> None:
    """An 11 kB param-group recipe reached MLflow cut at 6000 characters: JSON that read as whole."""
    groups = [
        {"match": {"name": f"{'block.' * 30}{i}.*"}, "params": {"lr": 0.001 + i * 1e-6}} for i in range(32)
    ]
    spec = JobSpec.model_validate(
        example(optimizer={"name": "adam", "params": {"lr": 0.001}, "param_groups": groups})
    )
    recipe = spec.flat_params()["optimizer.param_groups"]
    whole = json.dumps(spec.model_dump(mode="json")["optimizer"]["param_groups"], separators=(",", ":"))
    assert len(whole) > 6000 and len(recipe) == 6000
    assert recipe.endswith(f"... (cut: {len(whole)} characters in all; the whole is in the run's spec.json)")
    assert whole.startswith(recipe[:5000])


# -- catalogue_errors -------------------------------------------------------------------------------

MAX_STEPS = 10_000


@pytest.fixture(scope="module")
def catalogue(catalogue_data: dict[str, Any]) -> Catalogue:
    return Catalogue.model_validate(catalogue_data)


def test_the_example_passes_the_catalogue(catalogue: Catalogue) -> None:
    assert catalogue_errors(JobSpec.model_validate(EXAMPLE), catalogue, max_steps=MAX_STEPS) == []


def test_the_catalogue_lists_the_builtins(catalogue: Catalogue) -> None:
    assert {"ema_momentum", "sgd", "adam", "adamw"} <= {o["name"] for o in catalogue.optimizers}
    assert catalogue.workload("digits_mlp") is not None
    assert catalogue.errors == []


@pytest.mark.parametrize(
    ("data", "loc", "fragments"),
    [
        pytest.param(
            with_optimizer("shampoo", lr=0.1),
            ["body", "optimizer", "name"],
            ["unknown optimizer 'shampoo'", "adam", "ema_momentum", "lion", "sgd"],
            id="unknown optimizer",
        ),
        pytest.param(
            example(schedule={"name": "triangle"}),
            ["body", "schedule", "name"],
            ["unknown schedule 'triangle'", "constant", "cosine"],
            id="unknown schedule",
        ),
        pytest.param(
            example(workload={"name": "cifar10"}),
            ["body", "workload", "name"],
            ["unknown workload 'cifar10'", "digits_mlp"],
            id="unknown workload",
        ),
        pytest.param(
            with_optimizer(lr=0.05, momentum=0.9),
            ["body", "optimizer", "params", "momentum"],
            ["no hyperparameter 'momentum'", "accepted: lr, beta, weight_decay"],
            id="unknown hyperparameter",
        ),
        pytest.param(
            with_optimizer(lr=0.0),
            ["body", "optimizer", "params", "lr"],
            ["> 0", "received 0"],
            id="lr zero",
        ),
        pytest.param(
            with_optimizer(lr=-0.1),
            ["body", "optimizer", "params", "lr"],
            ["> 0", "received -0.1"],
            id="lr negative",
        ),
        pytest.param(
            with_optimizer(lr="0.05"),
            ["body", "optimizer", "params", "lr"],
            ["a number", 'received "0.05"'],
            id="lr as a string",
        ),
        pytest.param(
            with_optimizer(lr=True),
            ["body", "optimizer", "params", "lr"],
            ["a number", "received true"],
            id="lr as a bool",
        ),
        pytest.param(
            with_optimizer(lr=0.05, beta=1.5),
            ["body", "optimizer", "params", "beta"],
            ["[0, 1)", "received 1.5"],
            id="beta out of range",
        ),
        pytest.param(
            with_optimizer("adam", betas=[0.9, 1.0]),
            ["body", "optimizer", "params", "betas"],
            ["[0, 1)", "received [0.9, 1.0]"],
            id="adam betas out of range",
        ),
        pytest.param(
            example(schedule={"name": "cosine", "params": {"warmup_steps": -1}}),
            ["body", "schedule", "params", "warmup_steps"],
            [">= 0", "received -1"],
            id="schedule parameter out of range",
        ),
        pytest.param(
            example(schedule={"name": "constant", "params": {"warmup_steps": 5}}),
            ["body", "schedule", "params", "warmup_steps"],
            ["no parameter 'warmup_steps'", "accepted: none"],
            id="schedule without parameters",
        ),
        pytest.param(
            example(workload={"name": "digits_mlp", "params": {"hidden": 0}}),
            ["body", "workload", "params", "hidden"],
            ["[1, 4096]", "received 0"],
            id="workload parameter out of range",
        ),
        pytest.param(
            example(steps=MAX_STEPS + 1),
            ["body", "steps"],
            [f"at most {MAX_STEPS}", f"received {MAX_STEPS + 1}"],
            id="steps above max_steps",
        ),
        pytest.param(
            example(batch_size=2000),
            ["body", "batch_size"],
            ["training set size 1437", "received 2000"],
            id="batch larger than the training set",
        ),
    ],
)
def test_catalogue_errors_point_at_the_field(
    catalogue: Catalogue, data: dict[str, Any], loc: list[str], fragments: list[str]
) -> None:
    errors = catalogue_errors(JobSpec.model_validate(data), catalogue, max_steps=MAX_STEPS)
    assert [error.loc for error in errors] == [loc]
    for fragment in fragments:
        assert fragment in errors[0].msg


def test_catalogue_errors_reports_every_problem(catalogue: Catalogue) -> None:
    data = example(optimizer={"name": "ema_momentum", "params": {"lr": 0, "beta": 1.5}}, steps=MAX_STEPS + 1)
    errors = catalogue_errors(JobSpec.model_validate(data), catalogue, max_steps=MAX_STEPS)
    assert sorted(error.loc[-1] for error in errors) == ["beta", "lr", "steps"]


# -- CheckSpec: a check job ----------------------------------------------------------------------------


def check(**fields: Any) -> dict[str, Any]:
    return {"optimizer": {"name": "lion", "params": {"lr": 0.0003}}, **fields}


def test_a_check_spec_defaults_to_every_check_in_its_own_experiment() -> None:
    spec = CheckSpec.model_validate(check())
    assert (spec.kind, spec.framework, spec.experiment) == ("check", "torch", "optimizer-checks")
    assert spec.check_ids() == list(CHECK_IDS)


def test_a_subset_runs_in_the_stable_order() -> None:
    spec = CheckSpec.model_validate(check(checks=["sparse", "construct"]))
    assert spec.check_ids() == ["construct", "sparse"]


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        pytest.param(check(checks=["construct", "nope"]), "checks", "unknown check id 'nope'", id="unknown"),
        pytest.param(check(checks=[]), "checks", "at least 1", id="empty subset"),
        pytest.param(check(kind="train"), "kind", "'check'", id="another kind"),
        pytest.param(check(steps=10), "steps", "Extra inputs", id="a training field"),
        pytest.param(check(framework="jax"), "framework", "torch", id="unknown framework"),
        pytest.param({"framework": "torch"}, "optimizer", "Field required", id="no optimizer"),
    ],
)
def test_invalid_check_specs_are_rejected_at_the_field(
    data: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        CheckSpec.model_validate(data)
    (error,) = raised.value.errors()
    assert error["loc"][0] == field and fragment in error["msg"]


def test_a_check_reads_well_in_mlflow() -> None:
    spec = CheckSpec.model_validate(check(checks=["construct", "sparse"]))
    assert spec.run_name() == "check lion lr=3e-4 (torch)"
    assert CheckSpec.model_validate({"optimizer": {"name": "lion"}}).run_name() == "check lion (torch)"
    assert spec.flat_params() == {
        "framework": "torch",
        "optimizer.name": "lion",
        "optimizer.lr": "0.0003",
        "checks": "construct,sparse",
        "experiment": "optimizer-checks",
    }


def test_parse_spec_tells_the_kinds_apart() -> None:
    assert isinstance(parse_spec(CheckSpec.model_validate(check()).model_dump_json()), CheckSpec)
    assert isinstance(parse_spec(JobSpec.model_validate(EXAMPLE).model_dump_json()), JobSpec)
    with pytest.raises(ValidationError):
        parse_spec('{"kind": "check", "steps": 3}')


def test_check_errors_share_the_optimizer_validation_of_training_jobs(catalogue: Catalogue) -> None:
    assert check_errors(CheckSpec.model_validate(check()), catalogue) == []
    bad = {"name": "ema_momentum", "params": {"lr": 0, "momentum": 0.9}}
    as_check = check_errors(CheckSpec.model_validate(check(optimizer=bad)), catalogue)
    as_job = catalogue_errors(JobSpec.model_validate(example(optimizer=bad)), catalogue, max_steps=MAX_STEPS)
    assert as_check == as_job and [error.loc[-1] for error in as_check] == ["lr", "momentum"]
    unknown = check_errors(CheckSpec.model_validate(check(optimizer={"name": "shampoo"})), catalogue)
    assert [error.loc for error in unknown] == [["body", "optimizer", "name"]]
    styled = check_errors(
        CheckSpec.model_validate(check(optimizer={"name": "lion", "style": "keras"})), catalogue
    )
    assert "leave style out" in styled[0].msg


def test_a_tensorflow_check_gets_the_style_it_will_run(catalogue: Catalogue) -> None:
    spec = CheckSpec.model_validate(check(framework="tensorflow"))
    resolved = with_resolved_style(spec, catalogue)
    assert isinstance(resolved, CheckSpec) and resolved.optimizer.style == "keras"


# -- Loop needs: a wrapper's base, needs a spec states ---------------------------------------------------

LOOKAHEAD = {"name": "lookahead", "params": {"k": 5}, "base": {"name": "adamw", "params": {"lr": 0.001}}}


@pytest.fixture(scope="module")
def wrapper_catalogue(catalogue_data: dict[str, Any]) -> Catalogue:
    """The real catalogue plus pytorch-optimizer's wrappers, and a Keras optimizer that needs a closure."""
    from pytorch_optimizer import SAM, Lookahead

    from optimizers.registry import entry_for_class

    data = copy.deepcopy(catalogue_data)
    data["optimizers"] += [entry_for_class(cls, source="test").describe() for cls in (SAM, Lookahead)]
    keras_sgd = next(o for o in data["optimizers"] if o["name"] == "sgd" and o["style"] == "keras")
    data["optimizers"].append(
        {**keras_sgd, "name": "keras_sam", "needs": {**keras_sgd["needs"], "closure": True}}
    )
    return Catalogue.model_validate(data)


def test_a_wrapper_with_its_base_passes_and_takes_the_rate_from_it(wrapper_catalogue: Catalogue) -> None:
    spec = JobSpec.model_validate(example(optimizer=LOOKAHEAD))
    assert catalogue_errors(spec, wrapper_catalogue, max_steps=MAX_STEPS) == []
    assert spec.lr == 0.001
    assert spec.run_name() == "lookahead(adamw) lr=0.001 digits_mlp seed=0"
    assert spec.flat_params()["optimizer.base.name"] == "adamw"
    assert spec.flat_params()["optimizer.base.lr"] == "0.001"


@pytest.mark.parametrize(
    ("optimizer", "loc", "fragment"),
    [
        (
            {"name": "lookahead", "params": {"k": 5}},
            ["body", "optimizer", "base"],
            "name it in optimizer.base",
        ),
        ({"name": "sam", "params": {}}, ["body", "optimizer", "base"], "'base_optimizer' argument"),
        (
            {"name": "adamw", "params": {}, "base": {"name": "sgd"}},
            ["body", "optimizer", "base"],
            "wraps no base optimizer",
        ),
        (
            {**LOOKAHEAD, "base": {"name": "nope"}},
            ["body", "optimizer", "base", "name"],
            "unknown optimizer 'nope'",
        ),
        (
            {**LOOKAHEAD, "base": {"name": "adamw", "params": {"lr": -1.0}}},
            ["body", "optimizer", "base", "params", "lr"],
            "lr",
        ),
        (
            {**LOOKAHEAD, "base": {"name": "sam", "base": {"name": "sgd"}}},
            ["body", "optimizer", "base"],
            "is itself a wrapper",
        ),
        ({**LOOKAHEAD, "params": {"lr": 0.1}}, ["body", "optimizer", "params", "lr"], "accepted: k, alpha"),
        (
            {"name": "sgd", "params": {}, "needs": {"base_optimizer": "optimizer"}},
            ["body", "optimizer", "base"],
            "name it in optimizer.base",
        ),
    ],
    ids=[
        "wrapper without base",
        "sam without base",
        "base on a plain optimizer",
        "unknown base",
        "base hyperparameter",
        "nested wrapper",
        "lr on the wrapper",
        "stated wrapper need",
    ],
)
def test_base_errors_point_at_optimizer_base(
    wrapper_catalogue: Catalogue, optimizer: dict[str, Any], loc: list[str], fragment: str
) -> None:
    errors = catalogue_errors(
        JobSpec.model_validate(example(optimizer=optimizer)), wrapper_catalogue, max_steps=MAX_STEPS
    )
    assert [error.loc for error in errors] == [loc]
    assert fragment in errors[0].msg


def test_needs_a_spec_states_are_checked_by_key_and_type() -> None:
    spec = JobSpec.model_validate(
        example(optimizer={"name": "sgd", "params": {}, "needs": {"closure": True}})
    )
    assert spec.optimizer.needs == {"closure": True}
    assert spec.flat_params()["optimizer.needs.closure"] == "True"
    for needs, fragment in (
        (
            {"closur": True},
            "unknown need 'closur'; known: closure, create_graph, train_eval, base_optimizer, "
            "backward_in_step",
        ),
        ({"closure": "yes"}, "need 'closure' must be bool; received 'yes'"),
    ):
        with pytest.raises(ValidationError) as raised:
            JobSpec.model_validate(example(optimizer={"name": "sgd", "needs": needs}))
        error = raised.value.errors()[0]
        assert error["loc"] == ("optimizer", "needs")
        assert fragment in error["msg"]


@pytest.mark.parametrize(
    ("optimizer", "field", "says"),
    [
        (
            {"name": "keras_sam"},
            "name",
            "which tensorflow training steps cannot provide; run it in a torch job",
        ),
        # The spec's own need, at its own field: the optimizer had been blamed for it.
        (
            {"name": "sgd", "needs": {"create_graph": True}},
            "needs.create_graph",
            "optimizer.needs.create_graph: tensorflow training steps cannot serve it",
        ),
    ],
    ids=["detected closure", "stated create_graph"],
)
def test_a_tensorflow_job_that_needs_a_closure_or_create_graph_is_refused(
    wrapper_catalogue: Catalogue, optimizer: dict[str, Any], field: str, says: str
) -> None:
    spec = JobSpec.model_validate(example(framework="tensorflow", optimizer=optimizer))
    errors = catalogue_errors(spec, wrapper_catalogue, max_steps=MAX_STEPS)
    assert [error.loc for error in errors] == [["body", "optimizer", *field.split(".")]]
    assert says in errors[0].msg


def test_a_class_without_a_learning_rate_takes_the_constant_schedule_only(
    catalogue_data: dict[str, Any],
) -> None:
    data = copy.deepcopy(catalogue_data)
    template = next(o for o in data["optimizers"] if o["name"] == "ema_momentum" and o["style"] == "torch")
    rateless = [p for p in template["params"] if p["name"] != "lr"]
    data["optimizers"].append({**template, "name": "rateless", "params": rateless})
    catalogue = Catalogue.model_validate(data)
    scheduled = example(optimizer={"name": "rateless", "params": {}}, schedule={"name": "cosine"})
    (error,) = catalogue_errors(JobSpec.model_validate(scheduled), catalogue, max_steps=MAX_STEPS)
    assert error.loc == ["body", "schedule", "name"]
    assert "'rateless' takes no learning rate (its constructor names no lr or learning_rate" in error.msg
    assert "constant" in error.msg and "a param_groups recipe" in error.msg
    constant = {**scheduled, "schedule": {"name": "constant"}}
    assert catalogue_errors(JobSpec.model_validate(constant), catalogue, max_steps=MAX_STEPS) == []
    # A class that keeps its rate in its groups (SingleDeviceMuonWithAuxAdam): its build says whether
    # every group holds one, which its constructor's signature cannot.
    recipe = [{"match": "rest"}]
    grouped = {**scheduled, "optimizer": {"name": "rateless", "params": {}, "param_groups": recipe}}
    assert catalogue_errors(JobSpec.model_validate(grouped), catalogue, max_steps=MAX_STEPS) == []


def test_an_unknown_optimizer_names_the_sources_that_failed_to_load(catalogue_data: dict[str, Any]) -> None:
    """A plugin with a syntax error had left its optimizer only "unknown"."""
    errors = [
        {"source": f"plugin /plugins/broken{i}.py", "error": "SyntaxError: invalid syntax (at x.py:1)"}
        for i in range(4)
    ]
    catalogue = Catalogue.model_validate({**catalogue_data, "errors": errors})
    (problem,) = catalogue_errors(
        JobSpec.model_validate(with_optimizer("broken0", lr=0.1)), catalogue, max_steps=MAX_STEPS
    )
    assert problem.loc == ["body", "optimizer", "name"]
    assert problem.msg.startswith("unknown optimizer 'broken0'; known: ")
    failed = "; ".join(
        f"plugin /plugins/broken{i}.py (SyntaxError: invalid syntax (at x.py:1))" for i in range(3)
    )
    assert problem.msg.endswith(
        f". These failed to load, so optimizers they define are not known: {failed} and 1 more "
        "(GET /optimizers lists the errors whole)"
    )


DDP = {"strategy": "ddp", "devices": 2}


@pytest.mark.parametrize(
    ("optimizer", "who"),
    [
        ({"name": "hessian", "params": {"lr": 0.05}}, "it needs"),  # the catalogue detected it
        ({"name": "adamw", "params": {"lr": 0.001}, "needs": {"create_graph": True}}, "it needs"),  # stated
        (
            {**LOOKAHEAD, "base": {**LOOKAHEAD["base"], "needs": {"create_graph": True}}},
            "its base 'adamw' needs",
        ),
    ],
    ids=["catalogue", "stated", "wrapper's base"],
)
def test_a_ddp_job_of_an_optimizer_that_needs_create_graph_is_refused_at_distribution(
    wrapper_catalogue: Catalogue, optimizer: dict[str, Any], who: str
) -> None:
    # DDP averages gradients in place, which a gradient carrying its graph refuses: it failed at step 1.
    data = wrapper_catalogue.model_dump()
    template = next(o for o in data["optimizers"] if o["name"] == "ema_momentum" and o["style"] == "torch")
    data["optimizers"].append(
        {**template, "name": "hessian", "needs": {**template["needs"], "create_graph": True}}
    )
    catalogue = Catalogue.model_validate(data)
    spec = JobSpec.model_validate(example(optimizer=optimizer, distribution=DDP))
    (error,) = catalogue_errors(spec, catalogue, max_steps=MAX_STEPS)
    assert error.loc == ["body", "distribution"]
    assert (
        f"distribution 'ddp' cannot train {optimizer['name']!r}: {who} backward(create_graph=True)"
        in error.msg
    )
    assert "leave distribution out" in error.msg
    # A need the catalogue read may be wrong of the class, and the spec may correct it; a stated one not.
    corrects = '"needs": {"create_graph": false} beside its name'
    assert (corrects in error.msg) == (who == "it needs" and "needs" not in optimizer), error.msg
    one_device = JobSpec.model_validate(example(optimizer=optimizer))
    assert catalogue_errors(one_device, catalogue, max_steps=MAX_STEPS) == []
    corrected = JobSpec.model_validate(
        example(optimizer={**optimizer, "needs": {"create_graph": False}}, distribution=DDP)
    )
    if who == "it needs":
        assert catalogue_errors(corrected, catalogue, max_steps=MAX_STEPS) == []
