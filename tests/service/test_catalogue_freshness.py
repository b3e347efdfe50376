"""Submissions validate against the API's cached catalogue without asking the store first, and
still answer as the latest published catalogue would (service.deps.submit_validated)."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.db import make_engine, migrate, session_factory, submission_lock
from service.deps import CATALOGUE_RETRIES
from service.models import Job
from service.quotas import SubmissionQueue
from tests.postgres import throwaway_database

LION: dict[str, Any] = {
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "lion", "params": {"lr": 0.0003}},
    "steps": 10,
}
ADAM: dict[str, Any] = {**LION, "optimizer": {"name": "adam"}}
LION_CHECK: dict[str, Any] = {"framework": "torch", "optimizer": {"name": "lion"}}


def without_torch_lion(catalogue: dict[str, Any]) -> dict[str, Any]:
    kept = [o for o in catalogue["optimizers"] if (o["name"], o["style"]) != ("lion", "torch")]
    return {**catalogue, "optimizers": kept}


def publish(sessions: sessionmaker[Session], worker_id: str, catalogue: dict[str, Any]) -> None:
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id=worker_id, catalogue=catalogue)


def jobs_stored(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


@pytest.mark.parametrize(("path", "spec"), [("/jobs", LION), ("/checks", LION_CHECK)])
def test_a_spec_the_cached_catalogue_accepts_is_refused_if_the_latest_refuses_it(
    client: TestClient,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    path: str,
    spec: dict[str, Any],
) -> None:
    assert client.post(path, json=spec).status_code == 201  # the cache now holds lion
    publish(sessions, "newer-worker", without_torch_lion(catalogue_data))
    stored = jobs_stored(sessions)

    refused = client.post(path, json=spec)

    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"][:2] == ["body", "optimizer"]
    assert "lion" in refused.text
    assert jobs_stored(sessions) == stored


@pytest.mark.parametrize(("path", "spec"), [("/jobs", LION), ("/checks", LION_CHECK)])
def test_a_spec_the_cached_catalogue_refuses_is_accepted_if_the_latest_accepts_it(
    client: TestClient,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    path: str,
    spec: dict[str, Any],
) -> None:
    publish(sessions, "newer-worker", without_torch_lion(catalogue_data))
    assert client.post("/jobs", json=ADAM).status_code == 201  # the cache now lacks lion
    assert client.post(path, json=spec).status_code == 422

    publish(sessions, "newest-worker", catalogue_data)
    accepted = client.post(path, json=spec)

    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["spec"]["optimizer"]["name"] == "lion"


def test_a_catalogue_that_changes_at_every_commit_gives_a_503_and_stores_nothing(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.post("/jobs", json=ADAM).status_code == 201
    stored = jobs_stored(sessions)
    asked, batches = 0, 0
    real_version, real_store = store.catalogue_version, SubmissionQueue._store

    def always_newer(*, session: Session, within_s: float) -> store.CatalogueVersion | None:
        nonlocal asked
        asked += 1
        version = real_version(session=session, within_s=within_s)
        assert version is not None
        return tuple((worker, published + timedelta(microseconds=asked)) for worker, published in version)

    def counted(queue: SubmissionQueue, batch: Any) -> None:
        nonlocal batches
        batches += 1
        real_store(queue, batch)

    monkeypatch.setattr(store, "catalogue_version", always_newer)
    monkeypatch.setattr(SubmissionQueue, "_store", counted)

    response = client.post("/jobs", json=ADAM)

    assert response.status_code == 503, response.text
    assert "catalogue changed" in response.json()["detail"]
    assert int(response.headers["Retry-After"]) > 0
    assert batches == CATALOGUE_RETRIES  # validated again each time, then given up
    assert jobs_stored(sessions) == stored


def test_a_submission_with_a_warm_cache_checks_out_one_connection(client: TestClient) -> None:
    """The batch's own: before, a read session per request asked for the catalogue first (on
    PostgreSQL a check-out, its ping and four round trips)."""
    assert client.post("/jobs", json=ADAM).status_code == 201
    engine = client.app.state.sessions.kw["bind"]  # type: ignore[attr-defined]
    checkouts = 0

    def count(*_: Any) -> None:
        nonlocal checkouts
        checkouts += 1

    event.listen(engine, "checkout", count)
    try:
        for _ in range(5):  # one at a time: each is a batch of its own
            assert client.post("/jobs", json=ADAM).status_code == 201
    finally:
        event.remove(engine, "checkout", count)
    assert checkouts == 5


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_catalogue_is_published_only_outside_a_batch_of_submissions(
    kind: str, tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    """A batch checks its catalogue is the latest and commits under the submission lock: a
    publication waits for it, so none lands between the check and the commit."""
    with contextlib.ExitStack() as stack:
        url = f"sqlite:///{tmp_path / 'lock.db'}"
        if kind == "postgresql":
            url = stack.enter_context(throwaway_database("optlab_publish"))
        engine = make_engine(url)
        stack.callback(engine.dispose)
        migrate(engine)
        sessions = session_factory(engine)
        publishing = threading.Thread(target=publish, args=(sessions, "w", catalogue_data))
        with sessions() as batch, submission_lock(batch):
            publishing.start()
            publishing.join(0.5)
            assert publishing.is_alive(), "published while a batch held the submission lock"
            with sessions() as session:
                assert store.catalogue_version(session=session, within_s=30) is None
            batch.commit()
        publishing.join(10)
        assert not publishing.is_alive()
        with sessions() as session:
            assert store.catalogue_version(session=session, within_s=30) is not None
