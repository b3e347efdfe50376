"""What every workload provides: framework-neutral data plus the same model in every framework.

A workload is the unit users compare optimizers on, so "the same workload" must mean the
same data, split, architecture and initialisation scheme in torch, Keras 3 and legacy
tf.keras: initial losses then start on the same scale and curves are comparable.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from optimizers.hyperparams import Param, check_all

if TYPE_CHECKING:
    from jobs.frameworks.base import Evaluation

# classification: logits against int64 labels (any leading shape: a language model's (N, T, V)
# logits against (N, T) next characters); regression: MSE; objective: the model's output IS the
# loss (a test function of the parameters: `quadratic`, `rosenbrock`), the data only sets the rows.
# from_data: `task_of(dataset)` decides (a user's file: integer labels classify, floats regress).
Task = Literal["classification", "regression", "objective", "from_data"]


@dataclass(frozen=True)
class Target:
    """A workload's documented default target: a study without its own uses it for time-to-target."""

    metric: str
    mode: Literal["min", "max"]
    value: float


@dataclass(frozen=True)
class Dataset:
    """A fixed train/validation split as numpy arrays, in one layout every framework reads.

    `x`: float32 features of any shape per row, or int64 index tuples (e.g. (user, item)).
    `y`: int64 labels in [0, n_classes) for classification; float32 targets for regression.
    `n_classes`: the number of classes, 0 for regression.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    n_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ValueError(f"x_{split} has {len(x)} rows but y_{split} has {len(y)}; they must match")
            expected = np.int64 if self.n_classes > 0 else np.float32
            if y.dtype != expected:
                raise ValueError(
                    f"y_{split} must be {np.dtype(expected)} when n_classes={self.n_classes}; "
                    f"received {y.dtype}"
                )
        if self.x_train.shape[1:] != self.x_val.shape[1:]:
            raise ValueError(
                f"x_train rows have shape {self.x_train.shape[1:]} but x_val rows {self.x_val.shape[1:]}"
            )
        if self.n_classes < 0:
            raise ValueError(f"n_classes must be >= 0 (0 for regression); received {self.n_classes}")

    @property
    def train_size(self) -> int:
        return int(self.x_train.shape[0])


MetricMode = Literal["min", "max"]  # the way a metric improves


class Workload(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    task: ClassVar[Task]
    frameworks: ClassVar[tuple[str, ...]]
    params: ClassVar[dict[str, Param]]
    default_target: ClassVar[Target]
    # Whether the data depends on no file a spec names, so the catalogue can state its size.
    fixed_data: ClassVar[bool] = True
    # The params the data depends on: the size the catalogue states holds at their defaults only.
    data_params: ClassVar[tuple[str, ...]] = ()
    # (param, divisor param): the first must be a multiple of the second (char_lm's width of heads);
    # published in the catalogue so the API refuses a bad pair at submission.
    multiple_of: ClassVar[tuple[tuple[str, str], ...]] = ()

    @abstractmethod
    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        """The split for these workload params (None: the defaults); workloads whose data does not
        depend on their params ignore them."""

    @abstractmethod
    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        """A fresh `torch.nn.Module`; its initial weights come from torch's global RNG.

        `sparse=True` makes embedding layers `nn.Embedding(..., sparse=True)`; workloads
        without embeddings ignore it.
        """

    @abstractmethod
    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        """The same architecture, uncompiled, built with `keras_module` (`keras` or `tf_keras`).

        Initial weights come from that framework's seeded RNG (`keras_module.utils.set_random_seed`).
        """

    def check_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        checked = check_all(params, self.params, owner=f"workload {self.name!r}")
        for param, divisor in self.multiple_of:
            problem = multiple_problem(param, checked[param], divisor, checked[divisor])
            if problem:
                raise ValueError(problem)
        return checked

    def target_metrics(self) -> dict[str, MetricMode]:
        """What a job of this workload logs that a study may target, each with the way it improves:
        the losses and what `validation_metrics` gives (logged as `val/<metric>`); both task metrics
        where the task is the data's."""
        by_task: dict[str, dict[str, MetricMode]] = {
            "classification": {"val/accuracy": "max"},
            "regression": {"val/rmse": "min"},
            "objective": {},
            "from_data": {"val/accuracy": "max", "val/rmse": "min"},
        }
        return {"train/loss": "min", "val/loss": "min", **by_task[self.task]}

    def task_of(self, dataset: Dataset) -> Task:
        """The task of this dataset: the workload's own, unless it is `from_data`."""
        return self.task

    def validation_metrics(self, params: Mapping[str, Any], evaluation: Evaluation) -> dict[str, float]:
        """What the loop logs beside `val/loss`, named `val_<metric>` (logged as `val/<metric>`)."""
        if self.task == "regression":
            return {"val_rmse": math.sqrt(evaluation.loss)}
        if self.task == "objective":
            return {}
        accuracy = float(np.mean(np.argmax(evaluation.outputs, axis=-1) == evaluation.labels))
        return {"val_accuracy": accuracy}

    def traces_parameters(self, params: Mapping[str, Any]) -> bool:
        """Whether `step_metrics` wants the parameters at every step (reading them costs a device sync)."""
        return False

    def step_metrics(self, params: Mapping[str, Any], values: Sequence[np.ndarray]) -> dict[str, float]:
        """Metrics of the model's parameters (`values`, in model order) logged at every step, e.g. a
        2-D test function's `traj/x`, `traj/y`; called only when `traces_parameters(params)`."""
        return {}

    def torch_parameters(self) -> list[dict[str, Any]] | None:
        """The torch model's parameters at the default params, by name and shape (what a param
        group's name glob and ndim test match); None where the model depends on a file the spec
        names. Builds the model: for the catalogue's process, which has torch loaded anyway."""
        if not self.fixed_data or "torch" not in self.frameworks:
            return None
        defaults = {name: param.default for name, param in self.params.items()}
        model = self.torch_model(defaults, self.load_data(defaults))
        return [{"name": name, "shape": list(p.shape)} for name, p in model.named_parameters()]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "task": self.task,
            "frameworks": list(self.frameworks),
            "params": [param.to_json() for param in self.params.values()],
            # At the default params; None where it depends on a file the spec names (checked by the job).
            "train_size": self.load_data().train_size if self.fixed_data else None,
            "default_target": asdict(self.default_target),
            "metrics": [{"name": name, "mode": mode} for name, mode in self.target_metrics().items()],
            "multiple_of": [{"param": param, "of": divisor} for param, divisor in self.multiple_of],
            "data_params": list(self.data_params),
        }


def multiple_problem(param: str, value: int, divisor: str, by: int) -> str | None:
    """The message when `value` (of `param`) is not a multiple of `by` (of `divisor`); None when it is."""
    if by and value % by == 0:
        return None
    return f"workload.params.{param} must be a multiple of {divisor} ({by}); received {value}"
