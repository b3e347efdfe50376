"""Queue quotas hold exactly when submissions race: two API servers on one store, many clients at once."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select

from service import store
from service.app import create_app
from service.db import make_engine, migrate, session_factory
from service.models import Job
from service.settings import Settings
from tests.conftest import free_port
from tests.postgres import throwaway_database
from tests.service.test_api import GOOD

MAX_QUEUED = 4
CLIENTS = 24


def _serve(settings: Settings) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty store of its own: a SQLite file, or a throwaway PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'race.db'}"
        return
    with throwaway_database("optlab_race") as url:
        yield url


@pytest.fixture
def two_apis(
    store_url: str, tmp_path: Path, catalogue_data: dict[str, Any]
) -> Iterator[tuple[str, str, str]]:
    """Two API servers (own engines and connection pools) on one store; and the store's URL."""
    url = store_url
    engine = make_engine(url)
    migrate(engine)
    with session_factory(engine)() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue_data)
    settings = Settings(data_dir=tmp_path, database_url=url, trusted_hosts="127.0.0.1", max_queued=MAX_QUEUED)
    first, second = _serve(settings), _serve(settings)
    yield next(first), next(second), url
    for server in (first, second):
        next(server, None)
    engine.dispose()


def test_racing_submissions_never_exceed_the_queue_cap(two_apis: tuple[str, str, str]) -> None:
    first, second, url = two_apis
    barrier = threading.Barrier(CLIENTS)

    def submit(index: int) -> int:
        with httpx.Client(base_url=first if index % 2 else second, timeout=60) as client:
            barrier.wait()
            return client.post("/jobs", json=GOOD).status_code

    with ThreadPoolExecutor(CLIENTS) as pool:
        codes = list(pool.map(submit, range(CLIENTS)))

    assert sorted(set(codes)) == [201, 429], codes
    assert codes.count(201) == MAX_QUEUED
    engine = make_engine(url)
    with session_factory(engine)() as session:
        assert store.count_queued(session=session) == MAX_QUEUED
    engine.dispose()


def test_racing_retries_of_one_idempotency_key_make_one_job(two_apis: tuple[str, str, str]) -> None:
    """Every client sends the same request under one key, half to each API: all get one job (201),
    every answer but the first says it was replayed, and the store holds that job alone."""
    first, second, url = two_apis
    barrier = threading.Barrier(CLIENTS)

    def submit(index: int) -> httpx.Response:
        with httpx.Client(base_url=first if index % 2 else second, timeout=60) as client:
            barrier.wait()
            return client.post("/jobs", json=GOOD, headers={"Idempotency-Key": "one-key"})

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(submit, range(CLIENTS)))

    assert {answer.status_code for answer in answers} == {201}, [
        a.text for a in answers if a.status_code != 201
    ]
    assert len({answer.json()["id"] for answer in answers}) == 1
    assert sum("idempotent-replayed" not in answer.headers for answer in answers) == 1
    engine = make_engine(url)
    with session_factory(engine)() as session:
        assert store.count_queued(session=session) == 1
    engine.dispose()


# More requests in flight than the API's thread pool (40) and connection pool together: with
# SQLAlchemy's default pool these deadlocked until its 30 s timeout and answered 500.
CROWD = 120


def test_a_crowd_on_a_contended_sqlite_store_gets_no_500_and_every_201_is_stored(
    tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    url = f"sqlite:///{tmp_path / 'crowd.db'}"
    engine = make_engine(url)
    migrate(engine)
    with session_factory(engine)() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue_data)
    settings = Settings(data_dir=tmp_path, database_url=url, trusted_hosts="127.0.0.1")
    done = threading.Event()
    holder = threading.Thread(target=_hold_the_write_lock, args=(tmp_path / "crowd.db", done), daemon=True)
    server = _serve(settings)
    base = next(server)
    barrier = threading.Barrier(CROWD)
    # One client for all threads (each of its own builds an SSL context: seconds in all).
    client = httpx.Client(base_url=base, timeout=120, limits=httpx.Limits(max_connections=CROWD))

    def submit(_: int) -> httpx.Response:
        barrier.wait()
        return client.post("/jobs", json=GOOD)

    holder.start()
    try:
        with ThreadPoolExecutor(CROWD) as pool:
            answers = list(pool.map(submit, range(CROWD)))
    finally:
        client.close()
        done.set()
        holder.join()
        next(server, None)

    codes = sorted(answer.status_code for answer in answers)
    # Past its capacity the API may say so (503 with Retry-After); never an error.
    assert set(codes) <= {201, 503}, [(a.status_code, a.text[:200]) for a in answers if a.status_code != 201]
    assert all(a.headers.get("retry-after") for a in answers if a.status_code == 503)
    accepted = {answer.json()["id"] for answer in answers if answer.status_code == 201}
    assert accepted
    with session_factory(engine)() as session:
        stored = set(session.scalars(select(Job.id)).all())
    engine.dispose()
    assert stored == accepted  # every 201 in the store, and nothing a 503 refused


def _hold_the_write_lock(database: Path, done: threading.Event) -> None:
    """Another writer on the file (as a worker's heartbeats are), holding its write lock in turns."""
    connection = sqlite3.connect(database, timeout=30, isolation_level=None)
    connection.execute("CREATE TABLE IF NOT EXISTS contention (at REAL)")
    while not done.is_set():
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO contention VALUES (julianday('now'))")
        time.sleep(0.02)
        connection.execute("COMMIT")
        time.sleep(0.02)
    connection.close()
