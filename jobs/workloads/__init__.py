"""Workloads: a dataset and a model architecture, defined once for every framework.

Only light metadata lives at import time; data and framework code load on use.
"""

from __future__ import annotations

from typing import Any

from jobs.workloads.base import Dataset, Target, Task, Workload
from jobs.workloads.char_lm import CharLm
from jobs.workloads.digits_cnn import DigitsCnn
from jobs.workloads.digits_mlp import DigitsMlp
from jobs.workloads.embedding_mf import EmbeddingMf
from jobs.workloads.npz import Npz
from jobs.workloads.quadratic import Quadratic, Rosenbrock

WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (DigitsMlp(), DigitsCnn(), EmbeddingMf(), Quadratic(), Rosenbrock(), CharLm(), Npz())
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def describe_workloads(*, with_parameters: bool = False) -> list[dict[str, Any]]:
    """Each workload's description; `with_parameters`: its torch model's parameters at the default
    params too (builds each model: the catalogue's process only)."""
    described = [workload.describe() for workload in WORKLOADS.values()]
    if with_parameters:
        for entry, workload in zip(described, WORKLOADS.values(), strict=True):
            entry["parameters"] = _parameters_or_none(workload)
    return described


def _parameters_or_none(workload: Workload) -> list[dict[str, Any]] | None:
    """The model's parameters, or None where building it fails here: one workload that cannot be
    built must not cost the whole catalogue (its jobs then judge their recipes when they start)."""
    try:
        return workload.torch_parameters()
    except Exception:
        return None


__all__ = ["WORKLOADS", "Dataset", "Target", "Task", "Workload", "describe_workloads", "get_workload"]
