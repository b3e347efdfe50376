"""Access control: tokens on every route (table-driven over the app's routes), read-only tokens,
trusted hosts, writes a web page could forge, queue quotas, and tokens never shown."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.app import create_app
from service.auth import match_token
from service.db import make_engine, migrate, session_factory
from service.settings import ApiToken, Settings
from tests.service.test_api import GOOD

WRITER = "writer-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"
WRONG = "wrong-token-0123456789abcdefgh"
# The only routes anyone may call without a token (probes, and the API's own documentation).
OPEN_PATHS = {"/healthz", "/readyz"}
# A body that a route accepts, by path; a route not named here gets {} (its good-token answer may be
# 422 then, but never 401 or 403).
BODIES: dict[str, Any] = {
    "/jobs": GOOD,
    "/checks": {"optimizer": {"name": "lion", "params": {"lr": 0.001}}},
    "/studies": {
        "name": "auth",
        "workload": {"name": "digits_mlp"},
        "optimizers": [{"name": "sgd", "params": {"lr": [0.1]}}],
        "steps": 10,
    },
}
PATH_VALUES = {"job_id": "1", "name": "ema_momentum", "study_id": "1"}


def locked_settings(tmp_path: Path, **overrides: Any) -> Settings:
    return Settings(
        data_dir=tmp_path,
        api_tokens=f"alice:{WRITER},bob:{READER}:read",
        trusted_hosts="localhost,testserver",
        **overrides,
    )


@pytest.fixture
def locked(tmp_path: Path, catalogue_data: dict[str, Any]) -> Iterator[TestClient]:
    """An API with a submit token (alice) and a read-only one (bob), and one queued job."""
    yield from _client(locked_settings(tmp_path), catalogue_data)


def _client(settings: Settings, catalogue_data: dict[str, Any]) -> Iterator[TestClient]:
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions: sessionmaker[Session] = session_factory(engine)
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue_data)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def _operations() -> list[tuple[str, str]]:
    """Every (method, path) the app serves, from its OpenAPI (FastAPI builds it from the routes,
    included routers too), so a route added later is in this table without anyone adding it."""
    settings = Settings(database_url="sqlite:///:memory:", api_tokens=f"a:{WRITER}")
    paths = create_app(settings, run_migrations=False).openapi()["paths"]
    operations = [
        (method.upper(), path) for path, item in paths.items() if path not in OPEN_PATHS for method in item
    ]
    assert len(operations) >= 8, operations  # the table really is the app's routes
    return operations


OPERATIONS = _operations()


def _call(client: TestClient, method: str, path: str, token: str | None) -> Any:
    url = path.format(**PATH_VALUES)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if method == "GET":
        return client.get(url, headers=headers)
    return client.request(method, url, json=BODIES.get(path, {}), headers=headers)


def _seed_job(client: TestClient) -> None:
    response = client.post("/jobs", json=GOOD, headers={"Authorization": f"Bearer {WRITER}"})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_route_needs_a_valid_token(locked: TestClient, method: str, path: str) -> None:
    _seed_job(locked)
    for token, error in ((None, None), (WRONG, "invalid_token"), ("Basic " + WRITER, None)):
        if token and token.startswith("Basic"):
            response = locked.request(
                method,
                path.format(**PATH_VALUES),
                json=BODIES.get(path, {}),
                headers={"Authorization": token},
            )
        else:
            response = _call(locked, method, path, token)
        assert response.status_code == 401, (token, response.text)
        challenge = response.headers["www-authenticate"]
        assert challenge.startswith("Bearer") and (error is None or error in challenge)
        assert WRITER not in response.text and WRONG not in response.text
    read = _call(locked, method, path, READER)
    if method == "GET":
        assert read.status_code in (200, 404), read.text
    else:
        assert read.status_code == 403 and "'bob' is read-only" in read.json()["detail"], read.text
    good = _call(locked, method, path, WRITER)
    assert good.status_code not in (401, 403), good.text
    assert good.status_code < 300 or path not in BODIES, good.text


def test_healthz_needs_no_token(locked: TestClient) -> None:
    assert locked.get("/healthz").status_code == 200


def test_jobs_record_who_submitted_them(locked: TestClient) -> None:
    job = locked.post("/jobs", json=GOOD, headers={"Authorization": f"Bearer {WRITER}"}).json()
    assert job["submitted_by"] == "alice"
    check = locked.post("/checks", json=BODIES["/checks"], headers={"Authorization": f"Bearer {WRITER}"})
    assert check.json()["submitted_by"] == "alice"
    seen = locked.get(f"/jobs/{job['id']}", headers={"Authorization": f"Bearer {READER}"}).json()
    assert seen["submitted_by"] == "alice"


def test_an_open_api_says_so_and_records_no_submitter(
    tmp_path: Path, catalogue_data: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="optlab.api")
    settings = Settings(data_dir=tmp_path, trusted_hosts="testserver")
    for client in _client(settings, catalogue_data):
        job = client.post("/jobs", json=GOOD)
        assert job.status_code == 201 and job.json()["submitted_by"] is None
    assert "access control is OFF" in caplog.text


def test_the_start_up_log_names_tokens_never_their_secrets(
    tmp_path: Path, catalogue_data: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for client in _client(locked_settings(tmp_path), catalogue_data):
        client.get("/jobs", headers={"Authorization": f"Bearer {WRONG}"})
    assert "alice (submit)" in caplog.text and "bob (read-only)" in caplog.text
    assert WRITER not in caplog.text and READER not in caplog.text and WRONG not in caplog.text
    settings = locked_settings(tmp_path)
    assert WRITER not in repr(settings) and WRITER not in repr(settings.tokens)


def test_serve_says_who_may_use_the_api_without_a_token(tmp_path: Path) -> None:
    from service.cli import access_line

    said = access_line(locked_settings(tmp_path))
    assert said == "bearer tokens of alice (submit), bob (read-only)"
    assert access_line(Settings(data_dir=tmp_path)).startswith("open: no OPTLAB_API_TOKENS")


def test_tokens_from_a_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# one per line\ncarol:{WRITER}\n\ndave:{READER}:read\n")
    settings = Settings(data_dir=tmp_path, api_tokens_file=tokens)
    assert [(t.name, t.can_write) for t in settings.tokens] == [("carol", True), ("dave", False)]


# The commonest mistakes put the secret where the name belongs (a token without its name, name and
# token swapped): an entry is named by its place, never by what it holds.
@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("alice:short", "entry 1: the token must be at least 16 printable ASCII characters"),
        ("alice:", "entry 1: the token must be at least 16 printable ASCII characters"),
        (f":{WRITER}", "entry 1: the name must be"),
        (f"alice:{WRITER}:admin", "entry 1: the scope after the token may only be 'read'"),
        (f"{WRITER}:{READER}:admin", "entry 1: the scope after the token may only be 'read'"),
        (WRITER, "entry 1 has no ':'"),
        (f"{WRITER}:alice", "entry 1: the token must be at least 16"),
        ("alice:" + "é" * 20, "entry 1: the token must be at least 16 printable ASCII characters"),
        (f"alice:{WRITER},alice:{READER}", "entry 2 gives the name of OPTLAB_API_TOKENS entry 1 again"),
        (f"alice:{WRITER},bob:{WRITER}", "entry 2 gives the token of OPTLAB_API_TOKENS entry 1 again"),
        (" , ", "OPTLAB_API_TOKENS is set but holds no NAME:TOKEN entry"),
    ],
)
def test_bad_token_settings_fail_fast_without_showing_the_secret(entries: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(api_tokens=entries)
    errors = " ".join(error["msg"] for error in caught.value.errors())
    assert message in errors
    assert WRITER not in errors and READER not in errors


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"# only a comment\n\n", "holds no NAME:TOKEN entry: give one, or unset it"),
        (b"carol:\xff" + WRITER.encode(), "is not UTF-8 text (byte 0xff at offset 6)"),
        (f"alice:{READER}\n".encode(), "line 1 gives the name of OPTLAB_API_TOKENS entry 1 again"),
    ],
)
def test_bad_token_files_are_named_without_their_secrets(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(content)
    with pytest.raises(ValidationError) as caught:
        Settings(api_tokens=f"alice:{WRITER}", api_tokens_file=path)
    errors = " ".join(error["msg"] for error in caught.value.errors())
    assert f"OPTLAB_API_TOKENS_FILE {path}" in errors and message in errors, errors
    assert WRITER not in errors and READER not in errors


def test_a_token_file_may_have_a_byte_order_mark_and_comments_after_entries(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(
        f"\ufeffcarol:{WRITER}  # carol's laptop\r\ndave:{READER}:read # the dashboard\r\n".encode()
    )
    settings = Settings(api_tokens_file=path)
    assert [(t.name, t.secret, t.can_write) for t in settings.tokens] == [
        ("carol", WRITER, True),
        ("dave", READER, False),
    ]


def test_an_empty_token_file_setting_means_no_file() -> None:
    """`OPTLAB_API_TOKENS_FILE=` (compose's `${VAR:-}`) is unset, not the current folder."""
    assert Settings(api_tokens_file="").api_tokens_file is None


def test_token_comparison_checks_every_token() -> None:
    tokens = [ApiToken("a", WRITER), ApiToken("b", READER, can_write=False)]
    assert match_token(tokens, READER) == tokens[1]
    assert match_token(tokens, WRITER[:-1]) is None and match_token(tokens, "") is None


def test_foreign_host_headers_are_refused(locked: TestClient) -> None:
    auth = {"Authorization": f"Bearer {WRITER}"}
    refused = locked.get("/jobs", headers={**auth, "Host": "attacker.example:8000"})
    assert refused.status_code == 400
    detail = refused.json()["detail"]
    assert "attacker.example" in detail and "OPTLAB_TRUSTED_HOSTS" in detail
    assert locked.get("/jobs", headers={**auth, "Host": "localhost:8000"}).status_code == 200
    assert locked.get("/healthz", headers={"Host": "10.1.2.3:8000"}).status_code == 200  # probes


def test_the_default_trusted_hosts_are_the_localhost_names(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path).trusted_host_names == ["localhost", "127.0.0.1", "::1"]


def test_a_cross_site_form_cannot_cancel_a_job(tmp_path: Path, catalogue_data: dict[str, Any]) -> None:
    for client in _client(Settings(data_dir=tmp_path, trusted_hosts="testserver"), catalogue_data):
        job = client.post("/jobs", json=GOOD).json()
        for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data"):
            forged = client.post(
                f"/jobs/{job['id']}/cancel", content=b"", headers={"content-type": content_type}
            )
            assert forged.status_code == 415, forged.text
            assert "application/json" in forged.json()["detail"]
        assert client.post(f"/jobs/{job['id']}/cancel").status_code == 415  # no content type at all
        assert client.get(f"/jobs/{job['id']}").json()["status"] == "queued"
        assert client.post(f"/jobs/{job['id']}/cancel", json={}).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("DELETE", "/jobs/1", 405), ("PUT", "/jobs", 405), ("POST", "/nowhere", 404)],
)
def test_a_write_no_route_takes_gets_the_routers_answer_not_the_write_guards(
    client: TestClient, method: str, path: str, status: int
) -> None:
    """It reaches nothing, so nothing is forged: 405 with the methods the path has (or 404), which
    the write guard's 415 had hidden from a request without a content type."""
    answer = client.request(method, path)
    assert answer.status_code == status, answer.text
    if status == 405:
        assert method not in answer.headers["allow"] and "GET" in answer.headers["allow"]


