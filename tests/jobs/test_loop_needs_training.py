"""Real pytorch-optimizer classes through the one loop on digits_mlp: each gets what its catalogue
entry says it needs (closure, create_graph, train/eval, a base optimizer), every checkpoint verifies,
and each reaches the issue's bar of 0.9 validation accuracy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pytorch_optimizer import SAM, AdaHessian, AliG, Lookahead, ScheduleFreeAdamW

from jobs.frameworks.base import NeedNotServed, ScheduleUnreachable, StateNotRestored
from optimizers.registry import Base, Registry, entry_for_class, load_registry
from tests.checks.closure_contracts import LossOnlyLineSearch, OwnBackwardSGD
from tests.checks.own_step_size import RelativeStepSGD

from .helpers import digits_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MakeJob = Callable[..., Any]

SAM_SGD = {
    "name": "sam",
    "params": {"rho": 0.05},
    "base": {"name": "sgd", "params": {"lr": 0.1, "momentum": 0.9}},
}
ADA_HESSIAN = {"name": "ada_hessian", "params": {"lr": 0.1}}
SCHEDULE_FREE = {"name": "schedule_free_adam_w", "params": {"lr": 0.01}}
LOOKAHEAD_ADAMW = {"name": "lookahead", "params": {"k": 5}, "base": {"name": "adamw", "params": {"lr": 0.01}}}


@pytest.fixture(scope="module")
def real_registry() -> Registry:
    registry = load_registry(plugin_dirs=[])
    for cls in (
        SAM,
        AdaHessian,
        ScheduleFreeAdamW,
        Lookahead,
        ClosureUnderNoGrad,
        AliG,
        OwnBackwardSGD,
        LossOnlyLineSearch,
    ):
        registry.add(entry_for_class(cls, source="test"))
    return registry


@pytest.mark.parametrize(
    ("optimizer", "steps"),
    [(SAM_SGD, 200), (ADA_HESSIAN, 150), (SCHEDULE_FREE, 60), (LOOKAHEAD_ADAMW, 60)],
    ids=["sam-closure", "ada_hessian-create_graph", "schedule_free-train_eval", "lookahead-wrapper"],
)
def test_each_need_trains_to_090_and_every_checkpoint_verifies(
    make_job: MakeJob, real_registry: Registry, optimizer: dict[str, Any], steps: int
) -> None:
    spec = digits_spec(optimizer=optimizer, steps=steps, checkpoint_every=25, eval_every=steps)
    result = make_job(spec, with_registry=real_registry).run()
    assert result.final["val_accuracy"] >= 0.9
    assert result.checkpoints_verified == len(result.checkpoints) == -(-steps // 25)


@pytest.mark.parametrize("optimizer", [SAM_SGD, SCHEDULE_FREE], ids=["sam-closure", "schedule_free"])
def test_stop_after_then_resume_equals_a_straight_run(
    make_job: MakeJob, real_registry: Registry, optimizer: dict[str, Any]
) -> None:
    # Stopped on an evaluation and checkpoint boundary: a schedule-free optimizer switches to
    # its evaluation weights there in both runs.
    spec = digits_spec(optimizer=optimizer, steps=40, checkpoint_every=10, eval_every=10)
    straight = make_job(spec, with_registry=real_registry).run()
    first_leg_job = make_job(spec, with_registry=real_registry)
    first_leg_job.run(stop_after=20)
    resumed = make_job(spec, with_registry=real_registry).run(resume_from=first_leg_job.last_checkpoint)
    assert resumed.resumed_from_step == 20
    assert resumed.params_sha256 == straight.params_sha256


def test_the_closure_recomputes_the_loss_on_the_same_batch(
    make_job: MakeJob, real_registry: Registry
) -> None:
    job = make_job(digits_spec(optimizer=SAM_SGD, steps=3), with_registry=real_registry)
    seen: list[torch.Tensor] = []
    forward = job.session._forward

    def recording(objects: Any, batch: tuple[torch.Tensor, torch.Tensor], **options: Any) -> torch.Tensor:
        seen.append(batch[0])
        return forward(objects, batch, **options)

    job.session._forward = recording
    objects = job.session.build()
    job.session.train_step(objects, job.session.batch(0), 0)
    assert len(seen) == 2 and seen[0] is seen[1]  # the first gradients, then the closure's


class ClosureUnderNoGrad(torch.optim.SGD):
    """Calls its required closure inside step()'s no_grad, as AliG does (AliG has no lr to schedule)."""

    @torch.no_grad()
    def step(self, closure: Any) -> Any:  # type: ignore[override]
        loss = closure()
        super().step()
        return loss


