"""scikit-learn's bundled 8x8 handwritten digits (real data, no download) and a small MLP."""

from __future__ import annotations

import gzip
import importlib.util
from collections import OrderedDict
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jobs.workloads.base import Dataset, Target, Task, Workload
from optimizers.hyperparams import Param

# The split is part of the workload's definition, not of a job: every job, seed and
# framework sees the same 360 validation images.
SPLIT_SEED = 20240229
VALIDATION_SIZE = 360


# scikit-learn's bundled copy of the UCI digits, relative to its package folder.
DIGITS_FILE = Path("datasets", "data", "digits.csv.gz")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """`sklearn.datasets.load_digits(return_X_y=True)`, bit for bit, without importing it.

    Importing `sklearn.datasets` costs about 1.9 s here (scipy and most of scikit-learn come with
    it) for 1,797 rows of 65 numbers; so read the CSV it ships the way it reads it (`np.loadtxt`
    of the gzip, float64 pixels, the last column the label as int64) from scikit-learn's folder,
    found without importing the package. tests/jobs/workloads compares the two. A scikit-learn
    that moved the file still works, through `load_digits` itself.
    """
    package = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    folders = list(package.submodule_search_locations or []) if package else []
    path = Path(folders[0], DIGITS_FILE) if folders else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        features, labels = load_digits(return_X_y=True)
        return features, labels
    with gzip.open(path, mode="rt", encoding="utf-8") as rows:
        data = np.loadtxt(rows, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


@cache
def load_digits_split() -> Dataset:
    """1437 train / 360 val rows of 64 float32 pixels in [0, 1] (row-major 8x8), int64 labels 0..9."""
    features, labels = load_digits_arrays()
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
    """64 -> hidden -> hidden -> 10 logits; ReLU; Glorot-uniform kernels and zero biases everywhere.

    Layers carry the same names in every framework (`hidden_1`, `hidden_2`, `logits`).
    """

    name: ClassVar[str] = "digits_mlp"
    summary: ClassVar[str] = "8x8 digits (1437 train / 360 val), MLP 64-h-h-10 with ReLU"
    task: ClassVar[Task] = "classification"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    default_target: ClassVar[Target] = Target("val/accuracy", "max", 0.95)
    params: ClassVar[dict[str, Param]] = {
        "hidden": Param("hidden", "int", 64, low=1, high=4096, help="width of both hidden layers"),
    }

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        return load_digits_split()

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        from torch import nn

        from jobs.workloads.torch_modules import glorot_init_

        hidden = self.check_params(params)["hidden"]
        return glorot_init_(
            nn.Sequential(
                OrderedDict(
                    hidden_1=nn.Linear(dataset.x_train.shape[1], hidden),
                    relu_1=nn.ReLU(),
                    hidden_2=nn.Linear(hidden, hidden),
                    relu_2=nn.ReLU(),
                    logits=nn.Linear(hidden, dataset.n_classes),
                )
            )
        )

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        hidden = self.check_params(params)["hidden"]
        layers = keras_module.layers
        dense = {"kernel_initializer": "glorot_uniform", "bias_initializer": "zeros"}
        return keras_module.Sequential(
            [
                keras_module.Input(shape=dataset.x_train.shape[1:], dtype="float32"),
                layers.Dense(hidden, activation="relu", name="hidden_1", **dense),
                layers.Dense(hidden, activation="relu", name="hidden_2", **dense),
                layers.Dense(dataset.n_classes, name="logits", **dense),
            ],
            name=self.name,
        )
