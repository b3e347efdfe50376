"""Plugins without restarts: a plugin file added, changed or broken in a plugin folder reaches the
published catalogue while the worker runs, within seconds, with its load errors listed."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from jobs.spec import Catalogue, JobSpec
from service import store
from service import worker as worker_module
from service.plugins import PLUGIN_DIRS_ENV, PluginWatcher
from service.settings import Settings
from service.worker import Supervision, Worker
from tests.conftest import ROOT

PLUGIN = (ROOT / "examples" / "plugins" / "sign_momentum.py").read_text()


def test_a_new_file_is_reported_once_it_has_settled(tmp_path: Path) -> None:
    watcher = PluginWatcher([tmp_path, tmp_path / "missing"])
    assert watcher.poll() is None
    (tmp_path / "notes.txt").write_text("not a plugin")
    assert watcher.poll() is None and watcher.poll() is None  # only *.py files count
    (tmp_path / "mine.py").write_text("x = 1\n")
    assert watcher.poll() is None  # just written: it may still be growing
    settled = watcher.poll()
    assert settled is not None and settled[0][0].endswith("mine.py")
    assert watcher.poll() is not None  # until the worker says it published this
    watcher.published = settled
    assert watcher.poll() is None


def test_an_edit_or_a_removal_is_a_change(tmp_path: Path) -> None:
    plugin = tmp_path / "mine.py"
    plugin.write_text("x = 1\n")
    watcher = PluginWatcher([tmp_path])
    plugin.write_text("x = 22\n")
    watcher.poll()
    edited = watcher.poll()
    assert edited is not None
    watcher.published = edited
    plugin.unlink()
    watcher.poll()
    assert watcher.poll() == ()


@pytest.fixture
def running_worker(
    tmp_path: Path,
    settings: Settings,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    catalogue_data: dict[str, Any],
) -> Iterator[tuple[Path, Worker]]:
    """A worker that published its catalogue and watches `plugins/` (as `optlab worker` does).

    Its first catalogue, from an empty plugin folder, is the one `python -m jobs.catalogue` printed
    for the whole test run (`catalogue_data`: no plugin folders, the same output), not a fourth
    production of its own (it imports torch and TensorFlow twice); each one it publishes again
    after a change below is produced afresh, as `optlab worker` does."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    monkeypatch.setenv(PLUGIN_DIRS_ENV, str(folder))
    worker = Worker(settings.model_copy(update={"plugin_poll_s": 0.2}), sessions, worker_id="watching")
    with pytest.MonkeyPatch.context() as first:
        first.setattr(worker_module, "produce_catalogue", lambda _settings: copy.deepcopy(catalogue_data))
        worker.publish_catalogue()
    watching = threading.Thread(target=worker.refresh_catalogue_forever, daemon=True)
    watching.start()
    yield folder, worker
    worker.stopping.set()
    watching.join(timeout=30)


def published(sessions: sessionmaker[Session]) -> Catalogue:
    with sessions() as session:
        latest = store.latest_catalogue(session=session, within_s=30)
    assert latest is not None
    return latest.catalogue


def wait_for(condition: Callable[[], bool], timeout_s: float = 120.0) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "the catalogue never changed"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_running_worker_publishes_added_and_broken_plugins(
    running_worker: tuple[Path, Worker], sessions: sessionmaker[Session]
) -> None:
    folder, worker = running_worker
    assert "hot_momentum" not in published(sessions).optimizer_names()
    (folder / "hot.py").write_text(PLUGIN.replace("class SignMomentum(", "class HotMomentum("))
    wait_for(lambda: "hot_momentum" in published(sessions).optimizer_names())
    # Its jobs are told the file it is in, and read that one, not every plugin file (load_registry).
    told = job_arguments(worker, sessions, {"name": "hot_momentum", "params": {"lr": 0.1}})
    assert told[told.index("--plugin-file") :] == ["--plugin-file", str(folder / "hot.py")]
    assert "--plugin-file" not in job_arguments(worker, sessions, {"name": "sgd", "params": {"lr": 0.1}})

    (folder / "broken.py").write_text("import torch\nraise RuntimeError('half-written plugin')\n")
    wait_for(lambda: any("broken.py" in e["source"] for e in published(sessions).errors))
    catalogue = published(sessions)
    assert "half-written plugin" in next(e["error"] for e in catalogue.errors if "broken.py" in e["source"])
    assert "hot_momentum" in catalogue.optimizer_names()  # the good plugin stays

    (folder / "hot.py").unlink()
    wait_for(lambda: "hot_momentum" not in published(sessions).optimizer_names())


def job_arguments(worker: Worker, sessions: sessionmaker[Session], optimizer: dict[str, Any]) -> list[str]:
    """The `jobs.run` arguments the worker would give a job of `optimizer`."""
    spec = JobSpec.model_validate({"workload": {"name": "digits_mlp"}, "optimizer": optimizer, "steps": 5})
    with sessions() as session:
        job = store.create_job(session=session, spec=spec)
    return Supervision(worker, job, [], claimed_at=0.0).arguments(Path("spec.json"), "http://mlflow")