def test_a_closure_run_under_no_grad_still_gets_gradients(make_job: MakeJob, real_registry: Registry) -> None:
    spec = digits_spec(optimizer={"name": "closure_under_no_grad", "params": {"lr": 0.1}}, steps=3)
    job = make_job(spec, with_registry=real_registry)
    assert job.session.needs.closure
    assert job.run().steps_completed == 3


def test_a_class_that_runs_backward_on_its_closures_loss_trains_as_its_update_says(
    make_job: MakeJob, real_registry: Registry
) -> None:
    # OwnBackwardSGD's update is plain SGD's, from the gradients of its own backward on the loss
    # its closure returns with the graph; a closure that ran backward itself left it no graph.
    steps = 30
    own = make_job(
        digits_spec(optimizer={"name": "own_backward_sgd", "params": {"lr": 0.1}}, steps=steps),
        with_registry=real_registry,
    )
    assert own.session.needs.backward_in_step
    own_result = own.run()  # each job built and run alone, as a job process does: building seeds
    sgd = make_job(
        digits_spec(optimizer={"name": "sgd", "params": {"lr": 0.1}}, steps=steps),
        with_registry=real_registry,
    )
    sgd_result = sgd.run()
    assert own_result.steps_completed == steps
    assert own_result.params_sha256 == sgd_result.params_sha256
    assert own_result.checkpoints_verified == len(own_result.checkpoints) >= 1


def test_a_stated_backward_in_step_the_class_lacks_fails_at_the_first_step(make_job: MakeJob) -> None:
    """Adam runs no backward on its closure's loss: stated anyway, the closure leaves it no gradient,
    and the job trained nothing and succeeded."""
    spec = digits_spec(
        optimizer={"name": "adam", "params": {"lr": 0.01}, "needs": {"backward_in_step": True}}, steps=5
    )
    with pytest.raises(NeedNotServed, match="ran no backward on the loss its closure returned") as caught:
        make_job(spec).run()
    assert "drop backward_in_step from optimizer.needs" in caught.value.fix


def test_a_closure_asked_for_the_loss_alone_serves_a_line_search(
    make_job: MakeJob, real_registry: Registry
) -> None:
    # Its trial steps call closure(backward=False) and read the gradients of the first call, which
    # the loss-only calls must leave be; the job had failed at its first step.
    spec = digits_spec(optimizer={"name": "loss_only_line_search", "params": {"lr": 1.0}}, steps=30)
    result = make_job(spec, with_registry=real_registry).run()
    assert result.steps_completed == 30
    assert result.checkpoints_verified == len(result.checkpoints) >= 1
    assert result.final["train_loss"] < 1.5  # from about 2.3 untrained


def test_create_graph_gradients_are_freed_after_the_step(make_job: MakeJob, real_registry: Registry) -> None:
    job = make_job(digits_spec(optimizer=ADA_HESSIAN, steps=2), with_registry=real_registry)
    objects = job.session.build()
    job.session.train_step(objects, job.session.batch(0), 0)
    assert all(p.grad is None for p in objects.model.parameters())


