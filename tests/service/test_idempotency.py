"""`Idempotency-Key` on POST /jobs, /checks and /studies: a retried submission gets what its first
request made, never a second job; a key sent again with another request is refused. The race of
one key across two API servers is in test_quota_race.py; the client's own retries at the end."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service import client as api_client
from service.client import ApiClient
from service.settings import Settings
from tests.service.test_api import GOOD, with_changes
from tests.service.test_auth import BODIES, READER, WRITER, _client
from tests.service.test_studies_api import STUDY

CHECK = BODIES["/checks"]


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def test_the_same_key_and_request_again_gets_the_first_job_back(client: TestClient) -> None:
    first = client.post("/jobs", json=GOOD, headers=keyed("k-1"))
    again = client.post("/jobs", json=GOOD, headers=keyed("k-1"))
    assert first.status_code == again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"]
    assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
    # The same request spelled otherwise (a default written out, keys in another order) is the same.
    spelled = dict(reversed(list(with_changes(device="auto").items())))
    assert client.post("/jobs", json=spelled, headers=keyed("k-1")).json()["id"] == first.json()["id"]
    assert client.get("/jobs").json()["total"] == 1
    # Without a key, or with another, a request is a new job.
    assert client.post("/jobs", json=GOOD).json()["id"] != first.json()["id"]
    assert client.post("/jobs", json=GOOD, headers=keyed("k-2")).json()["id"] != first.json()["id"]
    assert client.get("/jobs").json()["total"] == 3


def test_a_key_sent_again_with_another_request_is_refused_naming_what_it_made(client: TestClient) -> None:
    job = client.post("/jobs", json=GOOD, headers=keyed("k-1")).json()
    for path, body in (("/jobs", with_changes(seed=1)), ("/checks", CHECK), ("/studies", STUDY)):
        refused = client.post(path, json=body, headers=keyed("k-1"))
        assert refused.status_code == 422, (path, refused.text)
        [problem] = refused.json()["detail"]
        assert problem["loc"] == ["header", "Idempotency-Key"] and problem["type"] == "idempotency_key_reused"
        assert f"made job {job['id']}" in problem["msg"] and "'k-1'" in problem["msg"]
    assert client.get("/jobs").json()["total"] == 1  # nothing stored for the refused ones


def test_a_retry_gets_its_job_even_where_the_queue_would_refuse_it_now(
    tmp_path: Path, catalogue_data: dict[str, Any]
) -> None:
    settings = Settings(data_dir=tmp_path, trusted_hosts="testserver", max_queued=1)
    for client in _client(settings, catalogue_data):
        first = client.post("/jobs", json=GOOD, headers=keyed("k-1"))
        assert client.post("/jobs", json=GOOD).status_code == 429
        again = client.post("/jobs", json=GOOD, headers=keyed("k-1"))
        assert again.status_code == 201 and again.json()["id"] == first.json()["id"], again.text
        assert client.post("/jobs", json=GOOD, headers=keyed("k-2")).status_code == 429


def test_a_check_and_a_study_are_replayed_too(client: TestClient) -> None:
    check = client.post("/checks", json=CHECK, headers=keyed("c"))
    assert check.status_code == 201, check.text
    again = client.post("/checks", json=CHECK, headers=keyed("c"))
    assert again.json()["id"] == check.json()["id"] and again.headers["idempotent-replayed"] == "true"
    study = client.post("/studies", json=STUDY, headers=keyed("s"))
    assert study.status_code == 201, study.text
    again = client.post("/studies", json=STUDY, headers=keyed("s"))
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == study.json()["id"]
    assert client.get("/studies").json()["total"] == 1
    assert client.get("/jobs").json()["total"] == 1 + len(study.json()["jobs"])
    other_study = client.post("/studies", json={**STUDY, "name": "another"}, headers=keyed("s"))
    assert other_study.status_code == 422 and f"made study {study.json()['id']}" in other_study.text


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "at least 1 character"),
        ("k" * 256, "at most 255 characters"),
        (
            b"caf\xc3\xa9",
            # The character sent (é, U+00E9), not its UTF-8 bytes read as Latin-1 (\u00c3\u00a9).
            'must be printable ASCII, without a space at either end (a UUID is one); received "caf\\u00e9"',
        ),
        ("tab\there", "must be printable ASCII"),
    ],
)
def test_a_malformed_key_is_refused_naming_the_header(client: TestClient, key: str | bytes, why: str) -> None:
    refused = client.post("/jobs", json=GOOD, headers={"Idempotency-Key": key})
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["header", "Idempotency-Key"] and why in problem["msg"]
    assert client.get("/jobs").json()["total"] == 0


def test_keys_are_each_tokens_own(tmp_path: Path, catalogue_data: dict[str, Any]) -> None:
    settings = Settings(
        data_dir=tmp_path,
        api_tokens=f"alice:{WRITER},carol:{WRITER[::-1]},bob:{READER}:read",
        trusted_hosts="testserver",
    )
    for client in _client(settings, catalogue_data):
        alice = client.post("/jobs", json=GOOD, headers={**keyed("k"), "Authorization": f"Bearer {WRITER}"})
        carol = client.post(
            "/jobs", json=GOOD, headers={**keyed("k"), "Authorization": f"Bearer {WRITER[::-1]}"}
        )
        assert alice.status_code == carol.status_code == 201, carol.text
        assert alice.json()["id"] != carol.json()["id"] and "idempotent-replayed" not in carol.headers
        # A read-only token is refused before its key is looked at.
        reader = client.post("/jobs", json=GOOD, headers={**keyed("k"), "Authorization": f"Bearer {READER}"})
        assert reader.status_code == 403


class AnswerLostOnce(httpx.BaseTransport):
    """Sends each request to the app, but loses the answer to the first POST: a read timeout after
    the job was stored, as a client sees an API that was slow to answer."""

    def __init__(self, app: TestClient) -> None:
        self.app = app
        self.sent: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        answer = self.app.request(
            request.method, request.url.path, content=request.read(), headers=request.headers
        )
        if request.method == "POST" and len(self.sent) == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


@pytest.fixture
def lossy(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ApiClient, AnswerLostOnce]]:
    monkeypatch.setattr(api_client, "SUBMIT_RETRY_AFTER_S", 0.0)
    transport = AnswerLostOnce(client)
    api = ApiClient("http://testserver")
    api._http = httpx.Client(base_url="http://testserver", transport=transport)
    yield api, transport
    api.close()


@pytest.mark.parametrize(
    ("submit", "body", "listed"),
    [
        (ApiClient.submit, GOOD, "/jobs"),
        (ApiClient.submit_check, CHECK, "/jobs"),
        (ApiClient.submit_study, STUDY, "/studies"),
    ],
)
def test_the_client_retries_a_lost_answer_under_one_key_and_makes_one_job(
    lossy: tuple[ApiClient, AnswerLostOnce],
    client: TestClient,
    submit: Any,
    body: dict[str, Any],
    listed: str,
) -> None:
    api, transport = lossy
    made = submit(api, body)
    keys = [request.headers["idempotency-key"] for request in transport.sent]
    assert len(keys) == 2 and keys[0] == keys[1] and uuid.UUID(keys[0])
    assert client.get(listed).json()["items"][0]["id"] == made["id"]
    assert client.get(listed).json()["total"] == 1
    # The next submission is a new request with a key of its own.
    submit(api, body)
    assert transport.sent[-1].headers["idempotency-key"] != keys[0]


def test_the_client_gives_up_after_its_attempts_saying_how_often_it_tried(
    lossy: tuple[ApiClient, AnswerLostOnce], client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, transport = lossy
    monkeypatch.setattr(api_client, "SUBMIT_ATTEMPTS", 1)
    with pytest.raises(api_client.ApiError, match="ReadTimeout") as lost:
        api.submit(GOOD)
    assert "sent once with Idempotency-Key" in str(lost.value)
    assert "it may have been stored all the same" in str(lost.value)
    monkeypatch.setattr(api_client, "SUBMIT_ATTEMPTS", 3)
    transport.sent = []
    monkeypatch.setattr(AnswerLostOnce, "handle_request", _always_lost)
    with pytest.raises(api_client.ApiError, match="sent 3 times with Idempotency-Key") as lost:
        api.submit(GOOD)
    key = transport.sent[-1].headers["idempotency-key"]
    assert key in str(lost.value) and "makes no second one" in str(lost.value)
    assert client.get("/jobs").json()["total"] == 1  # the first one's job: it arrived, its answer did not


def _always_lost(self: AnswerLostOnce, request: httpx.Request) -> httpx.Response:
    self.sent.append(request)
    raise httpx.ReadTimeout("timed out", request=request)


def test_two_keys_in_one_request_are_refused_whatever_their_order(client: TestClient) -> None:
    """Either could be the one meant, and a proxy may reorder them: neither is taken."""
    for pair in (["k-a", "k-b"], ["k-b", "k-a"]):
        refused = client.post("/jobs", json=GOOD, headers=[("Idempotency-Key", key) for key in pair])
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()["detail"]
        assert (
            problem["loc"] == ["header", "Idempotency-Key"] and "2 Idempotency-Key headers" in problem["msg"]
        )
    assert client.get("/jobs").json()["total"] == 0


def test_the_openapi_document_declares_the_key_and_the_replayed_answer(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/jobs", "/checks", "/studies"):
        post = paths[path]["post"]
        [key] = [p for p in post["parameters"] if p["name"] == "Idempotency-Key"]
        assert key["in"] == "header" and not key["required"]
        assert "Idempotent-Replayed" in post["responses"]["201"]["headers"]
        assert "Idempotency-Key" in post["responses"]["422"]["description"]


def test_a_study_retry_that_finds_its_study_only_under_the_lock_says_it_is_replayed(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two retries race: the second's first look finds nothing, and the look under the submission
    lock finds the study the first stored. It gets that study, said to be replayed."""
    from service.idempotency import IdempotentRequest

    first = client.post("/studies", json=STUDY, headers=keyed("s"))
    real, looks = IdempotentRequest.earlier_study, []

    def missed_the_first_time(self: IdempotentRequest, session: Any) -> Any:
        looks.append(self.key)
        return None if len(looks) == 1 else real(self, session)

    monkeypatch.setattr(IdempotentRequest, "earlier_study", missed_the_first_time)
    again = client.post("/studies", json=STUDY, headers=keyed("s"))
    assert len(looks) == 2 and again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
    assert client.get("/studies").json()["total"] == 1
