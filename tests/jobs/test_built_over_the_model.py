"""Optimizers built over the model, not its parameters: K-FAC-style ones hook its layers
(`SINGD(model, lr=...)`), adam-mini splits `model.named_parameters()` by name. A job hands them the
model (or its named parameters); a param-group recipe is refused, since such a class makes its own
groups; and an object of the class's own in its state is compared by what it holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from jobs.run import error_record
from jobs.spec import Catalogue, optimizer_errors
from optimizers.loop_needs import LoopNeeds, detect_loop_needs, loop_problem, unserved
from optimizers.registry import entry_for_class

from .helpers import digits_spec, registry_with

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MakeJob = Callable[..., Any]


class PlainSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0; received {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        return None


class ModelSGD(PlainSGD):
    """Plain SGD over the layers of the model it is given (as a K-FAC optimizer finds its Linears)."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        layers = [m for m in model.modules() if isinstance(m, nn.Linear)]  # AttributeError on a list
        super().__init__([p for layer in layers for p in layer.parameters()], lr)


class NamedSGD(PlainSGD):
    """Plain SGD over `model.named_parameters()`, which it splits by name, as adam-mini does."""

    def __init__(self, named_parameters: Any, lr: float = 0.1) -> None:
        named = list(named_parameters)
        weights = [p for name, p in named if name.endswith("weight")]
        others = [p for name, p in named if not name.endswith("weight")]
        super().__init__([{"params": weights}, {"params": others}], lr)


class Buffer:
    """A holder of a tensor, with no __eq__ of its own (SINGD keeps its Kronecker factors so)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


torch.serialization.add_safe_globals([Buffer])  # allowed where the class is defined, as torch advises


class HeldMomentum(PlainSGD):
    """Momentum kept in a `Buffer` object: a reload rebuilds the object, equal in what it holds."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "held" not in state:
                    state["held"] = Buffer(torch.zeros_like(param))
                state["held"].value.mul_(0.9).add_(param.grad)
                param.add_(state["held"].value, alpha=-group["lr"])
        return None


def test_the_model_argument_is_read_from_the_constructor() -> None:
    assert detect_loop_needs(ModelSGD) == LoopNeeds(model_argument="model")
    assert detect_loop_needs(NamedSGD) == LoopNeeds(model_argument="named_parameters")
    assert detect_loop_needs(PlainSGD) == LoopNeeds()
    with pytest.raises(ValueError, match="need 'model_argument' must be str"):
        LoopNeeds().with_overrides({"model_argument": True}, owner="optimizer.needs")
    refused = unserved("mine", LoopNeeds(model_argument="model"), "tensorflow")
    assert refused is not None and "model_argument" in refused
    field, why = loop_problem(
        "lookahead", LoopNeeds(base_optimizer="optimizer"), ("m", detect_loop_needs(ModelSGD)), "torch"
    ) or ("", "")
    assert field == "base" and "is built over the model (its 'model' argument)" in why


@pytest.mark.parametrize("cls", [ModelSGD, NamedSGD], ids=["model", "named_parameters"])
def test_a_job_builds_the_class_over_its_model_and_trains_it_as_over_the_parameters(
    make_job: MakeJob, cls: type
) -> None:
    # Both had failed at the job's start: "'generator' object has no attribute 'modules'".
    registry = registry_with(cls, PlainSGD)
    name = entry_for_class(cls, source="test").name
    over_the_model = make_job(
        digits_spec(optimizer={"name": name, "params": {"lr": 0.05}}, steps=14), with_registry=registry
    ).run()
    plain = make_job(
        digits_spec(optimizer={"name": "plain_sgd", "params": {"lr": 0.05}}, steps=14), with_registry=registry
    ).run()
    assert over_the_model.checkpoints_verified == len(over_the_model.checkpoints) == 2
    assert over_the_model.params_sha256 == plain.params_sha256


def test_an_object_in_the_state_is_compared_by_what_it_holds(make_job: MakeJob) -> None:
    # The checkpoint had failed: "optimizer['state'][0]['held']: <Buffer object at 0x...> saved,
    # <Buffer object at 0x...> after reload", two objects equal in all they hold.
    spec = digits_spec(optimizer={"name": "held_momentum", "params": {"lr": 0.05}}, steps=14)
    result = make_job(spec, with_registry=registry_with(HeldMomentum)).run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2


def test_a_recipe_is_refused_for_a_class_built_over_the_model(
    make_job: MakeJob, catalogue_data: dict[str, Any]
) -> None:
    registry = registry_with(ModelSGD)
    catalogue = Catalogue.model_validate(
        {**catalogue_data, "optimizers": [entry.describe() for entry in registry.entries.values()]}
    )
    optimizer = {"name": "model_sgd", "params": {}, "param_groups": [{"match": {"ndim": "<2"}, "params": {}}]}
    spec = digits_spec(optimizer=optimizer, steps=2)
    (error,) = optimizer_errors(spec.optimizer, "torch", catalogue)
    says = "optimizer 'model_sgd' is built over the model (its 'model' argument) and makes its own groups"
    assert error.loc == ["body", "optimizer", "param_groups"] and says in error.msg
    with pytest.raises(ValueError, match=r"is built over the model \(its 'model' argument\)"):
        make_job(spec, with_registry=registry).run()


def test_an_error_that_says_nothing_is_told_by_where_it_was_raised() -> None:
    # pytorch-optimizer's LOMO updates in fused_backward(); its base's step() raises a bare
    # NotImplementedError, which a job's result had reported as an empty message.
    try:
        raise NotImplementedError
    except NotImplementedError as exc:
        record = error_record(exc)
    assert record.message.startswith("raised with no message at ")
    assert "test_built_over_the_model.py:" in record.message
    assert record.message.endswith(": raise NotImplementedError")


def test_a_stated_model_argument_a_class_refuses_is_told_by_the_need(make_job: MakeJob) -> None:
    """`needs.model_argument` on a class that takes parameters: torch's raw "optimizer can only optimize
    Tensors" had said nothing of the need. (No refusal at submission: the loop hands the model first
    whatever the argument is called, so a name cannot tell a class that takes a model from one that
    does not.)"""
    optimizer = {"name": "plain_sgd", "params": {}, "needs": {"model_argument": "model"}}
    spec = digits_spec(optimizer=optimizer, steps=2)
    with pytest.raises(ValueError) as raised:
        make_job(spec, with_registry=registry_with(PlainSGD)).run()
    said = str(raised.value)
    assert said.startswith(
        "optimizer 'plain_sgd' was built over the model (needs.model_argument 'model') and its constructor "
        "refused it: optimizer can only optimize Tensors"
    ), said
    assert said.endswith("a class that takes parameters needs no model_argument")
