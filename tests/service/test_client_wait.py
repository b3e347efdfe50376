"""`optlab submit --wait` over an API restart: the client polls on while the API does not answer
(its jobs are requeued and resume), for a while; it had given up at the first refused poll."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from service import client as client_module
from service.client import ApiClient, ApiError
from tests.conftest import free_port


class Jobs(BaseHTTPRequestHandler):
    """GET /jobs/1: the status the test sets."""

    status = "running"

    def do_GET(self) -> None:
        body = json.dumps({"id": 1, "status": self.status, "progress": {"step": 1, "total": 2}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class Api:
    """An API on a fixed port that can be stopped and started again, as `optlab serve` is."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: ThreadingHTTPServer | None = None

    def start(self, status: str) -> None:
        handler = type("Handler", (Jobs,), {"status": status})
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        self.server = None


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    monkeypatch.setattr(client_module, "UNREACHABLE_POLL_S", 0.05)
    served = Api()
    yield served
    if served.server is not None:
        served.stop()


def test_wait_rides_out_an_api_restart(api: Api) -> None:
    api.start("running")
    seen: list[str] = []

    def restart_once(job: dict[str, Any]) -> None:
        seen.append(job["status"])
        if len(seen) == 1:  # down for a few polls, then back with the job ended
            api.stop()
            threading.Timer(0.5, api.start, args=("succeeded",)).start()

    ended = ApiClient(f"http://127.0.0.1:{api.port}").wait([1], on_update=restart_once, poll_s=0.01)
    assert ended[1]["status"] == "succeeded" and seen[0] == "running"


def test_wait_gives_up_on_an_api_gone_for_good_saying_the_job_may_still_run(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "UNREACHABLE_GRACE_S", 0.3)
    api.start("running")
    client = ApiClient(f"http://127.0.0.1:{api.port}")
    with pytest.raises(ApiError) as raised:
        client.wait([1], on_update=lambda job: api.server and api.stop(), poll_s=0.01)
    message = str(raised.value)
    assert "cannot reach the optlab API" in message and "gave up after 0.3 s of trying" in message
    assert f"The jobs may still be running or queued: GET http://127.0.0.1:{api.port}/jobs/1" in message


def test_a_wait_goes_on_through_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job store down for six seconds: the API answered 500 then (now 503), and `optlab submit
    --wait` quit with "HTTP 500: internal error" while the job went on to succeed."""
    import httpx

    monkeypatch.setattr(client_module, "UNREACHABLE_POLL_S", 0.0)
    answers = [503, 503, 200]

    def answer(request: httpx.Request) -> httpx.Response:
        status = answers.pop(0)
        if status == 503:
            return httpx.Response(503, json={"detail": "the job store does not answer; retry in 1 s"})
        return httpx.Response(200, json={"id": 1, "status": "succeeded", "progress": {"step": 2, "total": 2}})

    client = ApiClient("http://api.test")
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(answer))
    assert client.wait([1], poll_s=0)[1]["status"] == "succeeded" and answers == []


def test_a_submission_goes_on_through_a_503_under_one_idempotency_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job store down for a moment: `optlab submit --wait` had quit at once ("HTTP 503: the job
    store does not answer"), though its wait rides such an outage out."""
    import httpx

    monkeypatch.setattr(client_module, "UNREACHABLE_POLL_S", 0.0)
    answers = [503, 503, 201]
    keys: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        if answers.pop(0) == 503:
            return httpx.Response(503, json={"detail": "the job store does not answer; retry in 1 s"})
        return httpx.Response(201, json={"id": 7, "status": "queued"})

    client = ApiClient("http://api.test")
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(answer))
    assert client.submit({"workload": {"name": "digits_mlp"}})["id"] == 7 and answers == []
    assert len(keys) == 3 and len(set(keys)) == 1 and keys[0]  # one submission, sent three times
