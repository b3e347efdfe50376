from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.app import create_app
from service.db import make_engine, migrate, session_factory
from service.settings import Settings


@pytest.fixture(autouse=True)
def ordinary_test_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`optlab api`/`worker`/`serve` called in-process (cli.main) make their process private: not
    the test runner's, which a debugger or a core dump must still reach. Real processes (e2e, and
    test_secrets' child) run the real thing."""
    monkeypatch.setattr("service.secrets.keep_process_private", lambda: None)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # TestClient sends `Host: testserver`; the default trusted hosts are the localhost names.
    return Settings(data_dir=tmp_path, max_steps=10_000, trusted_hosts="localhost,testserver")


@pytest.fixture
def sessions(settings: Settings) -> sessionmaker[Session]:
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    return session_factory(engine)


@pytest.fixture
def client(
    settings: Settings, sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> Iterator[TestClient]:
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue_data)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client
