"""Engine, sessions and migrations for the job store (SQLite embedded, PostgreSQL in compose)."""

from __future__ import annotations

import fcntl
import threading
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
SUBMISSION_LOCK_KEY = MIGRATION_LOCK_KEY + 1
# Threads of one API process; the file lock below serves other processes on the same SQLite file.
_SQLITE_SUBMISSIONS = threading.Lock()
# Connections in one process's pool. The API lets at most REQUESTS_AT_ONCE requests in at a time
# (service.guards.InFlightLimit), each with one session, so none waits for a connection while the
# threads that hold them wait for something it holds (the probes and the OpenAPI document, which
# bypass the limit or open a second session, use the overflow). With SQLAlchemy's default 5 + 10
# and FastAPI's 40 threads, 200 requests in flight deadlocked until the pool's 30 s timeout: 500s.
REQUESTS_AT_ONCE = 10
POOL = {"pool_size": REQUESTS_AT_ONCE, "max_overflow": 4}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30}, **_pool_of(url))
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # A store that stops answering must fail a call within seconds, not hang the worker's
    # supervision loop (it keeps supervising its job through an outage): libpq timeouts.
    timeouts = {"connect_timeout": 5, "tcp_user_timeout": 5000, "keepalives_idle": 5}
    return create_engine(
        url, pool_pre_ping=True, connect_args=timeouts if url.startswith("postgres") else {}, **POOL
    )


def _pool_of(url: str) -> dict[str, int]:
    # An in-memory SQLite database gets SQLAlchemy's single-connection pool, which takes no sizes.
    return {} if ":memory:" in url or url in ("sqlite://", "sqlite:///") else POOL


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while the worker writes; busy_timeout waits out short locks.
    # synchronous stays FULL (the default): a 201 means the job survives a power cut. Its fsync per
    # commit is paid once per batch of submissions (service.quotas.SubmissionQueue), not per job.
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
    with _sqlite_file_lock(engine, "migrate"), engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # Held until this transaction ends; every migrating process takes the same key.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@contextmanager
def submission_lock(session: Session) -> Iterator[None]:
    """One submission at a time counts the queue and inserts, so a quota holds exactly.

    The caller counts, inserts and commits inside. PostgreSQL: an advisory lock held by the
    session's transaction (every API process takes the same key), released by the commit, or by
    the rollback here when the caller refuses. SQLite: a thread lock and a file lock.
    """
    bind = session.get_bind()
    try:
        if bind.dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SUBMISSION_LOCK_KEY})
            yield
        else:
            with _SQLITE_SUBMISSIONS, _sqlite_file_lock(bind, "submit"):
                yield
    except BaseException:
        session.rollback()
        raise


@contextmanager
def _sqlite_file_lock(engine: Any, purpose: str) -> Iterator[None]:
    """A file lock beside a SQLite database file (PostgreSQL uses advisory locks instead)."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        yield
        return
    with open(f"{database}.{purpose}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
