"""Train one job in any framework: a loop a reader can hold in their head (after nanoGPT's train.py).

The loop owns what is the same everywhere: the cadence (evaluate every `eval_every`,
checkpoint every `checkpoint_every` and after the last step), timings, the metric keys,
divergence, checkpoint bookkeeping and the result. The framework's session (from its
driver, `jobs.frameworks`) does the rest. Every checkpoint is saved, reloaded into
fresh objects and verified, and training *continues from the reloaded objects*, so a
serialization bug shows in the result instead of hiding until someone resumes.

A step's values (loss, gradient norm, timings) may stay on the device: reading them every step
would make the host wait for the device every step. The loop keeps them in a `Window` and reads
them all at once at a flush: every `FLUSH_EVERY_STEPS` steps or `FLUSH_EVERY_S` seconds, after
the first step, and always before an evaluation, a checkpoint and at the end. There it finds the
first non-finite loss exactly (`Diverged` names that step; no point from it on is logged, and no
checkpoint is taken of a diverged state), hands the points to the tracker in one call, and
writes progress.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.checkpoint_files import WORKDIR_CHECKPOINTS
from jobs.errors import Diverged
from jobs.frameworks import driver_for, style_of
from jobs.frameworks.base import Checkpointed, Evaluation, StepRecord, TrainingSession
from jobs.frameworks.foreign import counting_calls, never_called, told
from jobs.report import Reporter
from jobs.result import CheckpointRecord, OptimizerState, TrainOutcome
from jobs.resume import CheckpointStore, WorkdirCheckpoints
from jobs.spec import JobSpec
from jobs.tracking import Point, Tracker
from jobs.training.publication import Publication
from jobs.workloads import get_workload
from optimizers.loop_needs import LoopNeeds, base_unserved, loop_problem
from optimizers.registry import Base, Registry

# A flush reads every value kept since the last one in one transfer (one wait for the device):
# often enough that progress and MLflow stay live, rarely enough that the wait costs nothing.
FLUSH_EVERY_STEPS = 100
FLUSH_EVERY_S = 1.0


@dataclass
class Timings:
    step_ms: list[float] = field(default_factory=list)
    optimizer_ms: list[float] = field(default_factory=list)

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None


@dataclass
class Window:
    """The steps taken since the last flush, their values not read back yet."""

    opened: float  # time.monotonic() of the last flush
    steps: list[int] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)  # each step's host time around train_step
    timestamps_ms: list[int] = field(default_factory=list)  # when each step ended, for its points

    def add(self, step: int, record: StepRecord, host_ms: float, timestamp_ms: int) -> None:
        self.steps.append(step)
        self.records.append(record)
        self.host_ms.append(host_ms)
        self.timestamps_ms.append(timestamp_ms)

    def take(self) -> Window:
        """Its contents, leaving it empty (so a failure while they are handled cannot flush them twice)."""
        taken = Window(self.opened, self.steps, self.records, self.host_ms, self.timestamps_ms)
        self.steps, self.records, self.host_ms, self.timestamps_ms = [], [], [], []
        self.opened = time.monotonic()
        return taken


@dataclass(frozen=True)
class Cadence:
    """When the loop flushes between its boundaries: after `steps` steps, or `seconds` (None: never
    by the clock) since the last flush."""

    steps: int
    seconds: float | None

    def due(self, window: Window) -> bool:
        if len(window.steps) >= self.steps:
            return True
        return self.seconds is not None and time.monotonic() - window.opened >= self.seconds


class TrainingJob:
    """One training job: the spec's optimizer on the spec's workload, in the spec's style."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        registry: Registry,
        workdir: Path,
        tracker: Tracker,
        reporter: Reporter,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self.spec = spec
        self.workdir = workdir
        self.tracker = tracker
        self.reporter = reporter
        self.driver = driver_for(style_of(spec))
        entry = registry.get(spec.optimizer.name, self.driver.style).with_needs(spec.optimizer.needs or {})
        chosen_base = spec.optimizer.base
        base = None
        if chosen_base is not None and base_unserved(spec.framework) is None:
            base_entry = registry.get(chosen_base.name, self.driver.style).with_needs(chosen_base.needs or {})
            base = Base(base_entry, chosen_base.params)
        # As the API decided at submission, before any data is loaded: the spec may predate a catalogue.
        problem = loop_problem(
            entry.name,
            entry.needs,
            (chosen_base.name, base.entry.needs if base else LoopNeeds()) if chosen_base else None,
            spec.framework,
        )
        if problem:
            raise ValueError(f"optimizer.{problem[0]}: {problem[1]}")
        self.workload = get_workload(spec.workload.name)
        # A 2-D trajectory's `traj/x`, `traj/y`: the parameters read to the host at every step.
        self.traces = self.workload.traces_parameters(spec.workload.params)
        self.session: TrainingSession = self.driver.session(spec, entry, self.workload, workdir, base)
        self.store = checkpoints or WorkdirCheckpoints()  # where other attempts find them (jobs.resume)
        self.checkpoint_dir = self.store.folder or workdir / WORKDIR_CHECKPOINTS
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.warnings: list[str] = []
        self.cls = entry.cls
        # Methods of another optimizer API the class defines that nothing of its own calls: counted
        # while the job trains, and named in its warnings if they never ran (a Keras 3 port that kept
        # `_resource_apply_dense` trains with the update it inherits).
        self.foreign = [f for f in never_called(entry.cls, self.driver.foreign_methods) if f.method.own_work]
        self.steps_completed: int | None = None  # in a failed job's result too: where it stopped
        self.verified: list[CheckpointRecord] = []
        self.last_checkpoint: Path | None = None
        self.publication: Publication | None = None  # the latest verified checkpoint, being published
        # A checkpoint whose proof ends with the next step (Checkpointed.confirm), and its step.
        self.unconfirmed: tuple[Checkpointed, int] | None = None

    def run(self, *, resume_from: Path | None = None, stop_after: int | None = None) -> TrainOutcome:
        """Train to `spec.steps` (or `stop_after`), optionally continuing from a checkpoint file."""
        end = min(stop_after, self.spec.steps) if stop_after is not None else self.spec.steps
        with counting_calls(self.cls, [f.name for f in self.foreign]) as calls:
            try:
                return self._run(calls, resume_from=resume_from, end=end)
            finally:
                self._tell_foreign_methods(calls)  # a failed job's too

    def _tell_foreign_methods(self, calls: Counter[str]) -> None:
        """The methods of another API that never ran in this job, in its warnings (a failed one's
        too: a first step that raised NotImplementedError is explained there)."""
        for foreign in self.foreign:
            said = told(self.cls, foreign, self.driver.api_name)
            if not calls[foreign.name] and said not in self.warnings:
                self.warnings.append(said)

    def _run(self, calls: Counter[str], *, resume_from: Path | None, end: int) -> TrainOutcome:
        spec, session = self.spec, self.session
        timings = Timings()
        watch = OptimizerWatch(session, self.tracker)
        cadence = self._cadence()
        train_loss = math.nan
        evaluation: dict[str, float] = {}
        with session.scope():
            if resume_from is not None:
                if not self.driver.capabilities.resume:
                    raise ValueError(f"--resume is not available for {self.driver.style} jobs yet")
                objects, start = session.resume(resume_from)  # builds once, then restores
            else:
                objects, start = session.build(), 0
            started = time.monotonic()
            window = Window(opened=started)
            try:
                for step in range(start, end):
                    self._train_step(objects, step, window)
                    self._confirm_checkpoint(objects)
                    done = self.steps_completed = step + 1
                    evaluates = done % spec.eval_every == 0 or done == end
                    checkpoints = done % spec.checkpoint_every == 0 or done == end
                    # A first step that diverges is named at once; nothing is evaluated or saved unread.
                    if step == start or evaluates or checkpoints or cadence.due(window):
                        train_loss = self._flush(window, timings, force=done == end)
                        self._settle_publication(wait=False)
                    if step == start:
                        watch.first_step(objects, done)
                    if evaluates:
                        evaluation = self._evaluate(objects, done)
                        watch.evaluate(objects, done, end=done == end)
                        self.reporter.progress(force=done == end, **evaluation)
                    if checkpoints:
                        objects = self._checkpoint(objects, done, next_step_follows=done < end)
                self._settle_publication(wait=True)  # the last checkpoint is published in the time
            except BaseException as failure:
                self._flush_after(failure, window, timings)
                self._publish_after_failure()
                raise
            train_seconds = time.monotonic() - started
            if end > start:
                self._log_step_metrics(objects, end)  # where the last step arrived
            details = session.details(objects)
        step_seconds = sum(timings.step_ms) / 1000
        self._tell_foreign_methods(calls)  # before the outcome takes its warnings
        return TrainOutcome(
            steps_completed=end,
            resumed_from_step=start if resume_from is not None else None,
            final={"train_loss": train_loss, **evaluation},
            params_sha256=session.params_sha256(objects),
            samples_per_sec=(end - start) * spec.batch_size / step_seconds if step_seconds else None,
            step_time_ms_median=timings.median(timings.step_ms),
            optimizer_step_ms_median=timings.median(timings.optimizer_ms),
            checkpoints=self.verified,
            checkpoints_verified=sum(1 for c in self.verified if c.ok),
            device=session.device,
            train_seconds=train_seconds,
            warnings=self.warnings,
            optimizer_state=watch.outcome(),
            **details,
        )

    def _cadence(self) -> Cadence:
        # A workload that traces the parameters reads them to the host every step anyway: it flushes
        # every step, so its trace and its losses stop at the same step as before.
        steps = 1 if self.traces else FLUSH_EVERY_STEPS
        # DDP ranks must flush (and so raise Diverged) at the same step: by count only, never by clock.
        return Cadence(steps, None if self.spec.distribution is not None else FLUSH_EVERY_S)

    def _train_step(self, objects: Any, step: int, window: Window) -> None:
        self._log_step_metrics(objects, step)
        batch = self.session.batch(step)
        started = time.perf_counter()
        record = self.session.train_step(objects, batch, step)
        host_ms = (time.perf_counter() - started) * 1000
        window.add(step, record, host_ms, int(time.time() * 1000))

    def _flush(self, window: Window, timings: Timings, *, force: bool = False) -> float:
        """Read the window's values at once, log its points in one call, write progress; the last
        step's train loss. Diverged at the first non-finite loss, after logging only the steps before
        it."""
        taken = window.take()
        values = self.session.to_floats(
            [
                value
                for record, host_ms in zip(taken.records, taken.host_ms, strict=True)
                for value in (
                    record.loss,
                    record.grad_norm,
                    record.optimizer_ms,
                    host_ms if record.step_ms is None else record.step_ms,
                )
            ]
        )
        losses, norms, optimizer_ms, step_ms = values[0::4], values[1::4], values[2::4], values[3::4]
        good = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), len(losses))
        points: list[Point] = []
        for i in range(good):
            step, at, lr = taken.steps[i], taken.timestamps_ms[i], taken.records[i].lr
            points.append(Point("train/loss", losses[i], step, at))
            if lr is not None:
                points.append(Point("train/lr", lr, step, at))
            points.append(Point("train/grad_norm", norms[i], step, at))
        if good:
            points += self._timing_points(
                step_ms[:good], optimizer_ms[:good], taken.steps[good - 1], taken.timestamps_ms[good - 1]
            )
            self.tracker.metrics(points)
        timings.step_ms += step_ms[:good]
        timings.optimizer_ms += optimizer_ms[:good]
        if good < len(losses):
            if good:  # the steps it did take, in progress too (it had stayed at the last flush's)
                self.reporter.progress(
                    step=taken.steps[good - 1] + 1, total=self.spec.steps, loss=losses[good - 1], force=True
                )
            raise Diverged(taken.steps[good], "train/loss", losses[good])
        self.reporter.progress(step=taken.steps[-1] + 1, total=self.spec.steps, loss=losses[-1], force=force)
        return losses[-1]

    def _timing_points(
        self, step_ms: list[float], optimizer_ms: list[float], step: int, at: int
    ) -> list[Point]:
        """The window's timings, once per flush at its last step: the mean step and optimizer-step
        times and the window's throughput. Per step they were half of the points the tracking
        server ingests (its CPU, on a small model, is most of what tracking costs the job:
        benchmarks/tracking_overhead.py) and mostly noise; the result keeps every step's timing
        (medians, samples/s over the whole run)."""
        seconds = sum(step_ms) / 1000
        points = [
            Point("perf/step_time_ms", statistics.fmean(step_ms), step, at),
            Point("perf/optimizer_step_ms", statistics.fmean(optimizer_ms), step, at),
        ]
        if seconds > 0:  # a clock too coarse to see the steps has no rate to give
            points.append(
                Point("perf/samples_per_sec", len(step_ms) * self.spec.batch_size / seconds, step, at)
            )
        return points

    def _flush_after(self, failure: BaseException, window: Window, timings: Timings) -> None:
        """A step, evaluation or checkpoint failed: the steps before it still count. Their points are
        logged; a loss among them that was already non-finite is what went wrong first."""
        if not window.steps:
            return
        try:
            self._flush(window, timings)
        except Diverged as diverged:
            raise diverged from failure
        except Exception:
            pass  # the values cannot be read (the device failed, say): `failure` tells why, not this

    def _evaluate(self, objects: Any, step: int) -> dict[str, float]:
        """Validation metrics, logged at `step` (the updates the parameters have seen)."""
        evaluation = self.session.evaluate(objects)
        if not math.isfinite(evaluation.loss):
            raise Diverged(step, "val/loss", evaluation.loss)
        metrics = {"val_loss": evaluation.loss, **self._task_metric(evaluation)}
        for name, value in metrics.items():
            self.tracker.metric(name.replace("val_", "val/", 1), value, step)
        return metrics

    def _task_metric(self, evaluation: Evaluation) -> dict[str, float]:
        return self.workload.validation_metrics(self.spec.workload.params, evaluation)

    def _log_step_metrics(self, objects: Any, step: int) -> None:
        """The workload's per-step metrics of the parameters a step starts from (logged at `step`, as
        train/loss is), e.g. a 2-D trajectory's `traj/x`, `traj/y`; the last position after the loop."""
        if not self.traces:
            return
        values = self.session.parameter_values(objects)
        for key, value in self.workload.step_metrics(self.spec.workload.params, values).items():
            self.tracker.metric(key, value, step)

    def _checkpoint(self, objects: Any, step: int, *, next_step_follows: bool) -> Any:
        """Save, reload and verify (the last part with the next step, where the driver leaves it
        there); its publication then runs while training goes on."""
        self._settle_publication(wait=True)  # the one before, so that records stay in order
        self.session.publication_settled(step)  # a DDP job's other ranks wait for rank 0's wait
        try:
            checkpointed = self.session.checkpoint(
                objects, step, self.checkpoint_dir, next_step_follows=next_step_follows
            )
        except Exception:  # a mismatch, or a reload that fails outright (weights_only refusing state)
            self._failed_checkpoint(step)
            raise
        if checkpointed.confirm is not None:
            self.unconfirmed = (checkpointed, step)
        else:
            self._verified_checkpoint(checkpointed, step)
        return checkpointed.objects

    def _confirm_checkpoint(self, stepped: Any) -> None:
        """The step after a checkpoint was taken from its reloaded objects: the rest of its proof."""
        if self.unconfirmed is None:
            return
        (checkpointed, step), self.unconfirmed = self.unconfirmed, None
        assert checkpointed.confirm is not None
        try:
            checkpointed.confirm(stepped)
        except Exception:
            self._failed_checkpoint(step)
            raise
        self._verified_checkpoint(checkpointed, step)

    def _failed_checkpoint(self, step: int) -> None:
        self.tracker.metric("checkpoint/roundtrip_ok", 0.0, step)
        path = self.session.checkpoint_path(self.checkpoint_dir, step)
        self.verified.append(CheckpointRecord(step=step, ok=False, path=str(path)))

    def _verified_checkpoint(self, checkpointed: Checkpointed, step: int) -> None:
        self.tracker.metric("checkpoint/roundtrip_ok", 1.0, step)
        for warning in checkpointed.warnings:
            if warning not in self.warnings:
                self.warnings.append(warning)
        self.publication = Publication(self.store, checkpointed.path, step)

    def _settle_publication(self, *, wait: bool) -> None:
        """Once the checkpoint in flight is published (waiting for it if `wait`): record it, report
        it (what another attempt resumes from), retire the one it supersedes."""
        publication = self.publication
        if publication is None or not (wait or publication.done()):
            return
        self.publication = None  # settled once, even if its publication failed
        record = CheckpointRecord(step=publication.step, ok=True, path=self._published(publication))
        self.verified.append(record)
        self.reporter.progress(checkpoint=record, force=True)
        self.warnings.extend(w for w in self.store.warnings if w not in self.warnings)
        if self.last_checkpoint is not None and self.last_checkpoint != publication.path:
            self.store.retire(self.last_checkpoint)  # superseded (jobs.resume: what is kept where)
        self.last_checkpoint = publication.path

    def _published(self, publication: Publication) -> str:
        """Its reference, once published; a wait that lasts (a tracking server that does not answer)
        is shown in progress."""
        if publication.done():
            return publication.reference()
        step = publication.step
        # Said where the wait lies: a tracking server that stopped answering had gone unnamed.
        to = f" to the MLflow server at {self.store.server}" if self.store.server else ""
        with self.reporter.waiting_on(
            f"waiting to publish the checkpoint of step {step} (its metrics, then the file){to}"
        ):
            return publication.reference()

    def _publish_after_failure(self) -> None:
        """The job failed or was stopped after a checkpoint was verified: it is still published and
        reported, for another attempt to resume from. Its own failure would only hide the job's."""
        try:
            self._settle_publication(wait=True)
        except Exception:
            pass


