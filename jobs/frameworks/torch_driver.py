"""The torch driver: builds, steps, checkpoints and compares `torch.optim.Optimizer` training.

The checkpoint round-trip: save, reload into fresh objects, prove nothing was lost. One
file per checkpoint (a dict with `model`, `optimizer`, `scheduler`, `rng`, `step`,
`data_position`, `spec`), loaded back with `weights_only=True` as a user would.
Comparing state dicts alone would miss state an optimizer keeps outside
`self.state` / `param_groups` (both copies would lack it equally), so the check of
record also takes one identical probe step with the original and the reloaded
objects and requires bitwise-equal results.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from jobs.batches import BatchOrder
from jobs.frameworks.base import (
    Capabilities,
    Checkpointed,
    CheckpointMismatch,
    Driver,
    Evaluation,
    StepRecord,
    TrainingSession,
)
from jobs.spec import JobSpec
from jobs.workloads import Workload
from optimizers.registry import Entry
from optimizers.schedules import build_schedule

__all__ = ["CheckpointMismatch", "TorchDriver", "TrainObjects", "first_difference"]


@dataclass
class TrainObjects:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    # Only when this job already uses CUDA: asking earlier would create a context on every GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(path: Path, objects: TrainObjects, *, step: int, spec_json: str) -> None:
    """Write atomically, so a crash mid-save never leaves a torn checkpoint behind."""
    payload = {
        "model": objects.model.state_dict(),
        "optimizer": objects.optimizer.state_dict(),
        "scheduler": objects.scheduler.state_dict(),
        "rng": rng_state(),
        "step": step,
        # Batches are a pure function of (seed, step), so the step is the data position.
        "data_position": step,
        "spec": spec_json,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    return loaded


def restore(checkpoint: Mapping[str, Any], fresh: TrainObjects) -> TrainObjects:
    """Load a checkpoint into freshly built objects (optimizer before scheduler)."""
    fresh.model.load_state_dict(checkpoint["model"])
    fresh.optimizer.load_state_dict(checkpoint["optimizer"])
    fresh.scheduler.load_state_dict(checkpoint["scheduler"])
    set_rng_state(checkpoint["rng"])
    return fresh


def first_difference(saved: Any, loaded: Any, where: str) -> str | None:
    """Describe the first place two state trees differ, or None when bitwise equal."""
    if isinstance(saved, torch.Tensor) or isinstance(loaded, torch.Tensor):
        return _tensor_difference(saved, loaded, where)
    if isinstance(saved, Mapping) and isinstance(loaded, Mapping):
        if set(saved) != set(loaded):
            missing = sorted(map(str, set(saved) - set(loaded)))
            extra = sorted(map(str, set(loaded) - set(saved)))
            return f"{where}: keys differ (missing after reload: {missing}, unexpected: {extra})"
        for key in saved:
            found = first_difference(saved[key], loaded[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(saved, Sequence) and not isinstance(saved, str):
        if not isinstance(loaded, Sequence) or len(saved) != len(loaded):
            return f"{where}: {saved!r} saved, {loaded!r} after reload"
        for index, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            found = first_difference(a, b, f"{where}[{index}]")
            if found:
                return found
        return None
    if saved != loaded and not _both_nan(saved, loaded):
        return f"{where}: {saved!r} saved, {loaded!r} after reload"
    return None


def verify_roundtrip(
    original: TrainObjects,
    reloaded: TrainObjects,
    twin: TrainObjects,
    probe: Callable[[TrainObjects], None],
) -> None:
    """Raise CheckpointMismatch unless `reloaded` equals `original` in every way that matters.

    `twin` is a second, independent reload of the same checkpoint. The probe step is
    taken by `original` and by `twin` (both are used up by it: continue from
    `reloaded`), so no object has to be copied: copying would go through
    `Optimizer.__getstate__` and drop exactly the attributes the probe is meant to see.
    """
    for name in ("model", "optimizer", "scheduler"):
        found = first_difference(
            getattr(original, name).state_dict(), getattr(reloaded, name).state_dict(), name
        )
        if found:
            raise CheckpointMismatch(f"checkpoint round-trip lost state: {found}")
    rng = rng_state()
    for objects in (original, twin):
        set_rng_state(rng)
        probe(objects)
    set_rng_state(rng)
    for name, saved, loaded in (
        ("model", original.model.state_dict(), twin.model.state_dict()),
        ("optimizer", original.optimizer.state_dict(), twin.optimizer.state_dict()),
    ):
        found = first_difference(saved, loaded, name)
        if found:
            raise CheckpointMismatch(
                "after reloading the checkpoint, the next step differs from the uninterrupted one: "
                f"{found}. The optimizer keeps state that state_dict() does not save "
                "(keep per-parameter state in self.state[p] and hyperparameters in param_groups)"
            )


def _tensor_difference(saved: Any, loaded: Any, where: str) -> str | None:
    if not (isinstance(saved, torch.Tensor) and isinstance(loaded, torch.Tensor)):
        return f"{where}: {type(saved).__name__} saved, {type(loaded).__name__} after reload"
    if saved.shape != loaded.shape or saved.dtype != loaded.dtype:
        return (
            f"{where}: {saved.dtype}{list(saved.shape)} saved, "
            f"{loaded.dtype}{list(loaded.shape)} after reload"
        )
    if saved.is_sparse or loaded.is_sparse:
        saved, loaded = saved.to_dense(), loaded.to_dense()
    a, b = saved.detach().cpu(), loaded.detach().cpu()
    inexact = a.is_floating_point() or a.is_complex()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if inexact else a == b
    if bool(same.all()):
        return None
    if a.is_complex():
        diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs().nan_to_num(nan=math.inf).max().item()
    elif a.is_floating_point():
        diff = (a.double() - b.double()).abs().nan_to_num(nan=math.inf).max().item()
    else:
        diff = (a.long() - b.long()).abs().max().item()
    return f"{where}: max abs difference {diff:.3g}"


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


# -- the driver -----------------------------------------------------------------------------------------


class TorchDriver(Driver):
    style: ClassVar[str] = "torch"
    framework: ClassVar[str] = "torch"
    capabilities: ClassVar[Capabilities] = Capabilities(closure=True, param_groups=True, resume=True)

    def session(self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path) -> TorchSession:
        return TorchSession(spec, entry, workload)

    # -- fresh-process checks --
    fresh_module: ClassVar[str] = "jobs.checks.fresh.torch_child"


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


class TorchSession(TrainingSession):
    """A job's model, optimizer and LambdaLR scheduler; the checkpoint is one torch.save dict."""

    def __init__(self, spec: JobSpec, entry: Entry, workload: Workload) -> None:
        self.spec = spec
        self.entry = entry
        self.workload = workload
        self.torch_device = resolve_device(spec.device)
        self.device = str(self.torch_device)
        self.dataset = workload.load_data()
        self.regression = workload.task == "regression"
        self.loss_fn: nn.Module = nn.MSELoss() if self.regression else nn.CrossEntropyLoss()
        # Sparse embedding gradients only for optimizers that declare they take them.
        self.sparse = entry.supports_sparse
        make_deterministic(spec.seed)
        x_train, y_train = self._tensors(self.dataset.x_train, self.dataset.y_train)
        self.x_val, self.y_val = self._tensors(self.dataset.x_val, self.dataset.y_val)
        self.batches = Batches(x_train, y_train, batch_size=spec.batch_size, seed=spec.seed)

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x).to(self.torch_device), torch.from_numpy(y).to(self.torch_device)

    def build(self) -> TrainObjects:
        model = self.workload.torch_model(self.spec.workload.params, self.dataset, sparse=self.sparse)
        model = model.to(self.torch_device)
        optimizer = self.entry.create(self.spec.optimizer.params, model_params=model.parameters())
        schedule = build_schedule(
            self.spec.schedule.name, self.spec.schedule.params, total_steps=self.spec.steps
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
        return TrainObjects(model, optimizer, scheduler)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches(step)

    def train_step(self, objects: TrainObjects, batch: Any, step: int) -> StepRecord:
        lr = float(objects.optimizer.param_groups[0]["lr"])
        loss = self._forward_backward(objects, batch)
        grad_norm = _grad_norm(objects.model)
        optimizer_started = self._sync_clock()
        objects.optimizer.step()
        optimizer_ms = (self._sync_clock() - optimizer_started) * 1000
        objects.scheduler.step()
        return StepRecord(loss=float(loss.item()), grad_norm=grad_norm, lr=lr, optimizer_ms=optimizer_ms)

    def _forward_backward(
        self, objects: TrainObjects, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, y = batch
        objects.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(objects.model(x), y)
        loss.backward()
        return loss

    def _sync_clock(self) -> float:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
        return time.perf_counter()

    def _loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.regression:
            output = output.reshape(-1)
        loss: torch.Tensor = self.loss_fn(output, y)
        return loss

    @torch.no_grad()
    def evaluate(self, objects: TrainObjects) -> Evaluation:
        objects.model.eval()
        output = objects.model(self.x_val)
        objects.model.train()
        loss = float(self._loss(output, self.y_val).item())
        return Evaluation(loss=loss, outputs=output.detach().cpu().numpy(), labels=self.dataset.y_val)

    def checkpoint(self, objects: TrainObjects, step: int, folder: Path) -> Checkpointed:
        path = folder / f"step-{step:08d}.pt"
        save_checkpoint(path, objects, step=step, spec_json=self.spec.model_dump_json())
        reloaded = restore(load_checkpoint(path, self.torch_device), self.build())
        twin = restore(load_checkpoint(path, self.torch_device), self.build())  # used up by the probe
        probe_batch = self.batch(min(step, self.spec.steps - 1))

        def probe(candidate: TrainObjects) -> None:
            self._forward_backward(candidate, probe_batch)
            candidate.optimizer.step()

        verify_roundtrip(objects, reloaded, twin, probe)
        return Checkpointed(reloaded, path)

    def resume(self, path: Path) -> tuple[TrainObjects, int]:
        checkpoint = load_checkpoint(path, self.torch_device)
        saved_spec = JobSpec.model_validate_json(checkpoint["spec"])
        if saved_spec != self.spec:
            raise ValueError(f"checkpoint {path} was written by a different job spec; refusing to resume")
        if checkpoint["data_position"] != checkpoint["step"]:
            raise ValueError(f"checkpoint {path}: data position {checkpoint['data_position']} != step")
        return restore(checkpoint, self.build()), int(checkpoint["step"])

    def params_sha256(self, objects: TrainObjects) -> str:
        return params_sha256(objects.model)


def _grad_norm(model: nn.Module) -> float:
    norms = [_norm(p.grad.detach()) for p in model.parameters() if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.stack(norms).norm().item())


def _norm(grad: torch.Tensor) -> torch.Tensor:
    # A sparse gradient's repeated rows must be summed before taking the norm.
    return grad.coalesce().values().norm() if grad.is_sparse else grad.norm()
