"""Shared fixtures: the repository root, a published catalogue, PostgreSQL databases."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import throwaway_database

ROOT = Path(__file__).resolve().parents[1]


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
    with throwaway_database() as url:
        yield url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