def test_schedule_free_saves_and_evaluates_its_evaluation_weights(
    make_job: MakeJob, real_registry: Registry
) -> None:
    job = make_job(digits_spec(optimizer=SCHEDULE_FREE, steps=5), with_registry=real_registry)
    session = job.session
    objects = session.build()
    session.train_step(objects, session.batch(0), 0)
    assert objects.optimizer.param_groups[0]["train_mode"]
    session.evaluate(objects)
    assert not objects.optimizer.param_groups[0]["train_mode"]
    checkpointed = session.checkpoint(objects, 1, job.checkpoint_dir)
    assert not torch.load(checkpointed.path, weights_only=True)["optimizer"]["param_groups"][0]["train_mode"]
    session.train_step(checkpointed.objects, session.batch(1), 1)
    assert checkpointed.objects.optimizer.param_groups[0]["train_mode"]


def test_the_schedule_drives_the_wrapped_optimizers_rate(make_job: MakeJob, real_registry: Registry) -> None:
    spec = digits_spec(optimizer=LOOKAHEAD_ADAMW, steps=10, schedule={"name": "cosine", "params": {}})
    session = make_job(spec, with_registry=real_registry).session
    objects = session.build()
    session.train_step(objects, session.batch(0), 0)
    assert objects.optimizer.optimizer.param_groups[0]["lr"] < 0.01


def test_a_stated_need_is_merged_over_the_detected_ones(make_job: MakeJob, real_registry: Registry) -> None:
    # SAM's need for a closure is detected; a spec stating it again keeps every detected need.
    job = make_job(
        digits_spec(optimizer={**SAM_SGD, "needs": {"closure": True}}, steps=1), with_registry=real_registry
    )
    assert job.session.needs == real_registry.get("sam").needs
    assert job.session.needs.closure
    plain = make_job(
        digits_spec(optimizer={"name": "sgd", "params": {"lr": 0.1}, "needs": {"closure": True}}, steps=3)
    )
    assert plain.session.needs.closure and plain.run().steps_completed == 3  # torch's SGD takes a closure too


def test_a_wrapper_built_without_its_base_is_refused_by_name(real_registry: Registry) -> None:
    with pytest.raises(ValueError, match=r"optimizer\.base"):
        real_registry.get("lookahead").create({"k": 5}, model_params=[torch.zeros(2, requires_grad=True)])
    sgd = real_registry.get("sgd")
    with pytest.raises(ValueError, match=r"leave optimizer\.base out"):
        sgd.create({}, model_params=[torch.zeros(2, requires_grad=True)], base=Base(sgd, {}))


def test_sam_takes_the_base_class_and_its_params(real_registry: Registry) -> None:
    sgd = real_registry.get("sgd")
    sam = real_registry.get("sam").create(
        {"rho": 0.1}, model_params=[torch.zeros(2, requires_grad=True)], base=Base(sgd, {"lr": 0.3})
    )
    assert isinstance(sam.base_optimizer, sgd.cls)
    assert sam.param_groups[0]["lr"] == 0.3 and sam.param_groups[0]["rho"] == 0.1


# -- a wrapper's loop serves its base's needs too ------------------------------------------------------

LOOKAHEAD_ADA_HESSIAN = {"name": "lookahead", "params": {"k": 5}, "base": ADA_HESSIAN}
LOOKAHEAD_SCHEDULE_FREE = {"name": "lookahead", "params": {"k": 5}, "base": SCHEDULE_FREE}


def test_lookahead_over_ada_hessian_gets_create_graph_from_its_base(
    make_job: MakeJob, real_registry: Registry
) -> None:
    assert not real_registry.get("lookahead").needs.create_graph  # the wrapper alone needs none
    spec = digits_spec(optimizer=LOOKAHEAD_ADA_HESSIAN, steps=20, checkpoint_every=10, eval_every=20)
    job = make_job(spec, with_registry=real_registry)
    assert job.session.needs.create_graph and job.session.needs.base_optimizer == "optimizer"
    # Without the graph AdaHessian's Hessian-vector product raises on the first step.
    result = job.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2
    assert result.final["val_loss"] < 2.0  # moved off the untrained loss (about 2.3)


