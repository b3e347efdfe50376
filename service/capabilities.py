"""What a worker can run and what a job needs, read from the stored spec JSON (no framework import).

The spec is read defensively: a job stored before `distribution` existed needs one slot, and a
check job (no `device`) runs on any device.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

NO_GPU_VALUES = ("", "-1", "none", "NoDevFiles")


@dataclass(frozen=True)
class JobNeeds:
    """What a job takes of a worker. Its slots are all of one kind (GPU slots, or CPU-only ones),
    except for a `cpu` job, which uses no GPU wherever it runs: GPU slots only for `cuda`; for
    `auto` (and a check job), all CPU-only slots or else all GPU slots, so that every rank of a DDP
    job sees a GPU or none does."""

    framework: str
    gpu: bool  # device `cuda` or `cuda:N`
    slots: int  # distribution.devices; absent: 1
    mixes: bool = False  # device `cpu`: CPU-only and GPU slots alike, mixed

    def takes(self, free_cpu: int, free_gpu: int) -> str | None:
        """The kind of slot ("cpu" or "gpu") the job takes from these free ones: CPU-only slots
        first, except for a GPU job; "mixed" for a `cpu` job that needs both; None: it does not fit."""
        if self.gpu:
            return "gpu" if self.slots <= free_gpu else None
        if self.slots <= free_cpu:
            return "cpu"
        if self.slots <= free_gpu:
            return "gpu"
        return "mixed" if self.mixes and self.slots <= free_cpu + free_gpu else None


def needs_of(spec: dict[str, Any]) -> JobNeeds:
    device = spec.get("device")
    distribution = spec.get("distribution")
    devices = distribution.get("devices") if isinstance(distribution, dict) else None
    slots = devices if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1 else 1
    return JobNeeds(
        framework=str(spec.get("framework", "torch")),
        gpu=isinstance(device, str) and device.startswith("cuda"),
        slots=slots,
        mixes=device == "cpu",
    )


def gpu_index_refusal(device: object) -> str | None:
    """Why a job run by a worker cannot have `device` `cuda:N` with N >= 1; None where it can.

    A worker picks each job's GPU(s) and shows the job only those (CUDA_VISIBLE_DEVICES), numbered
    from 0: `cuda:1` would name a GPU the job cannot see (or, for DDP, shift every rank by one).
    `python -m jobs.run` run by hand sees the host's GPUs and may still name one."""
    index = device.removeprefix("cuda:") if isinstance(device, str) else ""
    if not isinstance(device, str) or index == device or not index.isdigit() or int(index) == 0:
        return None
    return (
        f"device {device!r} names a GPU by its index, but a worker picks the GPU(s) of each job it "
        "runs and the job sees only those, as cuda:0 onwards; write 'cuda' (a GPU the worker picks) "
        "or 'auto' (a GPU where the worker gives the job one); an index is for `python -m jobs.run` run "
        "by hand"
    )


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """GPU ids this worker may hand out: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        value = env["CUDA_VISIBLE_DEVICES"].strip()
        return [] if value in NO_GPU_VALUES else [g.strip() for g in value.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]
    return [str(index) for index in range(len(lines))] if listing.returncode == 0 else []


def catalogue_frameworks(catalogue: dict[str, Any]) -> list[str]:
    """The frameworks the job environment has optimizers for (a missing TensorFlow has none)."""
    return sorted({str(o.get("framework")) for o in catalogue.get("optimizers", []) if o.get("framework")})


# Per style (torch, keras, tf_legacy), the optimizer names a catalogue has: a TensorFlow job runs one
# style, and a name offered in the other is not the job's class.
OfferedOptimizers = dict[str, frozenset[str]]


def offered_optimizers(catalogue: dict[str, Any]) -> OfferedOptimizers:
    """What a worker's catalogue lets it run, by style: a plugin that failed to import on this host
    (or is not deployed here yet) is absent, so the worker leaves its jobs to the others."""
    offered: dict[str, set[str]] = {}
    for optimizer in catalogue.get("optimizers", []):
        offered.setdefault(str(optimizer.get("style")), set()).add(str(optimizer.get("name")))
    return {style: frozenset(names) for style, names in offered.items()}


def optimizers_named(spec: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The optimizers a job's spec runs, with the style it names (None: the framework's first): its
    own, and the base a wrapper wraps."""
    optimizer = spec.get("optimizer") or {}
    base = optimizer.get("base") or {}
    return [
        (str(choice["name"]), choice.get("style"))
        for choice in (optimizer, base)
        if choice.get("name") is not None
    ]


def catalogue_sha256(catalogue: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(catalogue, sort_keys=True).encode()).hexdigest()
