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
    framework: str
    gpu: bool  # device `cuda` or `cuda:N`
    slots: int  # distribution.devices; absent: 1


def needs_of(spec: dict[str, Any]) -> JobNeeds:
    device = spec.get("device")
    distribution = spec.get("distribution")
    devices = distribution.get("devices") if isinstance(distribution, dict) else None
    slots = devices if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1 else 1
    return JobNeeds(
        framework=str(spec.get("framework", "torch")),
        gpu=isinstance(device, str) and device.startswith("cuda"),
        slots=slots,
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


def catalogue_sha256(catalogue: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(catalogue, sort_keys=True).encode()).hexdigest()