def test_every_write_route_is_guarded(client: TestClient) -> None:
    """The guard asks the router which writes reach a route: every write route of the app must be one."""
    paths = client.get("/openapi.json").json()["paths"]
    writes = [(method.upper(), path) for path, item in paths.items() for method in item if method != "get"]
    assert len(writes) >= 5
    for method, template in writes:
        path = template.replace("{job_id}", "1").replace("{study_id}", "1")
        assert client.request(method, path).status_code == 415, (method, path)


def test_with_tokens_a_forged_write_is_simply_unauthorized(locked: TestClient) -> None:
    _seed_job(locked)
    forged = locked.post("/jobs/1/cancel", content=b"x=1", headers={"content-type": "text/plain"})
    assert forged.status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("OPTIONS", "/jobs", "GET, POST"),
        ("DELETE", "/jobs/1", "GET"),
        ("OPTIONS", "/openapi.json", "GET"),  # routes left out of the document have methods too
        ("POST", "/docs", "GET"),
    ],
)
def test_a_method_not_allowed_lists_every_method_of_the_path(
    locked: TestClient, method: str, path: str, allowed: str
) -> None:
    response = locked.request(method, path, headers={"Authorization": f"Bearer {WRITER}"})
    assert response.status_code == 405 and response.headers["allow"] == allowed
    assert allowed in response.json()["detail"]


