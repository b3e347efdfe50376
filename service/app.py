"""The FastAPI application. Never imports torch or TensorFlow (a test asserts it)."""

from __future__ import annotations

import json
import logging
import sys
import typing
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import exc as sql_errors
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match, Route, compile_path

from jobs.spec import CheckSpec, JobSpec, StudySpec
from service import store
from service.auth import authorize
from service.db import REQUESTS_AT_ONCE, make_engine, migrate, session_factory
from service.deps import SessionDep
from service.guards import BodyGuard, BrowserWriteGuard, InFlightLimit, TrustedHosts, is_json_media_type
from service.openapi import install as install_openapi
from service.query_params import KnownQueryOnly
from service.quotas import SubmissionQueue
from service.routes import catalogue, checks, jobs, readiness, studies
from service.schemas import Health, responses
from service.secrets import keep_process_private, redact_url
from service.settings import Settings, token_names

log = logging.getLogger("optlab.api")
# How long a request may wait for one of the REQUESTS_AT_ONCE places before it gets 503.
WAIT_FOR_A_PLACE_S = 5.0
# What a client is told to wait when the store was too busy to answer (503).
STORE_BUSY_RETRY_S = 1


def create_app(settings: Settings | None = None, *, run_migrations: bool = True) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.resolved_database_url)
    if run_migrations:
        migrate(engine)
    app = FastAPI(
        title="optlab",
        summary="Train, checkpoint-verify and compare custom optimizers.",
        version="0.1.0",
        # Served by service.openapi: the document behind a token, the docs page with the token.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.sessions = session_factory(engine)
    app.state.catalogues = store.CatalogueCache(within_s=settings.lease_s)
    app.state.submissions = SubmissionQueue(app.state.sessions, settings)
    # Outermost last: the Host header first, then forged browser writes, then the body itself,
    # then a place among the requests in progress.
    app.add_middleware(InFlightLimit, limit=REQUESTS_AT_ONCE, wait_s=WAIT_FOR_A_PLACE_S)
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        BrowserWriteGuard,
        enabled=not settings.tokens,
        routed=lambda method, path: routed(app, method, path),
    )
    app.add_middleware(TrustedHosts, trusted=settings.trusted_host_names)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_exception_handler(sql_errors.OperationalError, _store_error)
    app.add_exception_handler(sql_errors.TimeoutError, _store_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    # Every router needs a token (when tokens are configured); only the probes (/healthz, below,
    # and /readyz) and the docs page (a static page that asks for the token) do not.
    # Every route refuses a query parameter it does not declare (after the token check).
    for router in (jobs.router, checks.router, studies.router, catalogue.router):
        app.include_router(router, dependencies=[Depends(authorize), KnownQueryOnly])
    app.include_router(readiness.router, dependencies=[KnownQueryOnly], responses=responses(422))
    log_access_mode(settings)
    redact_access_log()
    install_openapi(app)

    @app.get(
        "/healthz",
        response_model=Health,
        tags=["health"],
        dependencies=[KnownQueryOnly],
        responses=responses(422),
    )
    def healthz(session: SessionDep) -> Health:
        """Alive (a liveness probe): 200 while the process answers, saying how the job store is. A
        store that does not answer is no reason to restart this process (`/readyz` says not ready)."""
        try:
            session.execute(text("SELECT 1"))
            found = app.state.catalogues.latest(session=session)
        except sql_errors.SQLAlchemyError as exc:
            return Health(
                status="ok",
                database=f"does not answer ({type(getattr(exc, 'orig', None) or exc).__name__})",
                catalogue_published_at=None,
                optimizers=0,
            )
        return Health(
            status="ok",
            database="ok",
            catalogue_published_at=found.published_at if found else None,
            optimizers=len(found.catalogue.optimizers) if found else 0,
        )

    return app


class RedactedAccessLog(logging.Filter):
    """uvicorn's access line with credential-like query values as *** (`GET /jobs?token=***`): a
    token sent in the URL by mistake is refused, and must not be written down either."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_url(args[2]), *args[3:])
        return True


def redact_access_log() -> None:
    """Once per process (an app built again in it, as tests do, adds nothing)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactedAccessLog) for f in access.filters):
        access.addFilter(RedactedAccessLog())


