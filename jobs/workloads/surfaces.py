"""The test functions of `quadratic` and `rosenbrock`, in numpy: their definition, and the 2-D
surface a study report draws trajectories over.

numpy only, so the service (the study report) imports it without a framework; the torch and
Keras models compute the same functions in float32 (torch_modules.SurfacePoint,
keras_layers.SurfacePoint).

- quadratic: f(w) = 0.5 * w^T H w with H = Q diag(lambda) Q^T, the eigenvalues lambda
  geometrically spaced from 1 to `condition` (so H's condition number is `condition`) and Q the
  orthogonal factor of the QR decomposition of a standard normal (dim x dim) matrix drawn from
  numpy's default_rng(QUADRATIC_ROTATION_SEED), its columns' signs fixed so that diag(R) > 0.
  Minimum 0 at w = 0; the start is w = (1, ..., 1).
- rosenbrock: f(x, y) = (1 - x)^2 + 100 (y - x^2)^2, minimum 0 at (1, 1), the start (-1.2, 1) by
  default (Rosenbrock 1960's own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

QUADRATIC_ROTATION_SEED = 20240302
QUADRATIC_DEFAULTS = {"dim": 2, "condition": 100.0}
ROSENBROCK_DEFAULTS = {"start_x": -1.2, "start_y": 1.0}
ROSENBROCK_A = 1.0
ROSENBROCK_B = 100.0


@dataclass(frozen=True)
class SurfaceSpec:
    """A 2-D test function to draw trajectories over (the study report's `Surface`)."""

    f: Callable[[np.ndarray, np.ndarray], np.ndarray]  # vectorized f(X, Y)
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    minimum: tuple[float, float] | None = None


@cache
def quadratic_hessian(dim: int, condition: float) -> np.ndarray:
    """H = Q diag(geomspace(1, condition, dim)) Q^T, float64, symmetric positive definite."""
    eigenvalues = np.geomspace(1.0, condition, dim) if dim > 1 else np.ones(1)
    q, r = np.linalg.qr(np.random.default_rng(QUADRATIC_ROTATION_SEED).standard_normal((dim, dim)))
    q = q * np.sign(np.diag(r))  # QR's signs are a LAPACK convention: fix them
    hessian = (q * eigenvalues) @ q.T
    hessian = (hessian + hessian.T) / 2  # exactly symmetric
    hessian.setflags(write=False)
    return hessian


def quadratic_start(dim: int) -> np.ndarray:
    return np.ones(dim)


def quadratic_value(points: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """0.5 w^T H w for each row w of `points` (..., dim)."""
    return 0.5 * np.einsum("...i,ij,...j->...", points, hessian, points)


def rosenbrock_value(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (ROSENBROCK_A - x) ** 2 + ROSENBROCK_B * (y - x**2) ** 2


def surface_for(workload_name: str, params: Mapping[str, Any]) -> SurfaceSpec | None:
    """The surface of `rosenbrock`, or of a 2-D `quadratic`; None for any other workload.

    `params` are the workload params as a spec gives them (missing ones take their defaults).
    """
    if workload_name == "rosenbrock":
        start = (
            float(params.get("start_x", ROSENBROCK_DEFAULTS["start_x"])),
            float(params.get("start_y", ROSENBROCK_DEFAULTS["start_y"])),
        )
        return SurfaceSpec(
            f=rosenbrock_value,
            xlim=(min(-2.0, start[0] - 0.5), max(2.0, start[0] + 0.5)),
            ylim=(min(-1.0, start[1] - 0.5), max(3.0, start[1] + 0.5)),
            minimum=(ROSENBROCK_A, ROSENBROCK_A**2),
        )
    if workload_name == "quadratic":
        dim = int(params.get("dim", QUADRATIC_DEFAULTS["dim"]))
        if dim != 2:
            return None
        hessian = quadratic_hessian(2, float(params.get("condition", QUADRATIC_DEFAULTS["condition"])))

        def f(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return quadratic_value(np.stack([np.asarray(x), np.asarray(y)], axis=-1), hessian)

        return SurfaceSpec(f=f, xlim=(-1.5, 1.5), ylim=(-1.5, 1.5), minimum=(0.0, 0.0))
    return None
