"""The FastAPI application. Never imports torch or TensorFlow (a test asserts it)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.spec import CheckSpec, JobSpec
from service import store
from service.db import make_engine, migrate, session_factory
from service.deps import SessionDep
from service.routes import catalogue, checks, jobs
from service.schemas import Health
from service.settings import Settings

log = logging.getLogger("optlab.api")


def create_app(settings: Settings | None = None, *, run_migrations: bool = True) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.resolved_database_url)
    if run_migrations:
        migrate(engine)
    app = FastAPI(
        title="optlab",
        summary="Train, checkpoint-verify and compare custom optimizers.",
        version="0.1.0",
    )
    app.state.settings = settings
    app.state.sessions = session_factory(engine)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.include_router(jobs.router)
    app.include_router(checks.router)
    app.include_router(catalogue.router)

    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz(session: SessionDep) -> Health:
        session.execute(text("SELECT 1"))
        found = store.latest_catalogue(session=session)
        return Health(
            status="ok",
            database="ok",
            catalogue_published_at=found[1] if found else None,
            optimizers=len(found[0].optimizers) if found else 0,
        )

    return app


class BodySizeLimit:
    """Refuse bodies over `max_bytes` with 413 before anything parses them (chunked ones too)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
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
                await self._refuse(send, size)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: int) -> None:
        body = json.dumps(
            {
                "detail": f"request body is {size} bytes or more; at most {self.max_bytes} bytes "
                "are accepted (OPTLAB_MAX_BODY_BYTES)"
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 shape, with messages that name the field, what is allowed and what came."""
    detail = []
    for error in exc.errors():
        loc = list(error.get("loc", ()))
        kind = error.get("type", "value_error")
        field = ".".join(str(part) for part in loc[1:]) or "body"
        message = f"{field}: {error.get('msg', 'invalid')}"
        ctx = error.get("ctx") or {}
        if kind == "json_invalid":
            loc = ["body"]
            message = f"the body is not valid JSON ({ctx.get('error', 'decode error')})"
        elif kind == "finite_number":
            loc.append(ctx["key"])
            message = f"{field}.{error['msg']}"
        elif kind == "extra_forbidden":
            allowed = _allowed_fields(BODY_MODELS.get(request.url.path.rstrip("/"), JobSpec), loc[1:-1])
            message = f"unknown field {field!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif "input" in error and kind != "missing" and "received" not in message:
            message += f"; received {_short(error['input'])}"
        detail.append({"loc": loc, "msg": message, "type": kind})
    return JSONResponse(status_code=422, content={"detail": detail})


def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(status_code=500, content={"detail": "internal error; see the API log"})


# The body model of each route that takes one, to say which fields an unknown one could have been.
BODY_MODELS: dict[str, type[BaseModel]] = {"/jobs": JobSpec, "/checks": CheckSpec}


def _allowed_fields(model: type[BaseModel], parent: list[Any]) -> list[str]:
    for part in parent:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _short(value: Any, limit: int = 120) -> str:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= limit else shown[:limit] + "..."