class OptimizerWatch:
    """What a user of an optimizer wants to see of it, as `optim/...` metrics and in the result.

    Read at the evaluation cadence, never every step, so it costs nothing: the memory its state
    holds (`optim/state_bytes`, `optim/state_to_param_ratio`) once state exists and at the end,
    and every per-group value the optimizer itself changes (`optim/<key>`, `optim/<key>/group<i>`
    for groups after the first). Values are compared with those right after the first step, so
    constant hyperparameters (betas, weight decay) are never logged.
    """

    def __init__(self, session: TrainingSession, tracker: Tracker) -> None:
        self.session = session
        self.tracker = tracker
        self.first: dict[str, float] = {}
        self.first_at = 0
        self.changing: dict[str, float] = {}  # the last value of each value seen to change
        self.memory: tuple[int, int] | None = None

    def first_step(self, objects: Any, step: int) -> None:
        self.first = self._values(objects)
        self.first_at = step
        self._log_memory(objects, step)

    def evaluate(self, objects: Any, step: int, *, end: bool) -> None:
        for key, value in self._values(objects).items():
            if key not in self.changing and _same(value, self.first.get(key)):
                continue
            if key not in self.changing and key in self.first:
                # Its curve starts where the comparison did, not where the change was first seen.
                self.tracker.metric(f"optim/{key}", self.first[key], self.first_at)
            self.changing[key] = value
            self.tracker.metric(f"optim/{key}", value, step)
        if end and step != self.first_at:  # a one-step job measured it already
            self._log_memory(objects, step)

    def outcome(self) -> OptimizerState | None:
        """The end of the job as the result shows it; None when the job took no step."""
        if self.memory is None:
            return None
        state, params = self.memory
        return OptimizerState(
            state_bytes=state,
            param_bytes=params,
            state_to_param_ratio=state / params if params else None,
            adapted=dict(self.changing),
        )

    def _log_memory(self, objects: Any, step: int) -> None:
        self.memory = state, params = self.session.state_bytes(objects)
        self.tracker.metric("optim/state_bytes", state, step)
        if params:
            self.tracker.metric("optim/state_to_param_ratio", state / params, step)

    def _values(self, objects: Any) -> dict[str, float]:
        """The session's per-group values, named as their metrics are (without `optim/`)."""
        return {
            key if index == 0 else f"{key}/group{index}": value
            for index, group in enumerate(self.session.adapted_values(objects))
            for key, value in group.items()
        }


def _same(value: float, first: float | None) -> bool:
    # A value that was NaN from the start has not changed; one absent at first has.
    return first is not None and (value == first or (math.isnan(value) and math.isnan(first)))
