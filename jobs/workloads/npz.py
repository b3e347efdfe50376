"""`npz`: a user's own data, `X` and `y` arrays in a `.npz` file under a data root, and an MLP.

- The file: `path` (required), resolved under the configured data roots (jobs/data_roots.py;
  the API refuses a path outside them or a missing file at submission), read with
  `numpy.load(allow_pickle=False)`, so it holds plain arrays only.
- `X`: numeric, one row per example (any row shape; rows are flattened), used as float32 as
  given: scale it yourself. `y`: one value per row (1-D, the same length as X).
- Task from y's dtype: integer or bool y is classification (labels 0..max(y), cross-entropy,
  `val/accuracy`); floating y is regression (MSE, `val/rmse`).
- Split: a permutation drawn from numpy's default_rng(SPLIT_SEED) over the rows; the first
  fifth (at least one row) is validation, the rest training. The same in every framework, job
  and seed.
- Model: `layers` hidden layers of `hidden` units with ReLU (`hidden_1`...), then `logits` (one
  per class, or 1 for regression); Glorot-uniform kernels and zero biases everywhere.

Bad arrays fail the job with a message naming what is wrong (never a bare traceback).
"""

from __future__ import annotations

import itertools
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from jobs.data_roots import data_roots_from_environment, resolve_data_path
from jobs.workloads.base import Dataset, Target, Task, Workload
from optimizers.hyperparams import Param

if TYPE_CHECKING:
    from jobs.frameworks.base import Evaluation

SPLIT_SEED = 20240303
VALIDATION_FRACTION = 0.2
MAX_CLASSES = 100_000
FIELD = "workload.params.path"


def read_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """X as (N, features) float32 and y as int64 labels or float32 targets; ValueError says what is wrong."""
    where = f"{FIELD} {path.name!r}"
    try:
        with np.load(path, allow_pickle=False) as arrays:
            names = list(arrays.files)
            for name in ("X", "y"):
                if name not in names:
                    held = ", ".join(map(repr, names)) or "no arrays"
                    raise ValueError(
                        f"{where} has no array {name!r}; it holds {held} (an npz workload needs X and y)"
                    )
            x, y = arrays["X"], arrays["y"]
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{where} is not a readable .npz file (numpy.savez writes one): {exc}") from None
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "pickled" in str(exc):
            raise ValueError(f"{where}: X and y must be plain numeric arrays, not Python objects") from None
        raise
    if x.ndim < 1 or len(x) < 2:
        raise ValueError(f"{where}: X must hold at least 2 rows; received shape {x.shape}")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(
            f"{where}: y must be 1-D with one value per row of X ({len(x)} rows); received shape {y.shape}"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise ValueError(f"{where}: X must be numeric; received dtype {x.dtype}")
    features = x.reshape(len(x), -1).astype(np.float32)
    if not np.isfinite(features).all():
        raise ValueError(f"{where}: X holds NaN or infinite values")
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        labels = y.astype(np.int64)
        if labels.min() < 0 or labels.max() >= MAX_CLASSES:
            raise ValueError(
                f"{where}: integer y are class labels, 0 to {MAX_CLASSES - 1}; "
                f"received values from {labels.min()} to {labels.max()}"
            )
        return features, labels
    if not np.issubdtype(y.dtype, np.floating):
        raise ValueError(f"{where}: y must be integer (classes) or floating (regression); received {y.dtype}")
    targets = y.astype(np.float32)
    if not np.isfinite(targets).all():
        raise ValueError(f"{where}: y holds NaN or infinite values")
    return features, targets


@cache
def _load_split(path: Path, modified_ns: int) -> Dataset:
    features, y = read_arrays(path)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_val = max(1, int(len(y) * VALIDATION_FRACTION))
    val, train = order[:n_val], order[n_val:]
    n_classes = int(y.max()) + 1 if y.dtype == np.int64 else 0
    return Dataset(
        x_train=features[train], y_train=y[train], x_val=features[val], y_val=y[val], n_classes=n_classes
    )


def load_npz(path_param: str) -> Dataset:
    path = resolve_data_path(
        path_param, data_roots_from_environment(), field=FIELD, suffixes=Npz.params["path"].suffixes
    )
    return _load_split(path, path.stat().st_mtime_ns)  # a rewritten file is read again


class Npz(Workload):
    name: ClassVar[str] = "npz"
    summary: ClassVar[str] = (
        "your own X, y arrays from a .npz file under a data root (integer y: classification, float y: "
        "regression; 80/20 split), MLP of `layers` x `hidden` with ReLU"
    )
    task: ClassVar[Task] = "from_data"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    fixed_data: ClassVar[bool] = False
    # A placeholder: the right target depends on your data; give a study its own.
    default_target: ClassVar[Target] = Target("val/loss", "min", 0.1)
    params: ClassVar[dict[str, Param]] = {
        "path": Param(
            "path",
            "path",
            None,
            required=True,
            help="the .npz file (X, y), absolute or relative to a data root",
            suffixes=(".npz",),
        ),
        "hidden": Param("hidden", "int", 64, low=1, high=8192, help="width of every hidden layer"),
        "layers": Param("layers", "int", 2, low=1, high=16, help="hidden layers"),
    }

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        return load_npz(self.check_params(params or {})["path"])

    def task_of(self, dataset: Dataset) -> Task:
        return "classification" if dataset.n_classes > 0 else "regression"

    def validation_metrics(self, params: Mapping[str, Any], evaluation: Evaluation) -> dict[str, float]:
        if evaluation.labels.dtype == np.int64:
            return {
                "val_accuracy": float(np.mean(np.argmax(evaluation.outputs, axis=-1) == evaluation.labels))
            }
        return {"val_rmse": float(np.sqrt(evaluation.loss))}

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        from torch import nn

        from jobs.workloads.torch_modules import glorot_init_

        checked = self.check_params(params)
        hidden = checked["hidden"]
        widths = [dataset.x_train.shape[1]] + [hidden] * checked["layers"]
        named: OrderedDict[str, nn.Module] = OrderedDict()
        for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths), start=1):
            named[f"hidden_{index}"] = nn.Linear(fan_in, fan_out)
            named[f"relu_{index}"] = nn.ReLU()
        named["logits"] = nn.Linear(hidden, max(dataset.n_classes, 1))
        return glorot_init_(nn.Sequential(named))

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        checked = self.check_params(params)
        layers = keras_module.layers
        dense = {"kernel_initializer": "glorot_uniform", "bias_initializer": "zeros"}
        hidden = [
            layers.Dense(checked["hidden"], activation="relu", name=f"hidden_{index}", **dense)
            for index in range(1, checked["layers"] + 1)
        ]
        return keras_module.Sequential(
            [
                keras_module.Input(shape=dataset.x_train.shape[1:], dtype="float32"),
                *hidden,
                layers.Dense(max(dataset.n_classes, 1), name="logits", **dense),
            ],
            name=self.name,
        )
