"""What every workload provides: framework-neutral data plus one model per framework."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from optimizers.hyperparams import Param, check_all


@dataclass(frozen=True)
class Dataset:
    """A fixed train/validation split as numpy arrays (features float32, labels int64)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    n_classes: int

    @property
    def train_size(self) -> int:
        return int(self.x_train.shape[0])


class Workload(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    frameworks: ClassVar[tuple[str, ...]]
    params: ClassVar[dict[str, Param]]

    @abstractmethod
    def load_data(self) -> Dataset: ...

    @abstractmethod
    def torch_model(self, params: Mapping[str, Any], dataset: Dataset) -> Any:
        """A fresh `torch.nn.Module`; its initial weights come from torch's global RNG."""

    def check_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return check_all(params, self.params, owner=f"workload {self.name!r}")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "frameworks": list(self.frameworks),
            "params": [param.to_json() for param in self.params.values()],
            "train_size": self.load_data().train_size,
        }