def test_a_schedule_free_base_is_switched_through_a_wrapper_without_modes(
    make_job: MakeJob, real_registry: Registry
) -> None:
    job = make_job(digits_spec(optimizer=LOOKAHEAD_SCHEDULE_FREE, steps=3), with_registry=real_registry)
    session = job.session
    assert session.needs.train_eval
    objects = session.build()
    base = objects.optimizer.optimizer  # the ScheduleFreeAdamW that Lookahead wraps
    session.train_step(objects, session.batch(0), 0)
    assert base.param_groups[0]["train_mode"]
    session.evaluate(objects)
    assert not base.param_groups[0]["train_mode"]


def test_a_stated_need_of_the_base_counts_too(make_job: MakeJob, real_registry: Registry) -> None:
    base = {"name": "sgd", "params": {"lr": 0.1}, "needs": {"closure": True}}
    job = make_job(
        digits_spec(optimizer={"name": "lookahead", "params": {"k": 5}, "base": base}, steps=3),
        with_registry=real_registry,
    )
    assert job.session.needs.closure and job.run().steps_completed == 3  # Lookahead hands it on


def test_the_job_refuses_a_wrapper_without_its_base_before_loading_anything(
    make_job: MakeJob, real_registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jobs.training.loop

    def no_workload(name: str) -> Any:
        raise AssertionError("the workload was loaded before the spec was refused")

    monkeypatch.setattr(jobs.training.loop, "get_workload", no_workload)
    with pytest.raises(ValueError, match=r"^optimizer\.base: optimizer 'lookahead' wraps a base optimizer"):
        make_job(
            digits_spec(optimizer={"name": "lookahead", "params": {"k": 5}}), with_registry=real_registry
        )


def test_a_class_without_a_learning_rate_trains_verifies_and_resumes(
    make_job: MakeJob, real_registry: Registry
) -> None:
    """AliG computes its step from the closure's loss and has no `lr`: no scheduler is built (there
    is no rate to scale), `train/lr` is not logged, and checkpoints and resume hold."""
    spec = digits_spec(
        optimizer={"name": "ali_g", "params": {"momentum": 0.9}},
        schedule={"name": "constant"},
        steps=30,
        checkpoint_every=10,
        eval_every=10,
    )
    straight_job = make_job(spec, with_registry=real_registry)
    straight = straight_job.run()
    assert straight_job.session.needs.closure
    assert straight.checkpoints_verified == len(straight.checkpoints) == 3
    first_leg = make_job(spec, with_registry=real_registry)
    first_leg.run(stop_after=20)
    resumed = make_job(spec, with_registry=real_registry).run(resume_from=first_leg.last_checkpoint)
    assert resumed.params_sha256 == straight.params_sha256


def test_a_class_keeping_lr_none_trains_on_the_constant_schedule_and_refuses_another(
    make_job: MakeJob,
) -> None:
    """torch_optimizer's A2GradExp keeps `lr: None` in its groups ("not used for this optimizer"):
    LambdaLR had been built over it anyway, and every job failed before its first step
    ("unsupported operand type(s) for *: 'NoneType' and 'float'")."""
    from torch_optimizer import A2GradExp

    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(A2GradExp, source="test"))
    (name,) = [n for n, _ in registry.entries if n.startswith("a2_grad") or n.startswith("a2grad")]
    spec = digits_spec(
        optimizer={"name": name, "params": {}}, schedule={"name": "constant"}, steps=6, checkpoint_every=3
    )
    job = make_job(spec, with_registry=registry)
    result = job.run()
    assert job.session.build().scheduler is None and result.checkpoints_verified == 2
    cosine = digits_spec(
        optimizer={"name": name, "params": {}}, schedule={"name": "cosine"}, steps=6, checkpoint_every=3
    )
    with pytest.raises(ScheduleUnreachable, match=r"holds 'lr': None: the class computes its own step size"):
        make_job(cosine, with_registry=registry).run()