def create_private_app() -> FastAPI:
    """`create_app` for a process of `optlab api --workers N` (started afresh, so not private from
    its parent): kept private first, as `optlab api` is (service.secrets.keep_process_private)."""
    keep_process_private()
    return create_app()


def log_access_mode(settings: Settings) -> None:
    """Say plainly at start-up who can use this API (names and scopes, never a token)."""
    if not settings.tokens:
        log.warning(
            "access control is OFF: OPTLAB_API_TOKENS is not set, so anyone who can reach this API "
            "can submit, cancel and read every job; it must listen on localhost only"
        )
        return
    log.info("access control is on: bearer tokens required (%s)", token_names(settings.tokens))
    log.info("trusted hosts: %s", ", ".join(settings.trusted_host_names))


# Pydantic's error for a body that is not an object: what a JSON body arrives as when its request
# says it is something else (FastAPI reads the body as JSON only under a JSON content type).
_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 shape, with messages that name the field, what is allowed and what came."""
    errors = list(exc.errors())
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type) and any(
        list(e.get("loc", ())) == ["body"] and e.get("type") in _NOT_AN_OBJECT for e in errors
    ):
        # A body sent as text/plain (or with no content type) had been told it "should be a valid
        # dictionary", quoting the very JSON object it was.
        shown = "none" if content_type is None else repr(content_type[:100])
        message = f"send the body as JSON, with `Content-Type: application/json` (received {shown})"
        return JSONResponse(status_code=415, content={"detail": message})
    detail = []
    for error in _merged_unions(errors, getattr(exc, "body", None)):
        loc = list(error.get("loc", ()))
        kind = error.get("type", "value_error")
        field = ".".join(str(part) for part in loc[1:]) or "body"
        said = str(error.get("msg", "invalid"))
        # A validator's own words may name the field already (`optimizer.needs: unknown need 'foo'`).
        message = said if said.startswith(f"{field}: ") else f"{field}: {said}"
        ctx = error.get("ctx") or {}
        if kind == "json_invalid":
            loc = ["body"]
            message = f"the body is not valid JSON ({ctx.get('error', 'decode error')})"
        elif loc[1:] == ["steps"] and kind == "less_than_equal":
            # The schema's bound is the 32-bit one; the server's own cap is the one to name.
            cap = request.app.state.settings.max_steps
            message = f"steps must be at most {cap} (OPTLAB_MAX_STEPS); received {_short(error.get('input'))}"
        elif (
            kind
            in ("finite_number", "number_too_large", "number_too_small", "empty_grid", "repeated_grid_value")
            and "key" in ctx
        ):
            # Our own validators' errors, which name the key within the field (pydantic's own
            # `allow_inf_nan=False` raises `finite_number` too, without one: the branch below).
            loc.append(ctx["key"])
            message = f"{field}.{error['msg']}"
        elif loc[:1] == ["header"] and kind == "string_pattern_mismatch":
            message = (
                f"{field} must be printable ASCII, without a space at either end (a UUID is one); "
                f"received {_short(_header_as_sent(error.get('input')))}"
            )
        elif loc[:1] == ["query"] and kind in ("extra_forbidden", "repeated_query_parameter"):
            message = error["msg"]  # service.query_params words it: the parameter (and the allowed ones)
        elif kind == "extra_forbidden":
            allowed = _allowed_fields(BODY_MODELS.get(request.url.path.rstrip("/"), JobSpec), loc[1:-1])
            message = f"unknown field {field!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif "input" in error and kind != "missing" and "received" not in message:
            message += f"; received {_short(error['input'])}"
        detail.append({"loc": loc, "msg": message, "type": kind})
    return JSONResponse(status_code=422, content={"detail": detail})


def _header_as_sent(value: object) -> object:
    """A header value as its client wrote it: Starlette decodes header bytes as Latin-1, so UTF-8
    `café` arrives as `cafÃ©`, which an echo of it should not show."""
    if not isinstance(value, str):
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def _unreadable_body(cause: ValueError) -> JSONResponse:
    """A body `json.loads` refused with other than a JSONDecodeError (which FastAPI reports as a 422
    itself): "There was an error parsing the body" said nothing of which rule it broke."""
    why = str(cause)
    if "integer string conversion" in why:  # Python's guard against quadratic-time int parsing
        why = f"a number has more than {sys.get_int_max_str_digits()} digits"
    detail = [{"loc": ["body"], "msg": f"the body is not valid JSON ({why})", "type": "json_invalid"}]
    return JSONResponse(status_code=422, content={"detail": detail})


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own answer, but a 405's Allow header lists the methods of every route on the path
    (Starlette names only the first route that matched it: `OPTIONS /jobs` said POST, not GET)."""
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):  # FastAPI could not parse the body
        return _unreadable_body(exc.__cause__)
    if exc.status_code == 405:
        allowed = allowed_methods(request.app, request.url.path)
        exc = StarletteHTTPException(
            405,
            detail=f"{request.method} is not allowed here; allowed: {', '.join(allowed)}",
            headers={"Allow": ", ".join(allowed)},
        )
    return await http_exception_handler(request, exc)


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the app's routes take at `path` (a 405's Allow): the document's paths, and the
    routes left out of it (the document itself, /docs)."""
    methods: set[str] = set()
    for template, item in app.openapi()["paths"].items():
        if compile_path(template)[0].match(path):
            methods.update(method.upper() for method in item)
    for route in app.router.routes:
        if isinstance(route, Route) and not route.include_in_schema and route.path_regex.match(path):
            methods.update(route.methods or ())
    return sorted(methods)


def routed(app: FastAPI, method: str, path: str) -> bool:
    """Whether a route of the app takes `method` at `path`, as the router matches it (no store
    asked: the write guard asks this of every write)."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)


