"""HTTP-level guards that run before any route: Host header, browser-forgeable writes, the body.

Plain ASGI middlewares, so a refused request never reaches parsing or the database, and every
refusal is JSON in the API's error shape, saying what was wrong and what is allowed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import READ_METHODS

# How deep a JSON body may nest: a spec needs 6 levels (body > optimizer > param_groups > group >
# match > ndim); Python's JSON parser would otherwise recurse until it raises RecursionError.
MAX_JSON_DEPTH = 32
# Paths an orchestrator's probe calls by IP (Kubernetes sends the pod's address as Host).
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


async def refuse(send: Send, status: int, detail: Any, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _header_count(scope: Scope, name: bytes) -> int:
    return sum(1 for key, _ in scope["headers"] if key == name)


def host_name(host_header: str) -> str:
    """`localhost:8000` -> `localhost`, `[::1]:8000` -> `::1`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        address, _, rest = host[1:].partition("]")
        # `[::1]evil.example` is no address and port: the whole header, which no pattern trusts.
        return address if rest == "" or (rest.startswith(":") and rest[1:].isdigit()) else host
    if host.count(":") == 1:  # a name and a port; anything else after the colon is no port
        name, port = host.split(":")
        return name if port.isdigit() else host
    return host


def host_allowed(host: str, trusted: list[str]) -> bool:
    for pattern in trusted:
        if pattern == "*" or host == pattern:
            return True
        # `*.lab.example` is every name under lab.example: `a.lab.example`, not `.lab.example`.
        if pattern.startswith("*.") and host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
            return True
    return False


class TrustedHosts:
    """Refuse a Host header not in OPTLAB_TRUSTED_HOSTS: a DNS-rebinding page reaches the API under
    the attacker's own name, and this is where that shows."""

    def __init__(self, app: ASGIApp, trusted: list[str]) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"host")
        if _header_count(scope, b"host") > 1:  # which one a proxy or a framework reads differs
            await refuse(send, 400, "the request has more than one Host header; send one")
            return
        if header is None or not host_allowed(host_name(header), self.trusted):
            shown = "none" if header is None else repr(header[:100])
            await refuse(
                send,
                400,
                f"Host header {shown} is not a trusted host; allowed: {', '.join(self.trusted)} "
                "(OPTLAB_TRUSTED_HOSTS)",
            )
            return
        await self.app(scope, receive, send)


def is_json_media_type(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserWriteGuard:
    """A state-changing request must carry a token or a JSON content type.

    A cross-site HTML form can POST (cancel takes no body, so no CORS preflight stops it), but it
    can send neither an Authorization header nor `application/json`: requiring one of them makes
    forged writes impossible even on an open, localhost-only API. With tokens configured every
    write needs the header anyway, and a request without it gets the 401 that says so.
    """

    def __init__(
        self, app: ASGIApp, enabled: bool = True, routed: Callable[[str, str], bool] | None = None
    ) -> None:
        """`routed(method, path)`: whether a route takes the request; one no route takes is let
        through, for the router's 404 or 405 (a forged one reaches nothing)."""
        self.app = app
        self.enabled = enabled
        self.routed = routed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or scope["method"] in READ_METHODS:
            await self.app(scope, receive, send)
            return
        if self.routed is not None and not self.routed(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type")
        if _header(scope, b"authorization") is None and not is_json_media_type(content_type):
            shown = "none" if content_type is None else repr(content_type[:100])
            await refuse(
                send,
                415,
                f"{scope['method']} requests need `Content-Type: application/json` (received {shown}) "
                "or an Authorization header, so that a web page cannot forge them",
            )
            return
        await self.app(scope, receive, send)


class InFlightLimit:
    """At most `limit` requests inside the application at once; the rest wait here, in the event
    loop, holding nothing, and one that cannot start within `wait_s` gets 503 with Retry-After.

    Each request inside holds at most one database connection, and the pool has `limit` of them
    (service.db), so a request never waits for a connection that only a waiting request could
    release. Past its capacity the API answers late or says so (503), never with an error. The
    probes pass freely: they must answer while the API is busy (the pool has room for them).
    """

    RETRY_AFTER_S = 1

    def __init__(self, app: ASGIApp, limit: int, wait_s: float) -> None:
        self.app = app
        self.limit = limit
        self.wait_s = wait_s
        self.slots = asyncio.Semaphore(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.wait_s):
                await self.slots.acquire()
        except TimeoutError:
            await refuse(
                send,
                503,
                f"the API is at capacity: {self.limit} requests were in progress for the {self.wait_s:g} s "
                f"this one waited; retry in {self.RETRY_AFTER_S} s",
                {"Retry-After": str(self.RETRY_AFTER_S)},
            )
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.release()


class BodyGuard:
    """Bodies over `max_bytes` get 413 before anything parses them (chunked ones too); a JSON body
    that is not UTF-8 or nests deeper than MAX_JSON_DEPTH gets a 422 naming that, and a compressed
    one a 415."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        encoding = _header(scope, b"content-encoding")
        if (
            encoding is not None
            and encoding.strip().lower() not in ("", "identity")
            and scope["method"] not in READ_METHODS
        ):
            # Nothing here decodes one: a gzip body was told it was "not valid UTF-8 (byte 0x8b)".
            await refuse(
                send,
                415,
                f"Content-Encoding {encoding[:50]!r} is not accepted: send the JSON body uncompressed",
            )
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send, size)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_body_problem(body) if body and scope["method"] not in READ_METHODS else None
        if problem is not None:
            await refuse(send, 422, [{"loc": ["body"], "msg": problem, "type": "json_invalid"}])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await refuse(
            send,
            413,
            f"request body is {size} bytes or more; at most {self.max_bytes} bytes "
            "are accepted (OPTLAB_MAX_BODY_BYTES)",
        )


def json_body_problem(body: bytes) -> str | None:
    """Why `body` cannot be a JSON request body the API reads, for the two cases FastAPI would
    answer with a bare 400: bytes that are not UTF-8, and nesting deep enough to exhaust recursion."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            f"the body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start}); "
            "JSON bodies must be UTF-8"
        )
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _too_deep(text):
        return f"the body nests JSON arrays and objects deeper than {MAX_JSON_DEPTH} levels"
    key = _key_given_twice(text) if "{" in text else None
    if key is not None:
        return f"the body gives the key {key!r} twice in one JSON object; give each key once"
    return None


def _key_given_twice(text: str) -> str | None:
    """The first key a JSON object in `text` gives twice: Python's parser, as FastAPI's, keeps the
    last value silently (`{"lr": 0.1, "lr": 0.2}` trained at 0.2), where the CLI refuses the same
    file. A second parse of a body of at most OPTLAB_MAX_BODY_BYTES, only for bodies with an object;
    a body that is no JSON is left to FastAPI to word."""
    twice: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if not twice and len(items) > 1:
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    twice.append(key)
                    break
                seen.add(key)
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except ValueError:
        return None
    return twice[0] if twice else None


def _too_deep(text: str) -> bool:
    """Whether `text` nests arrays and objects deeper than MAX_JSON_DEPTH (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return True
        elif char in "]}":
            depth -= 1
    return False