def test_the_openapi_document_needs_a_token_and_the_docs_page_sends_it(locked: TestClient) -> None:
    refused = locked.get("/openapi.json")
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert locked.get("/openapi.json", headers={"Authorization": f"Bearer {READER}"}).status_code == 200
    page = locked.get("/docs")  # a page a browser opens: it asks for the token and sends it itself
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "const needsToken = true;" in page.text and '"Authorization"' in page.text
    # One exact Swagger UI, each file with its integrity hash; no other site may frame the page.
    assert page.text.count('integrity="sha384-') == 2 and "swagger-ui-dist@5." in page.text
    assert "swagger-ui-dist@5/" not in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
    assert 'sessionStorage.removeItem("optlab-token")' in page.text  # a wrong token is asked again
    # Without the CDN (no internet) the page is not blank: a text inside Swagger UI's element (which
    # Swagger UI replaces once it loads) says why and links the document.
    body = page.text.split('<div id="swagger-ui">', 1)[1].split("</div>", 1)[0]
    assert "cdn.jsdelivr.net" in body and '<a href="/openapi.json">' in body, body
    assert 'typeof SwaggerUIBundle === "function"' in page.text  # and asks no token for nothing
    assert locked.get("/redoc").status_code == 404  # a second docs page could not send the token


