"""What every workload provides: framework-neutral data plus the same model in every framework.

A workload is the unit users compare optimizers on, so "the same workload" must mean the
same data, split, architecture and initialisation scheme in torch, Keras 3 and legacy
tf.keras: initial losses then start on the same scale and curves are comparable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from optimizers.hyperparams import Param, check_all

Task = Literal["classification", "regression"]


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


class Workload(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    task: ClassVar[Task]
    frameworks: ClassVar[tuple[str, ...]]
    params: ClassVar[dict[str, Param]]

    @abstractmethod
    def load_data(self) -> Dataset: ...

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
        return check_all(params, self.params, owner=f"workload {self.name!r}")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "task": self.task,
            "frameworks": list(self.frameworks),
            "params": [param.to_json() for param in self.params.values()],
            "train_size": self.load_data().train_size,
        }
