"""`GET /readyz`: 200 only when the store is migrated and answers, MLflow answers its /health and a
catalogue is published; 503 naming what is missing otherwise. The MLflow side is a real HTTP server
on a free port answering /health as MLflow's does (the compose test runs it against real MLflow)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from service import store
from service.app import create_app
from service.db import make_engine, migrate, session_factory
from service.settings import Settings
from tests.conftest import free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path == "/health" else 404
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def mlflow_up() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _api(
    tmp_path: Path, mlflow: str, *, catalogue: dict[str, Any] | None, migrated: bool = True
) -> TestClient:
    settings = Settings(
        data_dir=tmp_path,
        mlflow_tracking_uri=mlflow,
        api_tokens="alice:alice-token-0123456789",
        trusted_hosts="api.example",
    )
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    if catalogue is not None:
        with session_factory(engine)() as session:
            store.publish_catalogue(session=session, worker_id="w", catalogue=catalogue)
    app = create_app(settings, run_migrations=False)
    if not migrated:  # a schema one migration behind: as while an older release's store is upgraded
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '0002_job_kind'"))
    return TestClient(app, raise_server_exceptions=False)


CASES = [
    # (name, MLflow up, catalogue published, schema at head, missing)
    ("ready", True, True, True, []),
    ("mlflow down", False, True, True, ["mlflow"]),
    ("no catalogue", True, False, True, ["catalogue"]),
    ("schema behind", True, True, False, ["database"]),
    ("nothing", False, False, True, ["mlflow", "catalogue"]),
]


@pytest.mark.parametrize(
    ("name", "mlflow", "published", "migrated", "missing"), CASES, ids=[c[0] for c in CASES]
)
def test_readyz_says_what_is_missing(
    tmp_path: Path,
    mlflow_up: str,
    catalogue_data: dict[str, Any],
    name: str,
    mlflow: bool,
    published: bool,
    migrated: bool,
    missing: list[str],
) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = _api(
        tmp_path,
        mlflow_up if mlflow else down,
        catalogue=catalogue_data if published else None,
        migrated=migrated,
    )
    # No token, and a Host that is not trusted: a probe calls by the container's address.
    response = client.get("/readyz", headers={"Host": "10.0.0.7:8000"})
    body = response.json()
    assert response.status_code == (200 if not missing else 503), body
    assert body["ready"] is (not missing) and body["missing"] == missing, body
    for condition in ("database", "mlflow", "catalogue"):
        assert body[condition]["ok"] is (condition not in missing), body
    if "mlflow" in missing:
        assert down in body["mlflow"]["detail"] and "does not answer" in body["mlflow"]["detail"]
    if "database" in missing:
        assert "0002_job_kind" in body["database"]["detail"], body
    # /healthz (alive) answers whatever readiness says.
    assert client.get("/healthz", headers={"Host": "10.0.0.7:8000"}).status_code == 200


def test_readyz_is_declared_in_the_openapi(tmp_path: Path, mlflow_up: str) -> None:
    api = _api(tmp_path, mlflow_up, catalogue=None)
    document = api.get(
        "/openapi.json", headers={"Host": "api.example", "Authorization": "Bearer alice-token-0123456789"}
    ).json()
    answers = document["paths"]["/readyz"]["get"]["responses"]
    assert set(answers) >= {"200", "503"}
    assert "security" not in document["paths"]["/readyz"]["get"]  # no token needed
