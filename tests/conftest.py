"""Shared fixtures: the repository root, a published catalogue, PostgreSQL databases."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
POSTGRES_ADMIN_URL = os.environ.get(
    "OPTLAB_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture(scope="session")
def catalogue_data() -> dict[str, Any]:
    """The catalogue exactly as a worker publishes it: from `python -m jobs.catalogue`."""
    completed = subprocess.run(
        [sys.executable, "-m", "jobs.catalogue"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    data: dict[str, Any] = json.loads(completed.stdout)
    return data


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, throwaway PostgreSQL database for this test session."""
    from sqlalchemy import create_engine, text

    name = f"optlab_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
