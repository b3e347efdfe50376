"""The registry and the interface: light to import, described with their task, checked inputs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jobs.workloads import WORKLOADS, Dataset, describe_workloads, get_workload
from tests.conftest import ROOT

HEAVY = ("torch", "tensorflow", "keras", "tf_keras", "sklearn")


@pytest.mark.parametrize("module", ["jobs.workloads", "jobs.workloads.surfaces"])
def test_importing_workloads_loads_no_framework(module: str) -> None:
    """Nor does the surfaces module the study report (the service) imports."""
    code = f"import sys, {module}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == ""


def test_registry_holds_the_workloads_with_their_tasks() -> None:
    assert {name: workload.task for name, workload in WORKLOADS.items()} == {
        "digits_mlp": "classification",
        "digits_cnn": "classification",
        "embedding_mf": "regression",
        "quadratic": "objective",
        "rosenbrock": "objective",
        "char_lm": "classification",
        "npz": "from_data",
    }
    assert all(WORKLOADS[name].name == name for name in WORKLOADS)


def test_describe_includes_task_and_train_size() -> None:
    described = {entry["name"]: entry for entry in describe_workloads()}
    assert described["digits_cnn"]["task"] == "classification"
    assert described["embedding_mf"]["task"] == "regression"
    assert described["digits_mlp"]["train_size"] == described["digits_cnn"]["train_size"] == 1437
    assert described["embedding_mf"]["train_size"] == 18_000
    assert [p["name"] for p in described["digits_cnn"]["params"]] == ["filters"]
    assert [p["name"] for p in described["embedding_mf"]["params"]] == ["dim"]


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'mnist'.*digits_mlp, digits_cnn, embedding_mf"):
        get_workload("mnist")


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("digits_mlp", {"hidden": 0}, "hidden must be an integer in \\[1, 4096\\]; received 0"),
        ("digits_cnn", {"filters": 257}, "filters must be an integer in \\[1, 256\\]; received 257"),
        ("embedding_mf", {"dim": 0}, "dim must be an integer in \\[1, 256\\]; received 0"),
        ("embedding_mf", {"width": 3}, "width"),
        ("char_lm", {"width": 30, "heads": 4}, "width must be a multiple of heads \\(4\\); received 30"),
        ("quadratic", {"dim": 4097}, "dim must be an integer in \\[1, 4096\\]; received 4097"),
        ("npz", {}, "requires hyperparameter 'path'"),
    ],
)
def test_params_are_checked(name: str, params: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_workload(name).check_params(params)


def _dataset(**changes: object) -> Dataset:
    fields: dict[str, object] = {
        "x_train": np.zeros((4, 3), np.float32),
        "y_train": np.zeros(4, np.int64),
        "x_val": np.zeros((2, 3), np.float32),
        "y_val": np.zeros(2, np.int64),
        "n_classes": 2,
    }
    return Dataset(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"y_train": np.zeros(3, np.int64)}, "x_train has 4 rows but y_train has 3"),
        ({"y_val": np.zeros(2, np.float32)}, "y_val must be int64 when n_classes=2; received float32"),
        ({"n_classes": 0}, "y_train must be float32 when n_classes=0; received int64"),
        ({"x_val": np.zeros((2, 4), np.float32)}, "x_train rows have shape \\(3,\\) but x_val rows \\(4,\\)"),
    ],
)
def test_dataset_rejects_inconsistent_arrays(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _dataset(**changes)


def test_regression_dataset_accepts_float32_targets() -> None:
    dataset = _dataset(y_train=np.zeros(4, np.float32), y_val=np.zeros(2, np.float32), n_classes=0)
    assert dataset.train_size == 4
