"""A small HTTP client for the optlab API: `optlab submit`, `optlab check --remote`, `optlab demo`."""

from __future__ import annotations

import os
import ssl
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from jobs.result import ErrorRecord, JobResult, JobStatus
from service.secrets import redact_url, split_credentials

T = TypeVar("T")


def status_of(job: dict[str, Any]) -> JobStatus:
    """A job's status from the API, as the enum (a status this client does not know is an error)."""
    return JobStatus(job["status"])


def result_of(job: dict[str, Any]) -> JobResult | None:
    """A job's `result` from the API, validated: a renamed or missing key fails here, loudly."""
    return JobResult.model_validate(job["result"]) if job.get("result") else None


def error_of(job: dict[str, Any]) -> ErrorRecord | None:
    return ErrorRecord.model_validate(job["error"]) if job.get("error") else None


# `wait` over an API restart (`optlab serve` stopped and started: its jobs are requeued, and resume):
# polled again this often, for this long, before it gives up.
UNREACHABLE_GRACE_S = 120.0
UNREACHABLE_POLL_S = 2.0


def _token_problem(token: str) -> str | None:
    """Why $OPTLAB_TOKEN cannot be sent as a header, without quoting it (it is a secret)."""
    if all(33 <= ord(c) <= 126 for c in token):
        return None
    return (
        "$OPTLAB_TOKEN holds a character no API token has (a space, a line break, a control "
        "character or a non-ASCII letter): tokens are printable ASCII; set it to the token alone"
    )


class ApiError(RuntimeError):
    """An answer that refused the request (its status and detail), or none at all (status 0)."""

    def __init__(self, status_code: int, detail: Any) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(format_detail(status_code, detail))

    @property
    def is_usage_error(self) -> bool:
        """The request itself was wrong (the CLI exits 2), not the service or the network (1)."""
        return self.status_code in USAGE_ERRORS

    @property
    def is_unavailable(self) -> bool:
        """No answer came, or one saying the API cannot serve now: worth asking again a little later."""
        return self.status_code in UNAVAILABLE


class AddressError(ApiError):
    """The API's address is not one (no scheme, a scheme other than http(s)): a usage error, found
    before any request went out."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message)

    @property
    def is_usage_error(self) -> bool:
        return True

    @property
    def is_unavailable(self) -> bool:
        return False


class TokenError(ApiError):
    """$OPTLAB_TOKEN cannot be sent: a usage error (401, the CLI's exit 2), found before any request,
    so it is said without an HTTP status."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message)
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.detail)


def format_detail(status_code: int, detail: Any) -> str:
    if status_code == 0:  # no answer came: "HTTP 0" would read as one
        return str(detail)
    if isinstance(detail, list):
        lines = [f"  - {_problem_line(item)}" if isinstance(item, dict) else f"  - {item}" for item in detail]
        return f"HTTP {status_code}:\n" + "\n".join(lines)
    return f"HTTP {status_code}: {detail}"


def _problem_line(item: dict[str, Any]) -> str:
    """A 422's problem with the field it is at, unless its message starts with it already: "lr must be
    a number > 0" alone does not say which param group's lr."""
    message = str(item.get("msg", item))
    field = ".".join(str(part) for part in item.get("loc", [])[1:])
    return message if not field or message.startswith(field) else f"{field}: {message}"


# A submission whose answer was lost (a timeout, a dropped connection) is sent again this often in
# all, under the `Idempotency-Key` it was first sent with: the API answers a retry of a stored
# submission with its job, so a retry never makes a second one.
SUBMIT_ATTEMPTS = 3
SUBMIT_RETRY_AFTER_S = 1.0
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"  # service.idempotency.KEY_HEADER, without importing the service

# No answer (0), or one saying the API cannot serve now: its job store does not answer (503), a proxy
# in front of it finds no API (502, 504).
UNAVAILABLE = (0, 502, 503, 504)
# Statuses that mean the request itself was wrong (the CLI exits 2 for them, 1 for the rest).
USAGE_ERRORS = (400, 401, 403, 404, 405, 413, 415, 422)  # 405: the address is wrong
# The API's own routes (and its docs'): an address ending in one is not its root.
API_ROUTES = (
    "jobs",
    "studies",
    "checks",
    "optimizers",
    "schedules",
    "workloads",
    "docs",
    "redoc",
    "openapi.json",
)


