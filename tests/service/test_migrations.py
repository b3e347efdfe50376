"""`optlab serve` starts the API and a worker at once, and both migrate the same fresh
database: every process must succeed and the schema end at the latest revision."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import POSTGRES_ADMIN_URL, ROOT

PROCESSES = 6  # enough to lose the race reliably without the lock (measured: 2 runs in 3)
MIGRATE = "import sys; from service.db import make_engine, migrate; migrate(make_engine(sys.argv[1]))"


def head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from service.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    revision = ScriptDirectory.from_config(config).get_current_head()
    assert revision is not None
    return revision


def migrate_at_once(url: str) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE, url], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(PROCESSES)
    ]
    outputs = [process.communicate(timeout=120)[0].decode(errors="replace") for process in processes]
    failures = [out[-500:] for process, out in zip(processes, outputs, strict=True) if process.returncode]
    assert not failures, failures[0]
    engine = create_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head()
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 0
    engine.dispose()


def test_concurrent_migrations_of_a_fresh_sqlite_database(tmp_path: Path) -> None:
    migrate_at_once(f"sqlite:///{tmp_path / 'optlab.db'}")


def test_concurrent_migrations_of_a_fresh_postgresql_database() -> None:
    name = f"optlab_migrate_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # pragma: no cover - reported, not hidden
        pytest.fail(f"PostgreSQL at {POSTGRES_ADMIN_URL} is needed for this test: {exc}")
    try:
        migrate_at_once(POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
