"""scikit-learn's bundled 8x8 handwritten digits (real data, no download) and a small MLP."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, ClassVar

import numpy as np

from jobs.workloads.base import Dataset, Workload
from optimizers.hyperparams import Param

# The split is part of the workload's definition, not of a job: every job, seed and
# framework sees the same 360 validation images.
SPLIT_SEED = 20240229
VALIDATION_SIZE = 360


@cache
def load_digits_split() -> Dataset:
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    features = (features[order] / 16.0).astype(np.float32)  # pixel counts 0..16 -> [0, 1]
    labels = labels[order].astype(np.int64)
    return Dataset(
        x_train=features[VALIDATION_SIZE:],
        y_train=labels[VALIDATION_SIZE:],
        x_val=features[:VALIDATION_SIZE],
        y_val=labels[:VALIDATION_SIZE],
        n_classes=10,
    )


class DigitsMlp(Workload):
    name: ClassVar[str] = "digits_mlp"
    summary: ClassVar[str] = "8x8 digits (1437 train / 360 val), MLP 64-h-h-10 with ReLU"
    frameworks: ClassVar[tuple[str, ...]] = ("torch",)
    params: ClassVar[dict[str, Param]] = {
        "hidden": Param("hidden", "int", 64, low=1, high=4096, help="width of both hidden layers"),
    }

    def load_data(self) -> Dataset:
        return load_digits_split()

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset) -> Any:
        from torch import nn

        hidden = self.check_params(params)["hidden"]
        return nn.Sequential(
            nn.Linear(dataset.x_train.shape[1], hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, dataset.n_classes),
        )
