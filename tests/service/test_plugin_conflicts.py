"""A plugin file dropped in never changes what a queued job trains (a probe of the running service).

A second file with a class of the same name had taken the name (the file that sorted first won, and
the one in use was listed as the error), and jobs accepted against the old class ran the new one:
failing on its arguments, or training a different optimizer without a word. Now a clash registers
neither class, the service records in each job the plugin class it validated the job against, and
the job fails at its start, naming both, when the name now runs another class or that file changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.optimizer_source import OptimizerSourceChanged, loaded_entry
from jobs.result import JobResult, OptimizerSource
from jobs.run import record_sources
from jobs.spec import JobSpec
from optimizers.registry import PLUGIN_SOURCE, load_registry
from service.app import create_app
from service.settings import Settings
from service.worker import Supervision, Worker
from tests.conftest import ROOT
from tests.service.test_plugin_reload import published, running_worker, wait_for

__all__ = ["running_worker"]  # the fixture, shared with test_plugin_reload

MOMENTUM = (ROOT / "examples" / "plugins" / "sign_momentum.py").read_text()
# The colleague's file: a class of the same name that takes only `lr`.
SAME_NAME = """
import torch


class ProbeMomentum(torch.optim.SGD):
    def __init__(self, params, lr: float = 5.0):
        super().__init__(params, lr=lr)
