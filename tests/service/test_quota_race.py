"""Queue quotas hold exactly when submissions race: two API servers on one store, many clients at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from service import store
from service.app import create_app
from service.db import make_engine, migrate, session_factory
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
