"""`quadratic` and `rosenbrock`: test functions whose "model" is the parameter vector itself.

The loss is the function's value at the parameters (task `objective`); there is no data to
learn from. The rows a batch gathers are zeros that only set its size, so `batch_size` changes
nothing but the throughput figures, the batch order (the seed) changes nothing at all, and every
seed of a deterministic optimizer follows the same path. `val/loss` is the function's value
after the step (one validation row). The start is fixed (no random initialisation), so torch,
Keras 3 and legacy tf.keras start from the same point with the same loss. A 2-D function logs
its trajectory, `traj/x` and `traj/y`, at every step (`step_metrics`). The functions are
defined in `jobs.workloads.surfaces`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, ClassVar

import numpy as np

from jobs.workloads.base import Dataset, Target, Task, Workload
from jobs.workloads.surfaces import (
    QUADRATIC_DEFAULTS,
    ROSENBROCK_DEFAULTS,
    quadratic_hessian,
    quadratic_start,
)
from optimizers.hyperparams import Param

# Enough rows for any batch_size a spec may give (JobSpec allows at most 65536).
ROWS = 65536


@cache
def surface_rows() -> Dataset:
    """Zero rows (65536 train, 1 validation): the data of a test function is only its batch's size."""
    return Dataset(
        x_train=np.zeros((ROWS, 1), np.float32),
        y_train=np.zeros(ROWS, np.float32),
        x_val=np.zeros((1, 1), np.float32),
        y_val=np.zeros(1, np.float32),
        n_classes=0,
    )


def trajectory(values: Sequence[np.ndarray]) -> dict[str, float]:
    """`traj/x`, `traj/y` of a 2-vector point (the model's one parameter)."""
    point = np.asarray(values[0], dtype=np.float64).reshape(-1)
    return {"traj/x": float(point[0]), "traj/y": float(point[1])}


class _TestFunction(Workload):
    task: ClassVar[Task] = "objective"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        return surface_rows()

    def function(self, params: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        """(start, hessian or None for Rosenbrock, the Keras layer's config)."""
        raise NotImplementedError

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        import torch

        from jobs.workloads.torch_modules import SurfacePoint

        start, hessian, _ = self.function(self.check_params(params))
        point = SurfacePoint(
            torch.tensor(start, dtype=torch.float32),
            None if hessian is None else torch.tensor(hessian, dtype=torch.float32),
        )
        return torch.nn.Sequential(OrderedDict(point=point))  # named as the Keras layer

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        from jobs.workloads.keras_layers import layers_for

        _, _, config = self.function(self.check_params(params))
        rows = keras_module.Input(shape=dataset.x_train.shape[1:], dtype="float32")
        value = layers_for(keras_module).SurfacePoint(name="point", **config)(rows)
        return keras_module.Model(rows, value, name=self.name)


class Quadratic(_TestFunction):
    name: ClassVar[str] = "quadratic"
    summary: ClassVar[str] = (
        "ill-conditioned quadratic 0.5 w^T H w (H rotated, eigenvalues 1..condition), start w = 1; "
        "the parameters are the model"
    )
    default_target: ClassVar[Target] = Target("val/loss", "min", 1e-3)
    params: ClassVar[dict[str, Param]] = {
        "dim": Param("dim", "int", QUADRATIC_DEFAULTS["dim"], low=1, high=4096, help="dimension of w"),
        "condition": Param(
            "condition",
            "float",
            QUADRATIC_DEFAULTS["condition"],
            low=1.0,
            high=1e8,
            help="condition number of H (largest / smallest eigenvalue)",
        ),
    }

    def function(self, params: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        dim, condition = int(params["dim"]), float(params["condition"])
        config = {"function": "quadratic", "dim": dim, "condition": condition}
        return quadratic_start(dim), quadratic_hessian(dim, condition), config

    def traces_parameters(self, params: Mapping[str, Any]) -> bool:
        return bool(self.check_params(params)["dim"] == 2)

    def step_metrics(self, params: Mapping[str, Any], values: Sequence[np.ndarray]) -> dict[str, float]:
        return trajectory(values)


class Rosenbrock(_TestFunction):
    name: ClassVar[str] = "rosenbrock"
    summary: ClassVar[str] = (
        "Rosenbrock's banana (1-x)^2 + 100 (y-x^2)^2, minimum 0 at (1, 1), start (-1.2, 1); "
        "the parameters are the model"
    )
    default_target: ClassVar[Target] = Target("val/loss", "min", 1e-2)
    params: ClassVar[dict[str, Param]] = {
        "start_x": Param("start_x", "float", ROSENBROCK_DEFAULTS["start_x"], low=-3.0, high=3.0),
        "start_y": Param("start_y", "float", ROSENBROCK_DEFAULTS["start_y"], low=-3.0, high=3.0),
    }

    def function(self, params: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
        start = [float(params["start_x"]), float(params["start_y"])]
        return np.asarray(start), None, {"function": "rosenbrock", "start": start}

    def traces_parameters(self, params: Mapping[str, Any]) -> bool:
        return True

    def step_metrics(self, params: Mapping[str, Any], values: Sequence[np.ndarray]) -> dict[str, float]:
        return trajectory(values)