def test_the_openapi_names_what_the_catalogue_holds_and_every_status(locked: TestClient) -> None:
    document = locked.get("/openapi.json", headers={"Authorization": f"Bearer {READER}"}).json()
    schemas = document["components"]["schemas"]
    assert "ema_momentum" in schemas["OptimizerChoice"]["properties"]["name"]["enum"]
    assert schemas["WorkloadChoice"]["properties"]["name"]["enum"] == [
        "char_lm",
        "digits_cnn",
        "digits_mlp",
        "embedding_mf",
        "npz",
        "quadratic",
        "rosenbrock",
    ]
    assert "cosine" in schemas["ScheduleChoice"]["properties"]["name"]["enum"]
    assert schemas["JobSpec"]["properties"]["experiment"]["pattern"].startswith("^[A-Za-z0-9]")
    assert schemas["JobSpec"]["properties"]["steps"]["maximum"] == 2**31 - 1
    submit = document["paths"]["/jobs"]["post"]["responses"]
    assert set(submit) == {"201", "400", "401", "403", "413", "415", "422", "429", "503"}
    assert "Retry-After" in submit["429"]["headers"]
    cancel = document["paths"]["/jobs/{job_id}/cancel"]["post"]["responses"]
    assert {"404", "409"} <= set(cancel)
    assert document["paths"]["/jobs"]["post"]["security"] == [{"HTTPBearer": []}]


def test_queue_quotas_answer_429_with_retry_after(tmp_path: Path, catalogue_data: dict[str, Any]) -> None:
    settings = locked_settings(tmp_path, max_queued=3, max_queued_per_token=2)
    for client in _client(settings, catalogue_data):
        auth = {"Authorization": f"Bearer {WRITER}"}
        assert [client.post("/jobs", json=GOOD, headers=auth).status_code for _ in range(2)] == [201, 201]
        refused = client.post("/checks", json=BODIES["/checks"], headers=auth)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "30"
        assert "'alice' has 2 jobs queued" in refused.json()["detail"]
        assert client.get("/jobs", headers=auth).json()["total"] == 2  # nothing half-stored
        client.post("/jobs/1/cancel", json={}, headers=auth)  # a cancelled job no longer counts
        assert client.post("/jobs", json=GOOD, headers=auth).status_code == 201
    with_settings = Settings(data_dir=tmp_path / "open", trusted_hosts="testserver", max_queued=1)
    for client in _client(with_settings, catalogue_data):
        assert client.post("/jobs", json=GOOD).status_code == 201
        full = client.post("/jobs", json=GOOD)
        assert full.status_code == 429 and "OPTLAB_MAX_QUEUED" in full.json()["detail"]


