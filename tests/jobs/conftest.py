"""Shared fixtures for the job-side tests: one torch thread, the built-in registry, a TrainingJob factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from jobs.spec import JobSpec
from optimizers.registry import Registry, load_registry


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The models here are tiny: one thread is fastest, and spares a busy 2-core box from thrashing."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def registry() -> Registry:
    """Built-ins only: a developer's OPTLAB_PLUGIN_DIRS must not leak into the tests."""
    return load_registry(plugin_dirs=[])


@pytest.fixture
def make_job(tmp_path: Path, registry: Registry) -> Callable[..., Any]:
    """`make_job(spec)` -> a TrainingJob with its own workdir, a NullTracker and a Reporter."""
    from jobs.report import Reporter
    from jobs.tracking import NullTracker
    from jobs.training.loop import TrainingJob

    numbers = count()

    def make(spec: JobSpec, *, with_registry: Registry | None = None) -> TrainingJob:
        workdir = tmp_path / f"job-{next(numbers)}"
        workdir.mkdir()
        return TrainingJob(
            spec,
            registry=with_registry or registry,
            workdir=workdir,
            tracker=NullTracker(),
            reporter=Reporter(workdir),
        )

    return make
