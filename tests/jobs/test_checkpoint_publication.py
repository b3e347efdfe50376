"""A verified checkpoint is published (points delivered, file uploaded) while training goes on, and
still reported in order, only once published, and even when the job fails after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from jobs.report import Reporter
from jobs.result import CheckpointRecord
from jobs.tracking import Point
from jobs.training import loop
from jobs.training.loop import TrainingJob
from optimizers.registry import Registry

from .helpers import digits_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WAIT_S = 30  # a safety net against hangs; never reached when the code is right


class Losses:
    """A tracker that keeps the train/loss steps it was given; can break at a step."""

    def __init__(self, *, break_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.break_at = break_at

    def metric(self, key: str, value: float, step: int) -> None:
        self.metrics([Point(key, value, step, 0)])

    def metrics(self, points: Sequence[Point]) -> None:
        steps = [p.step for p in points if p.key == "train/loss"]
        if self.break_at is not None and any(step >= self.break_at for step in steps):
            raise ConnectionError("the tracking server went away")
        self.steps += steps

    def reached(self, step: int) -> bool:
        return bool(self.steps) and self.steps[-1] >= step


class Store:
    """A checkpoint store whose publication can wait for the training to reach a step, be slow, or
    fail; it records what it published and retired."""

    folder: Path | None = None
    in_run = True
    warnings = ()
    server = None

    def __init__(
        self, losses: Losses, *, wait_for_steps: int = 0, steps: int = 0, delay_s: float = 0.0
    ) -> None:
        self.losses = losses
        self.wait_for_steps = wait_for_steps
        self.steps = steps  # the job's last step is as far as it can wait for
        self.delay_s = delay_s
        self.fail_at_step: int | None = None
        self.published: list[str] = []
        self.retired: list[str] = []

    def publish(self, path: Path) -> str:
        step = int(path.stem.split("-")[1])
        deadline = time.monotonic() + WAIT_S
        while not self.losses.reached(min(step + self.wait_for_steps, self.steps) - 1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"training never went on past step {step} while it was published")
            time.sleep(0.005)
        time.sleep(self.delay_s)
        if step == self.fail_at_step:
            raise PermissionError(f"upload of {path.name} refused")
        self.published.append(path.name)
        return f"store:{path.name}"

    def retire(self, path: Path) -> None:
        self.retired.append(path.name)


class Reports(Reporter):
    """Keeps every checkpoint reported, and whether it was published when it was."""

    def __init__(self, workdir: Path, store: Store) -> None:
        super().__init__(workdir)
        self.store = store
        self.checkpoints: list[tuple[CheckpointRecord, bool]] = []

    def progress(self, *, force: bool = False, **fields: Any) -> None:
        record = fields.get("checkpoint")
        if record is not None:
            self.checkpoints.append((record, record.path.removeprefix("store:") in self.store.published))
        super().progress(force=force, **fields)


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"  # the torch driver's checkpoint files


def make_job(
    tmp_path: Path, registry: Registry, store: Store, losses: Losses, **spec: Any
) -> tuple[TrainingJob, Reports]:
    reports = Reports(tmp_path, store)
    job = TrainingJob(
        digits_spec(**spec),
        registry=registry,
        workdir=tmp_path,
        tracker=losses,
        reporter=reports,
        checkpoints=store,
    )
    return job, reports


@pytest.fixture(autouse=True)
def no_clock_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "FLUSH_EVERY_S", float("inf"))


def test_training_goes_on_while_a_checkpoint_is_published(tmp_path: Path, registry: Registry) -> None:
    # Each publication returns only once the training has logged 20 more steps (the last one, at the
    # end, at once): a loop that waited for it would never get there (the store then raises
    # TimeoutError and the job fails).
    losses = Losses()
    store = Store(losses, wait_for_steps=20, steps=60)
    job, reports = make_job(tmp_path, registry, store, losses, steps=60, checkpoint_every=20, eval_every=20)
    outcome = job.run()
    names = [checkpoint_name(step) for step in (20, 40, 60)]
    assert [c.step for c in outcome.checkpoints] == [20, 40, 60]
    assert [c.path for c in outcome.checkpoints] == [f"store:{name}" for name in names]
    assert all(c.ok for c in outcome.checkpoints) and outcome.checkpoints_verified == 3
    # Reported in order, each only once published; the superseded ones retired after their successor.
    assert [(record.step, published) for record, published in reports.checkpoints] == [
        (20, True),
        (40, True),
        (60, True),
    ]
    assert store.retired == names[:2]
    progress = (tmp_path / "progress.json").read_text()
    assert f'"store:{checkpoint_name(60)}"' in progress


def test_a_failed_publication_fails_the_job_with_its_own_error(tmp_path: Path, registry: Registry) -> None:
    losses = Losses()
    store = Store(losses)
    store.fail_at_step = 20
    job, reports = make_job(tmp_path, registry, store, losses, steps=60, checkpoint_every=20, eval_every=20)
    with pytest.raises(PermissionError, match=f"upload of {checkpoint_name(20)} refused"):
        job.run()
    assert reports.checkpoints == [], "a checkpoint that was never published is never reported"
    assert losses.reached(39), "the training went on while it was published"
    assert not losses.reached(41), "and failed at the next checkpoint at the latest"


def test_a_checkpoint_in_flight_when_the_job_fails_is_still_reported(
    tmp_path: Path, registry: Registry
) -> None:
    # The tracker breaks at the flush after the checkpoint at step 20, while its publication (slow)
    # is still in flight: the job fails with the tracker's error, and step 20 is still what another
    # attempt resumes from.
    losses = Losses(break_at=30)
    store = Store(losses, delay_s=0.5)
    job, reports = make_job(tmp_path, registry, store, losses, steps=60, checkpoint_every=20, eval_every=1000)
    with pytest.raises(ConnectionError, match="went away"):
        job.run()
    assert [(record.step, published) for record, published in reports.checkpoints] == [(20, True)]
    assert store.published == [checkpoint_name(20)]


def test_at_most_one_publication_is_in_flight(tmp_path: Path, registry: Registry) -> None:
    losses = Losses()
    store = Store(losses, delay_s=0.05)
    in_flight: list[int] = []
    most = [0]
    lock = threading.Lock()
    original = store.publish

    def counted(path: Path) -> str:
        with lock:
            in_flight.append(1)
            most[0] = max(most[0], len(in_flight))
        try:
            return original(path)
        finally:
            with lock:
                in_flight.pop()

    store.publish = counted  # type: ignore[method-assign]
    job, reports = make_job(tmp_path, registry, store, losses, steps=60, checkpoint_every=3, eval_every=1000)
    outcome = job.run()
    assert [c.step for c in outcome.checkpoints] == list(range(3, 61, 3))
    assert most[0] == 1
    assert [record.step for record, _ in reports.checkpoints] == list(range(3, 61, 3))
