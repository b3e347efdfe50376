"""Workload params through the API: ranges and names checked at submission, data files only under the
configured data roots (OPTLAB_DATA_ROOTS), the catalogue describing params and default targets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from jobs.spec import Catalogue, JobSpec, catalogue_errors
from service.settings import Settings


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    np.savez(root / "mine.npz", X=np.zeros((10, 2)), y=np.zeros(10, np.int64))
    (root / "notes.txt").write_text("not arrays")
    outside = tmp_path / "outside.npz"
    np.savez(outside, X=np.zeros((10, 2)), y=np.zeros(10, np.int64))
    (root / "link.npz").symlink_to(outside)  # inside by name, outside once resolved
    return root


@pytest.fixture
def settings(tmp_path: Path, data_root: Path) -> Settings:
    """The service conftest's settings, with a data root (overrides its `settings` for `client`)."""
    return Settings(
        data_dir=tmp_path, max_steps=10_000, trusted_hosts="localhost,testserver", data_roots=str(data_root)
    )


def job(workload: dict[str, Any], framework: str = "torch") -> dict[str, Any]:
    return {
        "framework": framework,
        "workload": workload,
        "optimizer": {"name": "adamw", "params": {"lr": 0.001}},
        "steps": 10,
        "batch_size": 4,
    }


REFUSED = [
    ({"name": "npz", "params": {"path": "/etc/passwd"}}, "path", "must lie under a data root"),
    ({"name": "npz", "params": {"path": "../outside.npz"}}, "path", "must lie under a data root"),
    ({"name": "npz", "params": {"path": "sub/../../outside.npz"}}, "path", "must lie under a data root"),
    ({"name": "npz", "params": {"path": "link.npz"}}, "path", "must lie under a data root"),
    ({"name": "npz", "params": {"path": "missing.npz"}}, "path", "no such file under the data roots"),
    ({"name": "npz", "params": {"path": 3}}, "path", "must be a file path"),
    # Not offered "" for none, which it then refuses (char_lm's optional text_file is offered it).
    (
        {"name": "npz", "params": {}},
        "path",
        "requires parameter 'path' (a file path (at most 1000 characters) under a data root): it has no "
        "default",
    ),
    (
        {"name": "char_lm", "params": {"text_file": "../outside.npz"}},
        "text_file",
        "must lie under a data root",
    ),
    ({"name": "npz", "params": {"path": ""}}, "path", "workload 'npz' needs a data file"),
    # The job's own rule, now the API's too: accepted, it failed when the job read the file.
    ({"name": "npz", "params": {"path": "notes.txt"}}, "path", "must name a .npz file; received 'notes.txt'"),
    (
        {"name": "char_lm", "params": {"layers": 0}},
        "layers",
        "layers must be an integer in [1, 48]; received 0",
    ),
    (
        {"name": "char_lm", "params": {"width": 30}},
        "width",
        "width must be a multiple of heads (4); received 30",
    ),
    ({"name": "char_lm", "params": {"depth": 2}}, "depth", "has no parameter 'depth'; accepted: layers"),
    (
        {"name": "quadratic", "params": {"condition": 0.5}},
        "condition",
        "condition must be a number in [1, 1e+08]",
    ),
    (
        {"name": "rosenbrock", "params": {"start_x": 9}},
        "start_x",
        "start_x must be a number in [-3, 3]; received 9",
    ),
]


@pytest.mark.parametrize(("workload", "param", "expected"), REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_bad_workload_params_get_422_naming_the_param(
    client: TestClient, workload: dict[str, Any], param: str, expected: str
) -> None:
    response = client.post("/jobs", json=job(workload))
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "workload", "params", param]
    assert expected in error["msg"], error["msg"]
    if "path" in workload.get("params", {}) and isinstance(workload["params"]["path"], str):
        assert repr(workload["params"]["path"]) in error["msg"]  # the value received
    assert client.get("/jobs").json()["total"] == 0, "a rejected request stored something"


@pytest.mark.parametrize("path", ["mine.npz", "{root}/mine.npz", "{root}/./sub/../mine.npz"])
def test_a_file_under_a_root_is_accepted(client: TestClient, data_root: Path, path: str) -> None:
    (data_root / "sub").mkdir(exist_ok=True)
    response = client.post(
        "/jobs", json=job({"name": "npz", "params": {"path": path.format(root=data_root)}})
    )
    assert response.status_code == 201, response.text


def test_without_data_roots_no_file_is_accepted(catalogue_data: dict[str, Any], data_root: Path) -> None:
    spec = JobSpec.model_validate(job({"name": "npz", "params": {"path": str(data_root / "mine.npz")}}))
    (error,) = catalogue_errors(spec, Catalogue.model_validate(catalogue_data), max_steps=100)
    assert error.loc == ["body", "workload", "params", "path"]
    assert "no data roots are configured" in error.msg and "OPTLAB_DATA_ROOTS" in error.msg


def test_the_catalogue_describes_params_and_default_targets(client: TestClient) -> None:
    workloads = {item["name"]: item for item in client.get("/workloads").json()["items"]}
    assert {"char_lm", "quadratic", "rosenbrock", "npz", "digits_mlp"} <= set(workloads)
    for item in workloads.values():
        target = item["default_target"]
        assert target["mode"] in ("min", "max") and target["metric"].startswith("val/"), item["name"]
        assert isinstance(target["value"], float)
    layers = {p["name"]: p for p in workloads["char_lm"]["params"]}["layers"]
    assert (layers["type"], layers["default"], layers["low"], layers["high"]) == ("int", 2, 1, 48)
    assert workloads["npz"]["train_size"] is None  # it depends on the file
    assert workloads["rosenbrock"]["task"] == "objective"


def test_char_lm_batch_size_is_held_to_its_rows_at_the_default_data_only(client: TestClient) -> None:
    """The catalogue's training-set size is char_lm's at its default context and corpus: context 8
    makes eight times the rows, so a batch the default refuses is fine there (it was refused), and
    a spec that sets the data is checked by the job, which reads it."""
    described = {item["name"]: item for item in client.get("/workloads").json()["items"]}["char_lm"]
    rows = described["train_size"]
    assert described["data_params"] == ["context", "corpus_chars", "text_file"]
    too_many = {**job({"name": "char_lm"}), "batch_size": rows + 1}
    refused = client.post("/jobs", json=too_many)
    assert refused.status_code == 422 and f"at most the training set size {rows}" in refused.text
    eight_times = {**too_many, "workload": {"name": "char_lm", "params": {"context": 8}}}
    assert client.post("/jobs", json=eight_times).status_code == 201
    at_the_default = {**too_many, "workload": {"name": "char_lm", "params": {"context": 64}}}
    assert client.post("/jobs", json=at_the_default).status_code == 422