def _store_error(request: Request, exc: Exception) -> JSONResponse:
    """The store too busy to answer in time (SQLite's lock past its busy timeout, no free pool
    connection), or not answering at all (PostgreSQL down, refusing connections, or dropping them),
    is 503 with Retry-After: the client did nothing wrong and may simply retry (`optlab submit
    --wait` does). Any other database error is the unexpected 500 it was."""
    if _store_busy(exc):
        said = "is busy"
    elif store_unreachable(exc):
        said = "does not answer"
    else:
        return _unexpected_error(request, exc)
    log.warning("503 on %s %s: the job store %s: %s", request.method, request.url.path, said, exc)
    return JSONResponse(
        status_code=503,
        content={"detail": f"the job store {said}; retry in {STORE_BUSY_RETRY_S} s"},
        headers={"Retry-After": str(STORE_BUSY_RETRY_S)},
    )


# What drivers say of a connection that failed or was dropped (psycopg, SQLite's file gone).
_UNREACHABLE = (
    "connection failed",
    "could not connect",
    "connection refused",
    "server closed the connection",
    "terminating connection",
    "does not allow connections",
    "not currently accepting connections",
    "the database system is starting up",
    "the database system is shutting down",
    "unable to open database file",
)


def store_unreachable(exc: Exception) -> bool:
    """Whether a database error says the store cannot be reached, not that a statement failed."""
    if getattr(exc, "connection_invalidated", False):  # SQLAlchemy's own reading: a disconnect
        return True
    message = str(getattr(exc, "orig", exc)).lower()
    return any(words in message for words in _UNREACHABLE)


