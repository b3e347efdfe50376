"""A study's report: PNG plots (matplotlib Figure objects, Agg) and one self-contained HTML page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.studies.summary import StudyRun, StudySummary


@dataclass(frozen=True)
class Surface:
    """A 2-D test function to draw trajectories over."""

    f: Callable[[np.ndarray, np.ndarray], np.ndarray]  # vectorized f(X, Y)
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    minimum: tuple[float, float] | None = None


@dataclass(frozen=True)
class Report:
    html: str  # self-contained: every image inline as data:image/png;base64
    images: dict[str, bytes]  # file name -> PNG bytes (also logged as parent-run artifacts)


def render_report(
    summary: StudySummary,
    runs: Sequence[StudyRun],
    *,
    title: str,
    surface: Surface | None = None,
    mlflow_url: str | None = None,
) -> Report:
    raise NotImplementedError
