"""Train one PyTorch job: a loop a reader can hold in their head (after nanoGPT's train.py).

Every `checkpoint_every` steps (and after the last) the job saves, reloads into fresh
objects, verifies, and *continues from the reloaded objects*, so a serialization bug
shows in the result instead of hiding until someone resumes.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jobs.batches import BatchOrder
from jobs.errors import Diverged
from jobs.report import Reporter
from jobs.spec import JobSpec
from jobs.torch_checkpoint import (
    TrainObjects,
    load_checkpoint,
    restore,
    save_checkpoint,
    verify_roundtrip,
)
from jobs.tracking import Tracker
from jobs.workloads import Dataset, get_workload
from optimizers.registry import Registry
from optimizers.schedules import build_schedule


@dataclass
class Timings:
    step_ms: list[float] = field(default_factory=list)
    optimizer_ms: list[float] = field(default_factory=list)


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} requested, but CUDA is not available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {requested!r} requested, but only {torch.cuda.device_count()} CUDA devices exist"
            )
    return device


def make_deterministic(seed: int) -> None:
    # Must be set before CUDA initialises for deterministic cuBLAS.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: a user's optimizer may use an op with no deterministic CUDA kernel;
    # that should cost bitwise reproducibility on GPU (with a warning), not the job.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)


def params_sha256(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and raw bytes, in module order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Batches:
    """Batch `step` as tensors on the training device (rows chosen by `BatchOrder`)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, seed: int) -> None:
        self.x, self.y = x, y
        self.order = BatchOrder(len(x), batch_size=batch_size, seed=seed)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.order.rows(step)).to(self.x.device)
        return self.x[rows], self.y[rows]


