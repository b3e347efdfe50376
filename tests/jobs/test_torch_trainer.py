"""The training loop with the torch driver on digits_mlp: determinism, lossless checkpoints,
divergence, progress; Batches."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from jobs.errors import Diverged
from jobs.frameworks.base import ScheduleUnreachable
from jobs.frameworks.torch_driver import Batches
from jobs.report import PROGRESS_FILE

from .helpers import digits_spec, registry_with

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MakeJob = Callable[..., Any]


def test_two_runs_train_the_same_weights(make_job: MakeJob) -> None:
    first = make_job(digits_spec()).run()
    second = make_job(digits_spec()).run()
    assert first.params_sha256 == second.params_sha256
    assert first.steps_completed == 60
    assert first.resumed_from_step is None


def test_checkpoint_roundtrips_lose_nothing(make_job: MakeJob) -> None:
    often = make_job(digits_spec(checkpoint_every=7)).run()
    once = make_job(digits_spec(checkpoint_every=1000)).run()
    assert often.params_sha256 == once.params_sha256
    assert often.final == once.final


def test_a_different_seed_trains_different_weights(make_job: MakeJob) -> None:
    seed_0 = make_job(digits_spec(steps=5)).run()
    seed_1 = make_job(digits_spec(steps=5, seed=1)).run()
    assert seed_0.params_sha256 != seed_1.params_sha256


@pytest.mark.parametrize(
    ("steps", "checkpoint_every", "boundaries"),
    [
        (60, 7, [7, 14, 21, 28, 35, 42, 49, 56, 60]),
        (60, 20, [20, 40, 60]),
        (60, 1000, [60]),
    ],
)
def test_every_checkpoint_boundary_is_verified(
    make_job: MakeJob, steps: int, checkpoint_every: int, boundaries: list[int]
) -> None:
    job = make_job(digits_spec(steps=steps, checkpoint_every=checkpoint_every))
    result = job.run()
    assert [c.step for c in result.checkpoints] == boundaries
    assert result.checkpoints_verified == len(boundaries)
    assert result.warnings == []
    # Only the latest verified checkpoint is kept on disk.
    assert [p.name for p in job.checkpoint_dir.iterdir()] == [f"step-{steps:08d}.pt"]


def test_progress_reports_step_and_total(make_job: MakeJob) -> None:
    job = make_job(digits_spec(steps=30))
    result = job.run()
    progress = json.loads((job.workdir / PROGRESS_FILE).read_text())
    assert (progress["step"], progress["total"]) == (30, 30)
    assert progress["loss"] == result.final["train_loss"]
    assert 0.0 <= progress["val_accuracy"] <= 1.0


def test_stop_after_then_resume_equals_a_straight_run(make_job: MakeJob) -> None:
    spec = digits_spec(schedule={"name": "cosine", "params": {"warmup_steps": 5}}, checkpoint_every=10)
    straight = make_job(spec).run()
    first_leg_job = make_job(spec)
    first_leg = first_leg_job.run(stop_after=17)
    assert first_leg.steps_completed == 17
    resumed = make_job(spec).run(resume_from=first_leg_job.last_checkpoint)
    assert resumed.resumed_from_step == 17
    assert resumed.steps_completed == 60
    assert resumed.params_sha256 == straight.params_sha256


def test_resume_refuses_a_checkpoint_of_another_spec(make_job: MakeJob) -> None:
    first = make_job(digits_spec(steps=10))
    first.run()
    with pytest.raises(
        ValueError, match=r"different job spec \(seed \(0 there, 1 here\)\); refusing to resume"
    ):
        make_job(digits_spec(steps=10, seed=1)).run(resume_from=first.last_checkpoint)


def test_a_huge_learning_rate_diverges_with_its_step(make_job: MakeJob) -> None:
    spec = digits_spec(optimizer={"name": "sgd", "params": {"lr": 1e6}})
    with pytest.raises(Diverged) as raised:
        make_job(spec).run()
    assert 0 <= raised.value.step < spec.steps
    assert f"at step {raised.value.step}" in str(raised.value)
    assert "train/loss" in str(raised.value)


class KeyedSGD(torch.optim.Optimizer):
    """Its rate kept as group['learning_rate']: no torch LR scheduler sets that key."""

    def __init__(self, params: Any, learning_rate: float = 0.05) -> None:
        super().__init__(params, {"learning_rate": learning_rate})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.sub_(group["learning_rate"] * p.grad)
        return None


def test_a_schedule_no_lr_scheduler_can_reach_fails_the_job_instead_of_being_dropped(
    make_job: MakeJob,
) -> None:
    """It had trained at a constant rate and succeeded. The constant schedule needs no scheduler."""
    registry = registry_with(KeyedSGD)
    cosine = digits_spec(optimizer={"name": "keyed_sgd", "params": {"lr": 0.05}}, schedule={"name": "cosine"})
    with pytest.raises(
        ScheduleUnreachable, match=r"schedule 'cosine': param_groups\[0\] holds its rate as 'learning_rate'"
    ):
        make_job(cosine, with_registry=registry).run()
    constant = digits_spec(
        optimizer={"name": "keyed_sgd", "params": {"lr": 0.05}}, steps=4, checkpoint_every=4
    )
    assert make_job(constant, with_registry=registry).run().steps_completed == 4


# -- Batches -----------------------------------------------------------------------------------------

ROWS = 10
X = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1)
Y = torch.arange(ROWS)


def rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    x, y = batch
    assert x[:, 0].long().tolist() == y.tolist()  # features and labels stay paired
    return y.tolist()


def test_a_batch_is_a_pure_function_of_seed_and_step() -> None:
    in_order = Batches(X, Y, batch_size=3, seed=7)
    expected = [rows(in_order(step)) for step in range(9)]
    out_of_order = Batches(X, Y, batch_size=3, seed=7)
    for step in (8, 0, 4, 3, 7, 1, 2, 6, 5):
        assert rows(out_of_order(step)) == expected[step]


def test_an_epoch_drops_the_partial_batch_and_repeats_no_row() -> None:
    batches = Batches(X, Y, batch_size=3, seed=0)
    assert batches.order.per_epoch == 3
    epoch = [row for step in range(3) for row in rows(batches(step))]
    assert len(epoch) == len(set(epoch)) == 9


def test_epochs_and_seeds_shuffle_differently() -> None:
    batches = Batches(X, Y, batch_size=5, seed=0)
    epoch_0 = [rows(batches(0)), rows(batches(1))]
    epoch_1 = [rows(batches(2)), rows(batches(3))]
    assert epoch_0 != epoch_1
    other_seed = Batches(X, Y, batch_size=5, seed=1)
    assert [rows(other_seed(0)), rows(other_seed(1))] != epoch_0


def test_a_batch_larger_than_the_data_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        Batches(X, Y, batch_size=ROWS + 1, seed=0)(0)