# OpenSSL's reasons for a plain-HTTP answer to its hello ("record layer failure" from 3.2 on).
PLAIN_HTTP_TLS_REASONS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE")


def _not_an_address(url: str, problem: object) -> str:
    shown = url if "@" not in url else redact_url(url)  # one that cannot be parsed shows as *** whole
    return f"{shown!r} is not an address of an optlab API ({problem}); give its root, as in http://127.0.0.1:8000"


def _names_no_host(url: str) -> bool:
    """`http://` (or `https:///jobs`): httpx takes it, and every request then failed as "cannot reach
    the optlab API at http:", which read as the API being down."""
    parts = urlsplit(url)
    return parts.scheme.lower() in ("http", "https") and not parts.hostname


def _tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error under an httpx ConnectError (httpx wraps httpcore's, which wraps it), if any."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def connect(address: str, command: str) -> ApiClient | None:
    """The client of the API at `address`; None, said in a line, for an address that is not one.
    Credentials in it are said to be left out (a proxy asking for them would refuse every request)."""
    try:
        client = ApiClient(address)
    except ApiError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None
    if client.dropped_credentials:
        print(
            f"{command}: the credentials in the API address are not sent: the API takes a bearer token "
            "($OPTLAB_TOKEN) only",
            file=sys.stderr,
        )
    return client


class ApiClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, token: str | None = None) -> None:
        """`token` defaults to $OPTLAB_TOKEN; it goes in the Authorization header, nowhere else.

        Credentials in the address (`http://user:pw@host`) are dropped, never sent nor shown: httpx
        made them a Basic Authorization header that replaced the bearer token, and the API takes
        only bearer tokens (AddressError for an address that is not one, an empty one included)."""
        if not base_url.strip():
            raise AddressError("the API address is empty; give its root, as in http://127.0.0.1:8000")
        try:
            clean, user, password = split_credentials(base_url.strip())
        except ValueError as exc:  # a port that is not a number, an unclosed [IPv6 address
            raise AddressError(_not_an_address(base_url, exc)) from None
        if _names_no_host(clean):
            raise AddressError(_not_an_address(base_url, "it names no host"))
        self.base_url = clean.rstrip("/")
        self.dropped_credentials = user is not None or password is not None
        # Stripped: a token read from a file with `$(cat ...)` may keep a Windows line's `\r`.
        token = (token if token is not None else os.environ.get("OPTLAB_TOKEN", "")).strip()
        self._token_problem = _token_problem(token)
        headers = {"Authorization": f"Bearer {token}"} if token and not self._token_problem else {}
        try:
            self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        except httpx.InvalidURL as exc:
            raise AddressError(_not_an_address(base_url, exc)) from None

    def close(self) -> None:
        self._http.close()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._submit("/jobs", spec)

    def submit_check(self, body: dict[str, Any]) -> dict[str, Any]:
        """Queue the conformance checks (POST /checks); the returned job is followed like any other."""
        return self._submit("/checks", body)

    def submit_study(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._submit("/studies", spec)

    def _submit(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a submission under an `Idempotency-Key` of its own, sent again with that key where
        its answer was lost, up to SUBMIT_ATTEMPTS times in all; and while the API answers that it
        cannot take it now (its job store down: 503), for UNREACHABLE_GRACE_S, as a wait rides that
        out (it had given up at once).
        The key makes every resend safe: the API stores the submission once."""
        headers = {IDEMPOTENCY_KEY_HEADER: str(uuid.uuid4())}
        listing = "/studies" if path == "/studies" else "/jobs"  # a check is a job
        return self.patiently(
            lambda: self._call("POST", path, json=body, headers=headers, attempts=SUBMIT_ATTEMPTS),
            after=f"Submit it again once the API answers (GET {self.base_url}{listing} first where an "
            "answer was lost: the API may have taken it)",
            answered=True,
        )

    def study(self, study_id: int) -> dict[str, Any]:
        return self._call("GET", f"/studies/{study_id}")

    def job(self, job_id: int) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}")

    def optimizer(self, name: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """GET /optimizers/{name}: its implementations, each with its latest check's summary."""
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        return self._call("GET", f"/optimizers/{name}", **extra)

    def cancel(self, job_id: int) -> dict[str, Any]:
        # No body, but a JSON content type: the API refuses writes a web page could forge.
        return self._call("POST", f"/jobs/{job_id}/cancel", headers={"content-type": "application/json"})

    def wait(
        self,
        job_ids: list[int],
        on_update: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
    ) -> dict[int, dict[str, Any]]:
        """Poll until every job has ended; `on_update` sees each job on every poll. An API that stops
        answering (restarted: its jobs go on or are requeued) is polled again for UNREACHABLE_GRACE_S."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        latest: dict[int, dict[str, Any]] = {}
        shown = ", ".join(f"{self.base_url}/jobs/{job_id}" for job_id in job_ids)
        while True:
            self.patiently(
                lambda: self._poll(job_ids, latest, on_update),
                after=f"The jobs may still be running or queued: GET {shown} once the API is back",
            )
            if all(status_of(job).terminal for job in latest.values()):
                return latest
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"jobs {job_ids} still running after {timeout_s}s")
            time.sleep(poll_s)

    def patiently(self, call: Callable[[], T], *, after: str, answered: bool = False) -> T:
        """`call()`, again while the API gives no answer or answers that it cannot now (503: its job
        store does not answer; 502, 504: a proxy without it), for UNREACHABLE_GRACE_S; then the error,
        and `after`, what to do later. `answered`: only while it answers so (a submission whose answer
        was lost has been sent again as often as it may be: `_call`'s attempts)."""
        unavailable_since: float | None = None
        while True:
            try:
                return call()
            except ApiError as exc:
                if not exc.is_unavailable or (answered and exc.status_code == 0):
                    raise
                unavailable_since = unavailable_since or time.monotonic()
                if time.monotonic() - unavailable_since > UNREACHABLE_GRACE_S:
                    raise ApiError(
                        exc.status_code,
                        f"{exc.detail}; gave up after {UNREACHABLE_GRACE_S:g} s of trying. {after}",
                    ) from None
                time.sleep(UNREACHABLE_POLL_S)

    def _poll(
        self,
        job_ids: list[int],
        latest: dict[int, dict[str, Any]],
        on_update: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        """Each job not ended yet, read again into `latest` and shown to `on_update`."""
        for job_id in job_ids:
            if job_id in latest and status_of(latest[job_id]).terminal:
                continue
            latest[job_id] = self.job(job_id)
            if on_update:
                on_update(latest[job_id])

    def _call(self, method: str, path: str, *, attempts: int = 1, **kwargs: Any) -> dict[str, Any]:
        """The answer's JSON, or ApiError: its status and detail, or 0 where no answer came.

        `attempts`: how often to send a request whose answer was lost (only for one that is safe
        to send again)."""
        if self._token_problem:  # said before any request: httpx's own error would quote the token
            raise TokenError(self._token_problem)
        for attempt in range(1, attempts + 1):
            try:
                response = self._http.request(method, path, **kwargs)
                break
            except httpx.ConnectError as exc:
                raise self._not_connected(exc) from None
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                if attempt < attempts:  # the request may have arrived: its answer did not
                    time.sleep(SUBMIT_RETRY_AFTER_S)
                    continue
                key = kwargs.get("headers", {}).get(IDEMPOTENCY_KEY_HEADER)
                raise ApiError(0, self._unreachable(exc, attempts, key)) from None
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:  # no scheme, or not http(s)
                raise AddressError(_not_an_address(self.base_url, exc)) from None
            except httpx.HTTPError as exc:  # a malformed request
                raise ApiError(0, self._unreachable(exc, 1)) from None
        if response.is_redirect:  # httpx follows none: an http:// address of an https:// API, say
            raise AddressError(self._redirected(response))
        try:
            data = response.json()
        except ValueError:  # an HTML page (a proxy's login, another server's error), or nothing
            data = None
        if response.status_code >= 400:
            if isinstance(data, dict):
                detail = data.get("detail", response.text)
            elif data is None and response.text.strip() and "html" not in self._content_type(response):
                detail = " ".join(response.text.split())[:300]  # a plain-text error is one line
            else:
                detail = self._not_json(response, data)
            route = self._route_named()
            if response.status_code in (404, 405) and route:
                given = f"the address given is {self.base_url!r}"
                detail = f"{detail} ({given}: give the API's root, without /{route})"
            elif response.status_code == 404 and detail == "Not Found" and self._has_path():
                # The server's own 404 for a route it lacks, not the API's for a missing job or study.
                detail = f"{detail} (no such route under {self.base_url!r}: give the optlab API's root)"
            raise ApiError(response.status_code, detail)
        if not isinstance(data, dict):  # not the API answering: the address is another server's
            raise AddressError(
                f"HTTP {response.status_code}: {self._not_json(response, data)}: is {self.base_url!r} "
                "the optlab API's root?"
            )
        return data

    @staticmethod
    def _content_type(response: httpx.Response) -> str:
        return response.headers.get("content-type", "").split(";")[0].strip() or "no content type"

    def _not_json(self, response: httpx.Response, data: Any) -> str:
        """An answer this client cannot read, in one line: where, its status and what it was."""
        what = "a JSON " + type(data).__name__ if data is not None else self._content_type(response)
        url = redact_url(str(response.request.url))
        return f"{response.request.method} {url} answered {what}, not the API's JSON object"

    def _redirected(self, response: httpx.Response) -> str:
        """Where a redirect points, and the root to give instead (the location less the path asked)."""
        location = response.headers.get("location", "")
        target = str(response.request.url.join(location)) if location else ""
        asked = response.request.url.raw_path.decode("ascii", "replace")
        root = target[: -len(asked)] if asked and target.endswith(asked) else target
        shown = redact_url(str(response.request.url))
        if not root:
            return f"{shown} answered HTTP {response.status_code}, a redirect without a Location"
        return (
            f"{shown} answered HTTP {response.status_code}, a redirect to {redact_url(target)}: "
            f"give that address instead ({redact_url(root.rstrip('/'))})"
        )

    def _has_path(self) -> bool:
        return urlsplit(self.base_url).path.strip("/") != ""

    def _route_named(self) -> str | None:
        """The API's own route the address ends in (`--api http://host:8000/docs`), so that every path
        this client adds lands beside the API's, not on them; None where it ends in none."""
        last = self.base_url.rsplit("/", 1)[-1]
        return last if last in API_ROUTES else None

    def _not_connected(self, exc: httpx.ConnectError) -> ApiError:
        """No connection: refused (nothing listens there), or a TLS handshake that failed, which
        for an https:// address of a plain-HTTP server is an address to give as http://."""
        tls = _tls_error(exc)
        # Any other TLS error (a protocol version, a certificate) is a real HTTPS server's.
        plain_answer = tls is not None and (tls.reason or "") in PLAIN_HTTP_TLS_REASONS
        if not plain_answer or "://" not in self.base_url:
            return ApiError(0, f"cannot reach the optlab API at {self.base_url}; is `optlab serve` running?")
        plain = "http://" + self.base_url.split("://", 1)[1]
        return AddressError(
            f"the server at {self.base_url} did not speak TLS (the HTTPS handshake failed: "
            f"{tls.reason if tls is not None else ''}); if it serves plain HTTP, give {plain}"
        )

    def _unreachable(self, exc: Exception, attempts: int, key: str | None = None) -> str:
        said = f"cannot reach the optlab API at {self.base_url!r} ({type(exc).__name__}: {exc})"
        if key is None:
            return said
        return (
            f"{said}; sent {'once' if attempts == 1 else f'{attempts} times'} with {IDEMPOTENCY_KEY_HEADER} "
            f"{key}, and no answer came back: "
            f"it may have been stored all the same (GET {self.base_url}/jobs lists the newest first); "
            "sending it again with that key makes no second one"
        )
