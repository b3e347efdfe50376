"""Train one job in any framework: a loop a reader can hold in their head (after nanoGPT's train.py).

The loop owns what is the same everywhere: the cadence (evaluate every `eval_every`,
checkpoint every `checkpoint_every` and after the last step), timings, the metric keys,
divergence, checkpoint bookkeeping and the result. The framework's session (from its
driver, `jobs.frameworks`) does the rest. Every checkpoint is saved, reloaded into
fresh objects and verified, and training *continues from the reloaded objects*, so a
serialization bug shows in the result instead of hiding until someone resumes.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.errors import Diverged
from jobs.frameworks import driver_for, style_of
from jobs.frameworks.base import Evaluation, TrainingSession
from jobs.report import Reporter
from jobs.result import CheckpointRecord, OptimizerState, TrainOutcome
from jobs.resume import CheckpointStore, WorkdirCheckpoints
from jobs.spec import JobSpec
from jobs.tracking import Tracker
from jobs.workloads import get_workload
from optimizers.loop_needs import LoopNeeds, base_unserved, loop_problem
from optimizers.registry import Base, Registry


@dataclass
class Timings:
    step_ms: list[float] = field(default_factory=list)
    optimizer_ms: list[float] = field(default_factory=list)

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None


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
        self.session: TrainingSession = self.driver.session(spec, entry, self.workload, workdir, base)
        self.store = checkpoints or WorkdirCheckpoints()  # where other attempts find them (jobs.resume)
        self.checkpoint_dir = self.store.folder or workdir / "checkpoints"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.warnings: list[str] = []
        self.verified: list[CheckpointRecord] = []
        self.last_checkpoint: Path | None = None

    def run(self, *, resume_from: Path | None = None, stop_after: int | None = None) -> TrainOutcome:
        """Train to `spec.steps` (or `stop_after`), optionally continuing from a checkpoint file."""
        spec, session = self.spec, self.session
        end = min(stop_after, spec.steps) if stop_after is not None else spec.steps
        timings = Timings()
        watch = OptimizerWatch(session, self.tracker)
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
            for step in range(start, end):
                train_loss = self._train_step(objects, step, timings)
                done = step + 1
                if step == start:
                    watch.first_step(objects, done)
                if done % spec.eval_every == 0 or done == end:
                    evaluation = self._evaluate(objects, done)
                    watch.evaluate(objects, done, end=done == end)
                if done % spec.checkpoint_every == 0 or done == end:
                    objects = self._checkpoint(objects, done)
                self.reporter.progress(
                    step=done, total=spec.steps, loss=train_loss, force=done == end, **evaluation
                )
            train_seconds = time.monotonic() - started
            details = session.details(objects)
        step_seconds = sum(timings.step_ms) / 1000
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

    def _train_step(self, objects: Any, step: int, timings: Timings) -> float:
        batch = self.session.batch(step)
        started = time.perf_counter()
        record = self.session.train_step(objects, batch, step)
        step_ms = (time.perf_counter() - started) * 1000
        if not math.isfinite(record.loss):
            raise Diverged(step, "train/loss", record.loss)
        timings.step_ms.append(step_ms)
        timings.optimizer_ms.append(record.optimizer_ms)
        rate = [] if record.lr is None else [("train/lr", record.lr)]
        for key, value in (
            ("train/loss", record.loss),
            *rate,
            ("train/grad_norm", record.grad_norm),
            ("perf/step_time_ms", step_ms),
            ("perf/optimizer_step_ms", record.optimizer_ms),
            ("perf/samples_per_sec", self.spec.batch_size / (step_ms / 1000)),
        ):
            self.tracker.metric(key, value, step)
        return record.loss

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
        if self.workload.task == "regression":
            return {"val_rmse": math.sqrt(evaluation.loss)}
        accuracy = float(np.mean(np.argmax(evaluation.outputs, axis=1) == evaluation.labels))
        return {"val_accuracy": accuracy}

    def _checkpoint(self, objects: Any, step: int) -> Any:
        try:
            checkpointed = self.session.checkpoint(objects, step, self.checkpoint_dir)
        except Exception:  # a mismatch, or a reload that fails outright (weights_only refusing state)
            self.tracker.metric("checkpoint/roundtrip_ok", 0.0, step)
            path = self.session.checkpoint_path(self.checkpoint_dir, step)
            self.verified.append(CheckpointRecord(step=step, ok=False, path=str(path)))
            raise
        self.tracker.metric("checkpoint/roundtrip_ok", 1.0, step)
        record = CheckpointRecord(step=step, ok=True, path=self.store.publish(checkpointed.path))
        self.verified.append(record)
        self.reporter.progress(checkpoint=record, force=True)  # what another attempt resumes from
        for warning in checkpointed.warnings:
            if warning not in self.warnings:
                self.warnings.append(warning)
        if self.last_checkpoint is not None and self.last_checkpoint != checkpointed.path:
            self.store.retire(self.last_checkpoint)  # superseded (jobs.resume: what is kept where)
        self.last_checkpoint = checkpointed.path
        return checkpointed.objects


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