def test_a_class_computing_its_own_step_at_lr_none_is_scheduled_only_once_given_a_rate(
    make_job: MakeJob,
) -> None:
    """timm's Adafactor at its default lr=None writes its own step size into group['lr'] each step:
    a spec without an lr trains on the constant schedule, its own step size untouched; another
    schedule is refused before the first step (never LambdaLR's None * factor, never a schedule
    claimed and not applied); with an lr given, the schedule drives it."""
    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(RelativeStepSGD, source="test"))
    (name,) = [name for (name, _), entry in registry.entries.items() if entry.cls is RelativeStepSGD]
    own = digits_spec(optimizer={"name": name, "params": {}}, schedule={"name": "constant"}, steps=6)
    job = make_job(own, with_registry=registry)
    result = job.run()
    assert job.session.build().scheduler is None and result.checkpoints_verified == len(result.checkpoints)
    cosine = {"name": "cosine"}
    with pytest.raises(ScheduleUnreachable, match=r"schedule 'cosine': .*holds 'lr': None") as refused:
        make_job(
            digits_spec(optimizer={"name": name, "params": {}}, schedule=cosine, steps=6),
            with_registry=registry,
        ).run()
    assert "give the class a rate (optimizer.params.lr)" in refused.value.fix
    given = digits_spec(optimizer={"name": name, "params": {"lr": 0.05}}, schedule=cosine, steps=6)
    job = make_job(given, with_registry=registry)
    job.run()
    objects = job.session.build()
    assert objects.scheduler is not None and objects.optimizer.param_groups[0]["relative_step"] is False


def test_a_wrapper_built_over_the_model_and_its_base_sharing_a_default_trains(make_job: MakeJob) -> None:
    """pytorch-optimizer's WSAM(model, params, base_optimizer, ..., eps=1e-12) over Adam: the two
    share `eps` and `foreach`, which neither spec set, and every job had been refused ("both take
    ['eps']"); the wrapper was also built without its model."""
    from pytorch_optimizer import WSAM

    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(WSAM, source="test"))
    wsam = {"name": "wsam", "params": {"rho": 0.05}, "base": {"name": "adam", "params": {"lr": 0.003}}}
    spec = digits_spec(optimizer=wsam, steps=6, checkpoint_every=3)
    job = make_job(spec, with_registry=registry)
    result = job.run()
    assert job.session.needs.closure and result.checkpoints_verified == 2
    set_for_the_base = {**wsam, "base": {"name": "adam", "params": {"lr": 0.003, "eps": 1e-6}}}
    with pytest.raises(
        ValueError, match=r"optimizer\.base\.params: \['eps'\] is an argument of the wrapper 'wsam' itself"
    ):
        make_job(digits_spec(optimizer=set_for_the_base, steps=6), with_registry=registry).run()
    set_for_both = {**set_for_the_base, "params": {"rho": 0.05, "eps": 1e-9}}
    with pytest.raises(
        ValueError, match=r"optimizer 'wsam' and its base 'adam' both take \['eps'\]; set them"
    ):
        make_job(digits_spec(optimizer=set_for_both, steps=6), with_registry=registry).run()


def test_a_class_that_never_ran_optimizer_init_is_told_so_at_its_first_checkpoint(make_job: MakeJob) -> None:
    """torch_optimizer's Lookahead never calls torch.optim.Optimizer.__init__: its state_dict()
    failed with only "'Lookahead' object has no attribute '_optimizer_state_dict_pre_hooks'"."""
    from torch_optimizer import Lookahead as JettifyLookahead

    registry = load_registry(plugin_dirs=[])
    registry.add(entry_for_class(JettifyLookahead, source="test"))
    spec = digits_spec(
        optimizer={"name": "lookahead", "params": {}, "base": {"name": "sgd", "params": {"lr": 0.05}}},
        steps=4,
        checkpoint_every=2,
    )
    with pytest.raises(StateNotRestored) as failed:
        make_job(spec, with_registry=registry).run()
    assert str(failed.value).startswith(
        "optimizer: Lookahead.state_dict() failed ('Lookahead' object has no attribute "
        "'_optimizer_state_dict_pre_hooks'): the class never ran torch.optim.Optimizer.__init__"
    )
    assert "super().__init__(params, defaults)" in failed.value.fix
