"""What every framework driver provides, written without importing any framework.

A driver knows how one optimizer style (torch, Keras 3, legacy tf.keras) builds a model
and an optimizer, takes a step, reads and compares state, saves and restores a
checkpoint and places work on a device. Everything above the drivers (the training
loop, the conformance checks, the job result) is written once over this interface, so
a rule such as "the reloaded state must be bitwise equal" reads in one place and a
user gets the same verdict in every framework.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

    from jobs.spec import JobSpec
    from jobs.workloads import Workload
    from optimizers.registry import Entry


class CheckpointMismatch(Exception):
    """The reloaded objects differ from the ones that were saved."""


@dataclass(frozen=True)
class Capabilities:
    """What applies to a style, the way torch's `OptimizerInfo` flags what an optimizer supports.

    Checks and the loop read these instead of asking which framework they are in.
    """

    # Row-sparse gradients exist in the framework (torch sparse COO, tf.IndexedSlices).
    sparse_gradients: bool = True
    # `step(closure)`: the optimizer can re-evaluate the loss itself (torch only).
    closure: bool = False
    # Hyperparameters live per param group and groups can be added (torch only).
    param_groups: bool = False
    # The step can be compiled (torch.compile, tf.function / XLA).
    compiled_step: bool = True
    # A whole model (weights plus compiled optimizer) can be saved and loaded by name.
    whole_model_save: bool = False
    # A resumed job continues from a checkpoint file of this style.
    resume: bool = False


@dataclass(frozen=True)
class StepRecord:
    """What one training step measured, already read back to the host."""

    loss: float
    grad_norm: float
    lr: float
    optimizer_ms: float


@dataclass(frozen=True)
class Evaluation:
    """The validation loss, and the model's outputs and the labels of the validation rows (numpy)."""

    loss: float
    outputs: np.ndarray
    labels: np.ndarray


@dataclass
class Checkpointed:
    """A verified checkpoint: where it lies, the objects training continues from, what to know."""

    objects: Any
    path: Path
    warnings: list[str] = field(default_factory=list)


class TrainingSession(ABC):
    """One job's model, data and optimizer in one framework, driven by `jobs.training.loop`.

    The loop owns cadence, timing, metrics, evaluation and checkpoint bookkeeping; a
    session only does what differs between frameworks.
    """

    device: str

    def scope(self) -> AbstractContextManager[Any]:
        """Where the loop's work runs (TensorFlow: a device scope); nothing by default."""
        return nullcontext()

    @abstractmethod
    def build(self) -> Any:
        """Fresh model and optimizer exactly as the spec describes them."""

    @abstractmethod
    def batch(self, step: int) -> Any:
        """The training batch of `step`, on the training device."""

    @abstractmethod
    def train_step(self, objects: Any, batch: Any, step: int) -> StepRecord:
        """Forward, backward and one optimizer update; the loss is read back to the host."""

    @abstractmethod
    def evaluate(self, objects: Any) -> Evaluation:
        """Loss and outputs on the validation split, in evaluation mode."""

    @abstractmethod
    def checkpoint(self, objects: Any, step: int, folder: Path) -> Checkpointed:
        """Save under `folder`, reload into fresh objects, prove nothing was lost.

        Raises CheckpointMismatch naming what differs; training continues from the
        returned objects, so a serialization bug shows in the result.
        """

    def resume(self, path: Path) -> tuple[Any, int]:
        """Objects restored from a checkpoint this style wrote, and the step it was taken at."""
        raise ValueError(f"--resume is not available for {self.style_name} jobs yet")

    @abstractmethod
    def params_sha256(self, objects: Any) -> str:
        """SHA-256 over the model's parameters, so two runs can be compared exactly."""

    def details(self, objects: Any) -> dict[str, Any]:
        """Style-specific facts for the result (e.g. where optimizer variables sit)."""
        return {}

    @property
    def style_name(self) -> str:
        return type(self).__name__


class Driver(ABC):
    """One optimizer style: the single place that knows its framework."""

    style: ClassVar[str]
    framework: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @abstractmethod
    def session(self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path) -> TrainingSession:
        """The training session of one job."""

    # -- fresh-process checks --
    # The module with this style's side of `resume_exact` and `distributed` (a `FreshRuns`,
    # jobs/checks/fresh/plan.py), named, so a fresh child can find it before importing anything.
    fresh_module: ClassVar[str]


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint of any style: one file (torch) or one folder (Keras)."""
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