@pytest.fixture
def served(tmp_path: Path, catalogue_data: dict[str, Any]) -> Iterator[str]:
    """The locked API on a real uvicorn server in a thread, for the CLI's own HTTP client."""
    import threading

    import uvicorn

    from tests.conftest import free_port

    settings = locked_settings(tmp_path).model_copy(update={"trusted_hosts": "127.0.0.1"})
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    with session_factory(engine)() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue_data)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_any_submitting_token_may_cancel_and_the_job_says_whose_cancel_it_was(
    tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    carol = "carol-token-0123456789abcdef"
    settings = Settings(
        data_dir=tmp_path,
        api_tokens=f"alice:{WRITER},bob:{READER}:read,carol:{carol}",
        trusted_hosts="testserver",
    )
    for client in _client(settings, catalogue_data):
        _seed_job(client)
        refused = client.post("/jobs/1/cancel", json={}, headers={"Authorization": f"Bearer {READER}"})
        assert refused.status_code == 403
        answer = client.post("/jobs/1/cancel", json={}, headers={"Authorization": f"Bearer {carol}"})
        assert answer.status_code == 200, answer.text
        job = answer.json()
        assert (
            job["status"] == "cancelled" and job["submitted_by"] == "alice" and job["cancelled_by"] == "carol"
        )


def test_the_cli_sends_optlab_token(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from service import cli
    from service.client import ApiClient

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(GOOD))
    monkeypatch.delenv("OPTLAB_TOKEN", raising=False)
    assert cli.main(["submit", str(spec), "--api", served]) == 2
    assert "needs a token" in capsys.readouterr().err
    monkeypatch.setenv("OPTLAB_TOKEN", READER)
    assert cli.main(["submit", str(spec), "--api", served]) == 2
    assert "read-only" in capsys.readouterr().err
    assert cli.main(["check", "lion", "--remote", served, "--only", "construct"]) == 2  # check --remote
    assert "read-only" in capsys.readouterr().err
    monkeypatch.setenv("OPTLAB_TOKEN", WRITER)
    assert cli.main(["submit", str(spec), "--api", served]) == 0
    assert "job 1 queued" in capsys.readouterr().out
    client = ApiClient(served)
    try:
        assert client.job(1)["submitted_by"] == "alice"
        assert client.cancel(1)["status"] == "cancelled"
    finally:
        client.close()


def test_the_cli_takes_a_token_with_a_line_end_and_names_a_bad_one_without_showing_it(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from service import cli

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(GOOD))
    monkeypatch.setenv("OPTLAB_TOKEN", f"{WRITER}\r\n")  # `$(cat tokens.txt)` of a Windows file
    assert cli.main(["submit", str(spec), "--api", served]) == 0
    capsys.readouterr()
    for bad in (f"{WRITER}\rx", f"é{WRITER}"):
        monkeypatch.setenv("OPTLAB_TOKEN", bad)
        assert cli.main(["submit", str(spec), "--api", served]) == 2  # a usage error, found before sending
        err = capsys.readouterr().err
        assert err.startswith("optlab submit: $OPTLAB_TOKEN holds a character no API token has"), err
        assert WRITER not in err and "Traceback" not in err


def test_client_commands_ignore_the_apis_token_settings_in_their_shell(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from service import cli

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(GOOD))
    monkeypatch.setenv("OPTLAB_API_TOKENS", "alice:short")  # the API's (bad) setting, not the client's
    monkeypatch.setenv("OPTLAB_API_TOKENS_FILE", str(tmp_path / "only-the-api-may-read-this"))
    monkeypatch.setenv("OPTLAB_TOKEN", WRITER)
    assert cli.main(["submit", str(spec), "--api", served]) == 0, capsys.readouterr().err
    assert cli.main(["api"]) == 2  # the server itself still refuses them


def test_an_open_api_refuses_to_listen_beyond_localhost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service import cli

    monkeypatch.delenv("OPTLAB_API_TOKENS", raising=False)
    monkeypatch.setenv("OPTLAB_DATA_DIR", str(tmp_path))
    assert cli.main(["api", "--host", "0.0.0.0"]) == 2
    assert "without access control" in capsys.readouterr().err


def test_two_authorization_or_host_headers_are_refused_not_guessed_between(locked: TestClient) -> None:
    for tokens in ((WRITER, READER), (READER, WRITER)):
        answer = locked.get("/jobs", headers=[("Authorization", f"Bearer {token}") for token in tokens])
        assert answer.status_code == 401 and "more than one Authorization header" in answer.json()["detail"]
    auth = ("Authorization", f"Bearer {WRITER}")
    answer = locked.get("/jobs", headers=[auth, ("Host", "localhost"), ("Host", "attacker.example")])
    assert answer.status_code == 400 and "more than one Host header" in answer.json()["detail"]


def test_a_wildcard_host_pattern_takes_names_under_it_only() -> None:
    from service.guards import host_allowed, host_name

    assert [host_name(h) for h in ("[::1]:8000", "[::1]", "[::1]evil.example", "[::1]:80x")] == [
        "::1",
        "::1",
        "[::1]evil.example",
        "[::1]:80x",
    ]
    assert [host_name(h) for h in ("localhost:8000", "127.0.0.1:abc", "127.0.0.1:80@evil")] == [
        "localhost",
        "127.0.0.1:abc",
        "127.0.0.1:80@evil",
    ]

    assert host_allowed("a.lab.example", ["*.lab.example"])
    assert not host_allowed(".lab.example", ["*.lab.example"])
    assert not host_allowed("lab.example", ["*.lab.example"])
    assert not host_allowed("evil-lab.example", ["*.lab.example"])


def test_a_token_in_the_query_string_is_refused_saying_why_and_logged_redacted(locked: TestClient) -> None:
    import logging

    from uvicorn.logging import AccessFormatter

    from service.app import RedactedAccessLog
    from service.secrets import redact_url

    assert "bearer=***" in redact_url(f"/jobs?bearer={WRITER}")
    answer = locked.get(f"/jobs?access_token={WRITER}&limit=5")
    assert answer.status_code == 401
    assert "a token in the query string (access_token) is not read" in answer.json()["detail"]
    assert any(isinstance(f, RedactedAccessLog) for f in logging.getLogger("uvicorn.access").filters)
    # The record as uvicorn's access logger makes it, through the filter and uvicorn's formatter.
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', None, None
    )
    record.args = ("127.0.0.1:5000", "GET", f"/jobs?access_token={WRITER}&limit=5", "1.1", 401)
    assert RedactedAccessLog().filter(record)
    line = AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s').format(record)
    assert WRITER not in line and "/jobs?access_token=***&limit=5" in line, line


def test_an_open_api_declares_no_token(client: TestClient) -> None:
    """Without OPTLAB_API_TOKENS every operation had still declared the bearer scheme: schemathesis
    counted 33 "expected a 401" failures against an API that rightly answers without one."""
    document = client.get("/openapi.json").json()
    assert "securitySchemes" not in document.get("components", {})
    declared = [
        (path, method)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if "security" in operation
    ]
    assert declared == []


@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_a_json_body_sent_as_something_else_is_told_its_content_type(
    locked: TestClient, content_type: str | None
) -> None:
    """With a token, the write guard lets any content type through; the body, then not read as JSON,
    had been told "Input should be a valid dictionary or object", quoting the JSON object it was."""
    headers = {"Authorization": f"Bearer {WRITER}"} | ({"content-type": content_type} if content_type else {})
    response = locked.post("/jobs", content=json.dumps(GOOD).encode(), headers=headers)
    assert response.status_code == 415, response.text
    shown = repr(content_type) if content_type else "none"
    assert response.json()["detail"] == (
        f"send the body as JSON, with `Content-Type: application/json` (received {shown})"
    )
    assert locked.get("/jobs", headers={"Authorization": f"Bearer {WRITER}"}).json()["total"] == 0
