"""The PyTorch checkpoint round-trip: save, reload into fresh objects, prove nothing was lost.

One file per checkpoint (a dict with `model`, `optimizer`, `scheduler`, `rng`, `step`,
`data_position`, `spec`), loaded back with `weights_only=True` as a user would.
Comparing state dicts alone would miss state an optimizer keeps outside
`self.state` / `param_groups` (both copies would lack it equally), so the check of
record also takes one identical probe step with the original and the reloaded
objects and requires bitwise-equal results.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


class CheckpointMismatch(Exception):
    """The reloaded objects differ from the ones that were saved."""


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
