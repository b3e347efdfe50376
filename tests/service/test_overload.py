"""Past its capacity the API waits or answers 503 with Retry-After; never a 500 for being busy."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError
from starlette.types import Receive, Scope, Send

from service import store
from service.guards import InFlightLimit
from tests.service.test_api import GOOD


def _answers_when_released(release: asyncio.Event) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def _call(app: Any, path: str) -> tuple[int, dict[str, str]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers


def test_requests_past_the_limit_wait_for_a_place_then_get_503_with_retry_after() -> None:
    async def scenario() -> list[tuple[int, dict[str, str]]]:
        release = asyncio.Event()
        limited = InFlightLimit(_answers_when_released(release), limit=2, wait_s=0.05)
        inside = [asyncio.create_task(_call(limited, "/jobs")) for _ in range(2)]
        await asyncio.sleep(0)  # both take the two places
        turned_away = await _call(limited, "/jobs")  # waits 0.05 s for a place, gets none
        probe = asyncio.create_task(_call(limited, "/healthz"))  # probes never wait for a place
        waiting = asyncio.create_task(_call(limited, "/jobs"))
        release.set()  # the two inside finish: the one waiting gets in
        return [turned_away, *await asyncio.gather(*inside, probe, waiting)]

    (status, headers), *served = asyncio.run(scenario())
    assert status == 503 and headers["retry-after"] == str(InFlightLimit.RETRY_AFTER_S)
    assert [code for code, _ in served] == [200, 200, 200, 200]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("database is locked", 503),
        ("no such table: jobs", 500),
        # PostgreSQL down, refusing connections, or dropping them: a 500 "internal error" before, which
        # `optlab submit --wait` gave up on.
        ('connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused', 503),
        ("FATAL:  terminating connection due to administrator command", 503),
        ('FATAL:  database "optlab" is not currently accepting connections', 503),
        ('FATAL:  database "optlab" does not allow connections', 503),
    ],
)
def test_a_busy_store_is_503_with_retry_after_any_other_database_error_500(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, message: str, expected: int
) -> None:
    def fails(**_: Any) -> Any:
        raise OperationalError("INSERT INTO jobs ...", {}, sqlite3.OperationalError(message))

    monkeypatch.setattr(store, "job_row", fails)
    response = client.post("/jobs", json=GOOD)
    assert response.status_code == expected, response.text
    if expected == 503:
        assert response.headers["retry-after"] == "1"
        said = "is busy" if "locked" in message else "does not answer"
        assert response.json()["detail"] == f"the job store {said}; retry in 1 s"
    assert client.get("/jobs").json()["total"] == 0


def test_healthz_is_alive_while_the_store_does_not_answer(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A liveness probe: it answered 500 with the store down, so a probe would restart a sound API."""
    from sqlalchemy.orm import Session

    def down(self: Session, *args: Any, **kwargs: Any) -> Any:
        raise OperationalError("SELECT 1", {}, Exception("connection failed: Connection refused"))

    monkeypatch.setattr(Session, "execute", down)
    response = client.get("/healthz")
    assert response.status_code == 200, response.text
    assert response.json()["database"] == "does not answer (Exception)"