class TorchJob:
    def __init__(
        self,
        spec: JobSpec,
        *,
        registry: Registry,
        workdir: Path,
        tracker: Tracker,
        reporter: Reporter,
    ) -> None:
        self.spec = spec
        self.registry = registry
        self.workdir = workdir
        self.tracker = tracker
        self.reporter = reporter
        self.device = resolve_device(spec.device)
        self.workload = get_workload(spec.workload.name)
        self.dataset: Dataset = self.workload.load_data()
        self.task = self.workload.task
        self.loss_fn: nn.Module = nn.MSELoss() if self.task == "regression" else nn.CrossEntropyLoss()
        # Sparse embedding gradients only for optimizers that declare they take them.
        self.sparse = registry.get(spec.optimizer.name, "torch").supports_sparse
        self.checkpoint_dir = workdir / "checkpoints"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.warnings: list[str] = []
        self.verified: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None

    def build(self) -> TrainObjects:
        """Fresh model, optimizer and scheduler exactly as the spec describes them."""
        model = self.workload.torch_model(self.spec.workload.params, self.dataset, sparse=self.sparse)
        model = model.to(self.device)
        optimizer = self.registry.build(
            self.spec.optimizer.name, model.parameters(), self.spec.optimizer.params
        )
        schedule = build_schedule(
            self.spec.schedule.name, self.spec.schedule.params, total_steps=self.spec.steps
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
        return TrainObjects(model, optimizer, scheduler)

    def run(self, *, resume_from: Path | None = None, stop_after: int | None = None) -> dict[str, Any]:
        """Train to `spec.steps` (or `stop_after`), optionally continuing from a checkpoint file."""
        spec = self.spec
        make_deterministic(spec.seed)
        x_train, y_train = self._tensors(self.dataset.x_train, self.dataset.y_train)
        x_val, y_val = self._tensors(self.dataset.x_val, self.dataset.y_val)
        batches = Batches(x_train, y_train, batch_size=spec.batch_size, seed=spec.seed)
        objects = self.build()
        start = 0
        if resume_from is not None:
            objects, start = self._resume(resume_from)
        end = min(stop_after, spec.steps) if stop_after is not None else spec.steps
        timings = Timings()
        started = time.monotonic()
        train_loss = math.nan
        evaluation: dict[str, float] = {}

        for step in range(start, end):
            train_loss = self._train_step(objects, batches(step), step, timings)
            done = step + 1
            if done % spec.eval_every == 0 or done == end:
                evaluation = self._evaluate(objects.model, x_val, y_val, done)
            if done % spec.checkpoint_every == 0 or done == end:
                probe_batch = batches(min(done, spec.steps - 1))
                objects = self._checkpoint_roundtrip(objects, done, probe_batch)
            self.reporter.progress(
                step=done, total=spec.steps, loss=train_loss, force=done == end, **evaluation
            )

        step_seconds = sum(timings.step_ms) / 1000
        trained = end - start
        return {
            "steps_completed": end,
            "resumed_from_step": start if resume_from is not None else None,
            "final": {"train_loss": train_loss, **evaluation},
            "params_sha256": params_sha256(objects.model),
            "samples_per_sec": trained * spec.batch_size / step_seconds if step_seconds else None,
            "step_time_ms_median": statistics.median(timings.step_ms) if timings.step_ms else None,
            "optimizer_step_ms_median": statistics.median(timings.optimizer_ms)
            if timings.optimizer_ms
            else None,
            "checkpoints": self.verified,
            "checkpoints_verified": sum(1 for c in self.verified if c["ok"]),
            "device": str(self.device),
            "train_seconds": time.monotonic() - started,
            "warnings": self.warnings,
        }

    def _resume(self, path: Path) -> tuple[TrainObjects, int]:
        checkpoint = load_checkpoint(path, self.device)
        saved_spec = JobSpec.model_validate_json(checkpoint["spec"])
        if saved_spec != self.spec:
            raise ValueError(f"checkpoint {path} was written by a different job spec; refusing to resume")
        if checkpoint["data_position"] != checkpoint["step"]:
            raise ValueError(f"checkpoint {path}: data position {checkpoint['data_position']} != step")
        return restore(checkpoint, self.build()), int(checkpoint["step"])

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _forward_backward(
        self, objects: TrainObjects, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, y = batch
        objects.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(objects.model(x), y)
        loss.backward()
        return loss

    def _train_step(
        self,
        objects: TrainObjects,
        batch: tuple[torch.Tensor, torch.Tensor],
        step: int,
        timings: Timings,
    ) -> float:
        lr = float(objects.optimizer.param_groups[0]["lr"])
        started = time.perf_counter()
        loss = self._forward_backward(objects, batch)
        grad_norm = _grad_norm(objects.model)
        optimizer_started = self._sync_clock()
        objects.optimizer.step()
        optimizer_ms = (self._sync_clock() - optimizer_started) * 1000
        objects.scheduler.step()
        loss_value = float(loss.item())
        step_ms = (time.perf_counter() - started) * 1000
        if not math.isfinite(loss_value):
            raise Diverged(step, "train/loss", loss_value)
        timings.step_ms.append(step_ms)
        timings.optimizer_ms.append(optimizer_ms)
        for key, value in (
            ("train/loss", loss_value),
            ("train/lr", lr),
            ("train/grad_norm", grad_norm),
            ("perf/step_time_ms", step_ms),
            ("perf/optimizer_step_ms", optimizer_ms),
            ("perf/samples_per_sec", self.spec.batch_size / (step_ms / 1000)),
        ):
            self.tracker.metric(key, value, step)
        return loss_value

    def _sync_clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            output = output.reshape(-1)
        loss: torch.Tensor = self.loss_fn(output, y)
        return loss

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> dict[str, float]:
        model.eval()
        output = model(x)
        model.train()
        val_loss = float(self._loss(output, y).item())
        if not math.isfinite(val_loss):
            raise Diverged(step, "val/loss", val_loss)
        self.tracker.metric("val/loss", val_loss, step)
        if self.task == "regression":
            rmse = math.sqrt(val_loss)
            self.tracker.metric("val/rmse", rmse, step)
            return {"val_loss": val_loss, "val_rmse": rmse}
        accuracy = float((output.argmax(dim=1) == y).float().mean().item())
        self.tracker.metric("val/accuracy", accuracy, step)
        return {"val_loss": val_loss, "val_accuracy": accuracy}

    def _checkpoint_roundtrip(
        self, objects: TrainObjects, step: int, probe_batch: tuple[torch.Tensor, torch.Tensor]
    ) -> TrainObjects:
        path = self.checkpoint_dir / f"step-{step:08d}.pt"
        save_checkpoint(path, objects, step=step, spec_json=self.spec.model_dump_json())
        reloaded = restore(load_checkpoint(path, self.device), self.build())
        twin = restore(load_checkpoint(path, self.device), self.build())  # used up by the probe

        def probe(candidate: TrainObjects) -> None:
            self._forward_backward(candidate, probe_batch)
            candidate.optimizer.step()

        try:
            verify_roundtrip(objects, reloaded, twin, probe)
        except Exception:
            self.tracker.metric("checkpoint/roundtrip_ok", 0.0, step)
            self.verified.append({"step": step, "ok": False, "path": str(path)})
            raise
        self.tracker.metric("checkpoint/roundtrip_ok", 1.0, step)
        self.verified.append({"step": step, "ok": True, "path": str(path)})
        if self.last_checkpoint is not None and self.last_checkpoint != path:
            self.last_checkpoint.unlink(missing_ok=True)  # keep only the latest verified one
        self.last_checkpoint = path
        return reloaded


def _grad_norm(model: nn.Module) -> float:
    norms = [_norm(p.grad.detach()) for p in model.parameters() if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.stack(norms).norm().item())


def _norm(grad: torch.Tensor) -> torch.Tensor:
    # A sparse gradient's repeated rows must be summed before taking the norm.
    return grad.coalesce().values().norm() if grad.is_sparse else grad.norm()
