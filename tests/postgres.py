"""Throwaway PostgreSQL databases for tests and benchmarks: a unique name, dropped afterwards.

Light on purpose (SQLAlchemy only): benchmarks import it too.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

POSTGRES_ADMIN_URL = os.environ.get(
    "OPTLAB_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def database_url(name: str) -> str:
    """The URL of database `name` on the admin URL's server."""
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def throwaway_database(prefix: str = "optlab_test", options: str = "") -> Iterator[str]:
    """A fresh database named `prefix_<random>` (`options`: CREATE DATABASE's, a collation, say);
    yields its URL, drops it (and its sessions) after."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}" {options}'))
    except OperationalError as exc:
        admin.dispose()
        raise RuntimeError(
            f"PostgreSQL at {POSTGRES_ADMIN_URL} is needed (set OPTLAB_TEST_POSTGRES_URL): {exc}"
        ) from exc
    try:
        yield database_url(name)
    finally:
        with admin.connect() as connection:
            # A store-outage test may have left it refusing connections; FORCE needs them allowed.
            connection.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