def _store_busy(exc: Exception) -> bool:
    if isinstance(exc, sql_errors.TimeoutError):
        return True
    message = str(getattr(exc, "orig", exc)).lower()
    return "database is locked" in message or "database table is locked" in message


def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(status_code=500, content={"detail": "internal error; see the API log"})


# The body model of each route that takes one, to say which fields an unknown one could have been.
BODY_MODELS: dict[str, type[BaseModel]] = {"/jobs": JobSpec, "/checks": CheckSpec, "/studies": StudySpec}


# What a union member's tag in pydantic's error location stands for, in words.
_FORMS = {"bool": "a boolean", "int": "a number", "float": "a number", "str": "a string", "none": "null"}


def _merged_unions(errors: list[Any], body: Any) -> list[Any]:
    """A value that fits no member of a union gets one error per member, each located by a type tag
    (`lr.bool`, `lr.int`, ..., `lr.list[nullable[union[bool,int,float,str]]]`): these become one
    error at the field saying what it may be. Where the value is an object and one member is a model
    it reached (`match.GroupMatch.ndim`), that member's own errors are the ones meant: kept, untagged."""
    grouped: dict[Any, list[tuple[int, Any]]] = {}
    for number, error in enumerate(errors):
        loc = tuple(error.get("loc", ()))
        # Only a body's locations hold tags: a header's is its name (`Idempotency-Key`, capitalised).
        tagged = _tag_index(loc, body) if loc[:1] == ("body",) else None
        grouped.setdefault(number if tagged is None else loc[:tagged], []).append((tagged or 0, error))
    merged = []
    for key, members in grouped.items():
        merged += [members[0][1]] if isinstance(key, int) else _one_union_error(list(key), members)
    return merged


def _one_union_error(loc: list[Any], members: list[tuple[int, Any]]) -> list[Any]:
    reached = [
        {**error, "loc": [*error["loc"][:i], *error["loc"][i + 1 :]]}
        for i, error in members
        if str(error["loc"][i])[0].isupper() and len(error["loc"]) > i + 1  # inside the model
    ]
    if reached:
        return reached
    forms = list(dict.fromkeys(_form(error["loc"][i]) for i, error in members))
    said = forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"
    return [{"loc": loc, "type": "union_type", "msg": f"must be {said}", "input": members[0][1].get("input")}]


def _tag_index(loc: tuple[Any, ...], body: Any) -> int | None:
    """Where a union member's tag is in `loc`: the first part that is not a key of the request's data
    (a hyperparameter may be called `K` or `bool`) and reads as a tag."""
    current = body
    for index, part in enumerate(loc[1:], start=1):
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            current = current[part]
        else:
            return index if _is_tag(part) else None
    return None


def _is_tag(part: Any) -> bool:
    """Reads as pydantic's tag of a union member: a type's name, a generic, or a model's class."""
    return isinstance(part, str) and (part in _FORMS or "[" in part or part[:1].isupper())


def _form(tag: str) -> str:
    if tag in _FORMS:
        return _FORMS[tag]
    if tag.startswith("literal["):
        return tag[len("literal[") : -1].replace(",", " or")
    if tag.startswith(("list[", "tuple[")):
        return "a list of them"
    return "an object"


def _allowed_fields(model: type[BaseModel], parent: list[Any]) -> list[str]:
    """The fields of the model at `parent` (a list item's, an optional one's); [] where unsure."""
    for part in parent:
        if isinstance(part, int):
            continue  # an item of a list: the list's field named its model
        field = model.model_fields.get(str(part))
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds: itself, or the one in `X | None` or `list[X]`; None for a
    union of models (which one the body meant is not known here) or none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = {m for m in map(_model_in, typing.get_args(annotation)) if m is not None}
    return models.pop() if len(models) == 1 else None


def _short(value: Any, limit: int = 120) -> str:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= limit else shown[:limit] + "..."