"""
PROBE = MOMENTUM.replace("class SignMomentum(", "class ProbeMomentum(")


def submitted_spec(settings: Settings, optimizer: dict[str, Any]) -> dict[str, Any]:
    """The spec the API stored for a job of `optimizer` (validated against the published catalogue)."""
    body = {"workload": {"name": "digits_mlp"}, "optimizer": optimizer, "steps": 5, "device": "cpu"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answer = client.post("/jobs", json=body)
        assert answer.status_code == 201, answer.text
        stored: dict[str, Any] = client.get(f"/jobs/{answer.json()['id']}").json()["spec"]
    return stored


def study_job_spec(settings: Settings, optimizer: dict[str, Any]) -> dict[str, Any]:
    """The spec the API stored for the first job of a study of `optimizer`."""
    body = {"name": "probe", "workload": {"name": "digits_mlp"}, "optimizers": [optimizer], "steps": 5}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answer = client.post("/studies", json=body)
        assert answer.status_code == 201, answer.text
        job_id = answer.json()["jobs"][0]["job_id"]
        stored: dict[str, Any] = client.get(f"/jobs/{job_id}").json()["spec"]
    return stored


def test_a_job_records_the_class_it_was_validated_against_and_a_second_file_takes_no_name(
    running_worker: tuple[Path, Worker], settings: Settings, sessions: sessionmaker[Session]
) -> None:
    folder, worker = running_worker
    mine = folder / "probe_torch.py"
    mine.write_text(PROBE)
    wait_for(lambda: "probe_momentum" in published(sessions).optimizer_names())

    spec = submitted_spec(settings, {"name": "probe_momentum", "params": {"lr": 0.01, "beta": 0.8}})
    source = spec["optimizer"]["source"]
    assert source["source"] == f"{PLUGIN_SOURCE}{mine}"
    assert source["class_name"] == "ProbeMomentum"
    assert len(source["sha256"]) == 64
    assert submitted_spec(settings, {"name": "sgd", "params": {"lr": 0.1}})["optimizer"]["source"] is None
    in_a_study = study_job_spec(settings, {"name": "probe_momentum", "params": {"lr": [0.01]}})
    assert in_a_study["optimizer"]["source"] == source

    # A colleague's file whose name sorts first claims the name too: neither registers it now.
    theirs = folder / "a_dup.py"
    theirs.write_text(SAME_NAME)
    wait_for(lambda: "probe_momentum" not in published(sessions).optimizer_names())
    errors = {error["source"]: error["error"] for error in published(sessions).errors}
    assert set(errors) >= {str(mine), str(theirs)}
    for said in (errors[str(mine)], errors[str(theirs)]):
        assert "optimizer name 'probe_momentum' (torch style) is claimed by 2 plugin classes" in said
        assert (
            "probe_torch.py:ProbeMomentum (line " in said
            and f"a_dup.py:ProbeMomentum (line 5) in {theirs}" in said
        )
        assert "rename all but one" in said

    # The queued job is still told the file it was validated against, not what the catalogue says now.
    stored = JobSpec.model_validate(spec)
    with sessions() as session:
        from service import store

        job = store.create_job(session=session, spec=stored)
    told = Supervision(worker, job, [], claimed_at=0.0).arguments(Path("spec.json"), "http://mlflow")
    assert told[told.index("--plugin-file") :] == ["--plugin-file", str(mine)]


@pytest.fixture
def clashing_folder(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A folder whose probe_torch.py the job was validated against, and then only a_dup.py holds
    the name (the user renamed their own class away)."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    mine = folder / "probe_torch.py"
    mine.write_text(PROBE)
    yield folder, mine, folder / "a_dup.py"


def recorded(path: Path, class_name: str) -> OptimizerSource:
    registry = load_registry(
        [str(path.parent)], ("torch",), wanted=["probe_momentum"], plugin_files=[str(path)]
    )
    entry = registry.get("probe_momentum")
    assert entry.cls.__qualname__ == class_name
    return OptimizerSource(source=entry.source, class_name=class_name, sha256=entry.sha256)


def test_a_job_whose_optimizer_now_comes_from_another_file_fails_at_its_start_naming_both(
    clashing_folder: tuple[Path, Path, Path],
) -> None:
    folder, mine, theirs = clashing_folder
    source = recorded(mine, "ProbeMomentum")
    mine.write_text(PROBE.replace("class ProbeMomentum(", "class RenamedMomentum("))
    theirs.write_text(SAME_NAME)
    spec = {
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": "probe_momentum", "params": {"lr": 0.01}, "source": source.model_dump()},
        "steps": 3,
        "batch_size": 16,
        "device": "cpu",
    }
    spec_path = folder.parent / "spec.json"
    spec_path.write_text(json.dumps(spec))
    workdir = folder.parent / "job"
    environment = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.run",
            str(spec_path),
            "--workdir",
            str(workdir),
            "--plugin-file",
            str(mine),
        ],
        cwd=ROOT,
        env={**environment, "OPTLAB_PLUGIN_DIRS": str(folder), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads((workdir / "result.json").read_text())
    assert completed.returncode == 1 and result["status"] == "failed", completed.stderr[-2000:]
    assert result["error"]["type"] == "OptimizerSourceChanged"
    message = result["error"]["message"]
    assert message.startswith(
        f"optimizer 'probe_momentum' now comes from a_dup.py:ProbeMomentum (plugin {theirs}); "
    )
    assert f"the job was submitted for probe_torch.py:ProbeMomentum (plugin {mine})" in message
    assert "resubmit the job" in message
    assert result.get("steps_completed") in (None, 0)  # never half-run


def test_an_edited_plugin_file_or_a_name_no_file_registers_fails_the_job_saying_so(
    clashing_folder: tuple[Path, Path, Path],
) -> None:
    folder, mine, theirs = clashing_folder
    source = recorded(mine, "ProbeMomentum")
    choice = JobSpec.model_validate(
        {
            "workload": {"name": "digits_mlp"},
            "optimizer": {"name": "probe_momentum", "source": source.model_dump()},
            "steps": 3,
        }
    ).optimizer
    registry = load_registry([str(folder)], ("torch",))
    assert loaded_entry(registry, choice, "torch").source == source.source  # unchanged: it runs

    mine.write_text(PROBE.replace("weight_decay", "decay_of_weights"))
    with pytest.raises(OptimizerSourceChanged) as edited:
        loaded_entry(load_registry([str(folder)], ("torch",)), choice, "torch")
    assert str(edited.value).startswith(
        "optimizer 'probe_momentum' (probe_torch.py:ProbeMomentum) was edited after the job was submitted: "
        "its file's sha256 is "
    )
    assert f"{source.sha256[:12]}… then" in str(edited.value)

    mine.write_text(PROBE)
    theirs.write_text(SAME_NAME)  # both claim it: neither is registered
    with pytest.raises(OptimizerSourceChanged) as clash:
        loaded_entry(load_registry([str(folder)], ("torch",)), choice, "torch")
    said = str(clash.value)
    assert said.startswith(
        f"optimizer 'probe_momentum' was submitted for probe_torch.py:ProbeMomentum (plugin {mine}), "
        "which does not register it now: unknown optimizer 'probe_momentum'"
    )
    assert "is claimed by 2 plugin classes" in said


class TaggedRun:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def test_the_result_and_the_runs_tags_say_which_class_trained() -> None:
    source = OptimizerSource(source="plugin /srv/plugins/mine.py", class_name="Mine", sha256="ab" * 32)
    base = OptimizerSource(source="builtin:optimizers.torch.sgd", class_name="SGD")
    run = TaggedRun()
    result = JobResult(job_id="1", attempt=1, workdir="/tmp/w", status="failed")
    recorded_result = record_sources({"optimizer": source, "base": base}, result, run)
    assert recorded_result.to_json()["optimizer_source"] == {
        "source": "plugin /srv/plugins/mine.py",
        "class_name": "Mine",
        "sha256": "ab" * 32,
    }
    assert recorded_result.to_json()["base_source"]["class_name"] == "SGD"
    assert run.tags == {
        "optimizer_source": "plugin /srv/plugins/mine.py",
        "optimizer_class": "Mine",
        "optimizer_sha256": "ab" * 32,
        "base_source": "builtin:optimizers.torch.sgd",
        "base_class": "SGD",
    }
    assert source.where() == "mine.py:Mine"
    assert PLUGIN_SOURCE == "plugin "  # jobs.result's own copy of the prefix


def test_the_same_file_in_another_hosts_plugin_folder_is_the_class_validated(tmp_path: Path) -> None:
    """A GPU host may mount its plugin folder at another path: the same class in a file of the same
    text is the one the job was validated against (it had failed as "now comes from ..."); another
    text there still fails, naming both files."""
    here, there = tmp_path / "api_host", tmp_path / "gpu_host"
    for folder in (here, there):
        folder.mkdir()
        (folder / "probe_torch.py").write_text(PROBE)
    source = recorded(here / "probe_torch.py", "ProbeMomentum")
    choice = JobSpec.model_validate(
        {
            "workload": {"name": "digits_mlp"},
            "optimizer": {"name": "probe_momentum", "source": source.model_dump()},
            "steps": 3,
        }
    ).optimizer
    entry = loaded_entry(load_registry([str(there)], ("torch",)), choice, "torch")
    assert entry.source == f"plugin {there / 'probe_torch.py'}"
    (there / "probe_torch.py").write_text(PROBE.replace("weight_decay", "decay_of_weights"))
    with pytest.raises(
        OptimizerSourceChanged, match=r"now comes from probe_torch\.py:ProbeMomentum .*gpu_host"
    ):
        loaded_entry(load_registry([str(there)], ("torch",)), choice, "torch")
