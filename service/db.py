"""Engine, sessions and migrations for the job store (SQLite embedded, PostgreSQL in compose)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"
MIGRATION_LOCK_KEY = 0x6F70746C6162  # "optlab": any constant all optlab processes share


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # A store that stops answering must fail a call within seconds, not hang the worker's
    # supervision loop (it keeps supervising its job through an outage): libpq timeouts.
    timeouts = {"connect_timeout": 5, "tcp_user_timeout": 5000, "keepalives_idle": 5}
    return create_engine(url, pool_pre_ping=True, connect_args=timeouts if url.startswith("postgres") else {})


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while the worker writes; busy_timeout waits out short locks.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def migrate(engine: Engine) -> None:
    """Bring the schema to the latest Alembic revision (idempotent).

    `optlab serve` starts the API and a worker at once and both migrate: one at a time,
    or the second one sees no schema yet and fails creating a table the first just made.
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with _one_migration_at_a_time(engine), engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # Held until this transaction ends; every migrating process takes the same key.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@contextmanager
def _one_migration_at_a_time(engine: Engine) -> Iterator[None]:
    """A file lock beside a SQLite database (PostgreSQL uses an advisory lock instead)."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    with open(f"{database}.migrate.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
