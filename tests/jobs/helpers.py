"""Small builders shared by the job-side tests."""

from __future__ import annotations

from typing import Any

from jobs.spec import JobSpec


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
