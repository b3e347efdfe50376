"""Small builders shared by the job-side tests."""

from __future__ import annotations

from typing import Any

from jobs.spec import JobSpec
from optimizers.registry import Registry, entry_for_class, load_registry


def digits_spec(**overrides: Any) -> JobSpec:
    """A small digits_mlp job: 60 steps of ema_momentum, checkpointed every 7."""
    fields: dict[str, Any] = {
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
        "steps": 60,
        "batch_size": 32,
        "checkpoint_every": 7,
        "eval_every": 20,
        "device": "cpu",
    }
    return JobSpec.model_validate({**fields, **overrides})


def registry_with(*classes: type) -> Registry:
    """The torch built-ins and `classes`, registered under their derived names."""
    registry = load_registry(plugin_dirs=[], styles=["torch"])
    for cls in classes:
        registry.add(entry_for_class(cls, source="test"))
    return registry
