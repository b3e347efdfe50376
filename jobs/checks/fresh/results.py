"""What a fresh run writes, in one framework-neutral form, and the comparisons written once.

A run is a set of named numpy arrays (`model/...` for the model's parameters,
`optimizer/...` for the optimizer's state) in one `.npz` file, with readable labels for
the messages and, where the framework saw one, a problem it could not express as arrays
(a variable a strategy did not mirror). Every verdict compares these, so "bitwise equal"
and "within rounding" read the same for torch, Keras and legacy tf.keras.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.checks.fresh.plan import ABSOLUTE_FLOOR, RELATIVE_TOLERANCE

Arrays = dict[str, np.ndarray]
MODEL, OPTIMIZER = "model", "optimizer"  # the first part of every array's name
_NOTES = "__notes__"


@dataclass
class Run:
    arrays: Arrays
    labels: dict[str, str] = field(default_factory=dict)
    problem: str = ""

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def optimizer_keys(self) -> list[str]:
        return [key for key in self.arrays if key.startswith(f"{OPTIMIZER}/")]


def save_run(
    path: Path | str,
    arrays: Mapping[str, np.ndarray],
    *,
    labels: Mapping[str, str] | None = None,
    problem: str = "",
) -> None:
    notes = json.dumps({"labels": dict(labels or {}), "problem": problem, "order": list(arrays)})
    named: dict[str, Any] = {**arrays, _NOTES: np.array(notes)}
    np.savez(path, **named)


def load_run(path: Path | str) -> Run:
    with np.load(path, allow_pickle=False) as data:
        notes = json.loads(str(data[_NOTES]))
        arrays = {key: data[key] for key in notes["order"]}  # in the order written
    return Run(arrays, notes["labels"], notes["problem"])


def first_difference(expected: Run, actual: Run) -> str:
    """The first place two runs differ ('' when bitwise equal, NaN equal to NaN)."""
    layout = layout_difference(expected, actual)
    if layout:
        return layout
    for key, a, b in _pairs(expected, actual):
        if a.dtype != b.dtype:
            return f"{expected.label(key)}: {b.dtype} instead of {a.dtype}"
        if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
            return f"{expected.label(key)}: max abs difference {_max_abs(a, b):.3g}"
    return ""


def layout_difference(expected: Run, actual: Run) -> str:
    """What the runs do not share in names and shapes ('' when the same)."""
    missing = [expected.label(k) for k in expected.arrays if k not in actual.arrays]
    extra = [actual.label(k) for k in actual.arrays if k not in expected.arrays]
    if missing or extra:
        return f"{_some(missing)} missing, {_some(extra)} unexpected"
    for key, a, b in _pairs(expected, actual):
        if a.shape != b.shape:
            return f"{expected.label(key)} has shape {list(b.shape)} instead of {list(a.shape)}"
    return ""


def beyond_tolerance(reference: Run, other: Run, initial: Run) -> str:
    """The first array of `other` farther from `reference` than rounding explains ('' if none).

    Parameters are judged against how far they moved from `initial`, optimizer state against
    its own size, and what is not floating point (step counts) must be equal.
    """
    for key, want, got in _pairs(reference, other):
        if want.dtype.kind not in "fc":
            if not np.array_equal(want, got):
                return f"{reference.label(key)}: {got.tolist()} instead of {want.tolist()}"
            continue
        diff = _max_abs(want, got)
        if not diff <= _allowed(want, initial.arrays.get(key) if key.startswith(f"{MODEL}/") else None):
            moved = ""
            if key in initial.arrays:
                moved = f" (it moved {_max_abs(want, initial.arrays[key]):.3g})"
            return f"{reference.label(key)}: max abs difference {diff:.3g}{moved}"
    return ""


def max_abs_difference(a: Run, b: Run) -> float:
    """The largest absolute difference over the numeric arrays the runs share (inf: shapes differ)."""
    return max((_max_abs(x, y) for _, x, y in _pairs(a, b)), default=0.0)


def largest_difference(a: Run, b: Run) -> tuple[str, float]:
    """Where two runs differ most (a label; '' where they do not) and by how much: the figure a
    failure shows, named, as the first difference it describes may be another array's."""
    where, largest = "", 0.0
    for key, x, y in _pairs(a, b):
        difference = _max_abs(x, y)
        if difference > largest:
            where, largest = a.label(key), difference
    return where, largest


def _allowed(reference: np.ndarray, start: np.ndarray | None) -> float:
    scale = float(np.max(np.abs(reference), initial=0.0))
    if start is None:  # optimizer state: relative to its own magnitude
        return RELATIVE_TOLERANCE * scale + ABSOLUTE_FLOOR
    movement = _max_abs(reference, start)
    return RELATIVE_TOLERANCE * movement + ABSOLUTE_FLOOR * (1 + scale)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.dtype.kind not in "biufc" or b.dtype.kind not in "biufc" or not a.size:
        return 0.0
    wide = "complex128" if "c" in (a.dtype.kind, b.dtype.kind) else "float64"
    x, y = a.astype(wide), b.astype(wide)
    # The same infinity or NaN on both sides is no difference (it had been inf, and state kept at +inf
    # by design passed only because its tolerance was infinite too); NaN against a number is inf.
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    with np.errstate(invalid="ignore"):  # inf - inf, where `same` says 0
        diff = np.where(same, 0.0, np.abs(x - y))
    return float(np.nan_to_num(diff, nan=math.inf).max())


def _pairs(a: Run, b: Run) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    for key, value in a.arrays.items():
        if key in b.arrays:
            yield key, value, b.arrays[key]


def _some(labels: list[str]) -> str:
    return ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "") or "none"
