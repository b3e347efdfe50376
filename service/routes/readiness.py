"""`GET /readyz`: may this API take work now? Apart from `/healthz` (the process is alive).

Ready means: the job store answers and its schema is at the latest migration, the MLflow tracking
server answers its `/health`, and a worker has published the optimizer catalogue. An orchestrator
(compose's healthcheck, a load balancer) sends no traffic before that; the answer says what is
missing. Like `/healthz` it needs no token and is served whatever the Host header says.
"""

from __future__ import annotations

import httpx
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from service import store
from service.db import MIGRATIONS
from service.deps import SessionDep, SettingsDep
from service.secrets import redact_url

router = APIRouter(tags=["health"])

MLFLOW_TIMEOUT_S = 2.0


class Condition(BaseModel):
    ok: bool
    detail: str = Field(description="what was found, or what is missing and how to bring it")


class Readiness(BaseModel):
    """Each condition of readiness; `missing` names those not met (empty when ready)."""

    ready: bool
    database: Condition
    mlflow: Condition
    catalogue: Condition
    missing: list[str]


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "not ready: `missing` says what is not there yet"}},
)
def readyz(session: SessionDep, settings: SettingsDep) -> Readiness | JSONResponse:
    """200 when the database is migrated and reachable, MLflow answers and a catalogue is
    published; 503 with the same body otherwise (no token needed)."""
    conditions = {
        "database": database_condition(session),
        "mlflow": mlflow_condition(settings.mlflow_tracking_uri),
        "catalogue": catalogue_condition(session, within_s=settings.lease_s),
    }
    missing = [name for name, condition in conditions.items() if not condition.ok]
    readiness = Readiness(ready=not missing, missing=missing, **conditions)
    if missing:
        return JSONResponse(status_code=503, content=readiness.model_dump(mode="json"))
    return readiness


def database_condition(session: Session) -> Condition:
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    try:
        session.execute(text("SELECT 1"))
        current = MigrationContext.configure(session.connection()).get_current_revision()
    except SQLAlchemyError as exc:
        session.rollback()
        return Condition(ok=False, detail=f"the job store does not answer: {type(exc).__name__}")
    if current != head:
        return Condition(
            ok=False,
            detail=f"the job store's schema is at {current or 'no revision'}, not {head}: "
            "it is being migrated (`optlab api` and `optlab worker` migrate at start)",
        )
    return Condition(ok=True, detail=f"reachable, schema at {head}")


def mlflow_condition(tracking_uri: str) -> Condition:
    shown = redact_url(tracking_uri)
    try:
        response = httpx.get(f"{tracking_uri}/health", timeout=MLFLOW_TIMEOUT_S)
    except httpx.HTTPError as exc:
        reason = type(exc).__name__
        return Condition(ok=False, detail=f"the MLflow server at {shown} does not answer ({reason})")
    if response.status_code != 200:
        return Condition(ok=False, detail=f"the MLflow server at {shown} answered {response.status_code}")
    return Condition(ok=True, detail=f"{shown} answers")


def catalogue_condition(session: Session, *, within_s: float) -> Condition:
    try:
        found = store.latest_catalogue(session=session, within_s=within_s)
    except SQLAlchemyError as exc:
        session.rollback()
        return Condition(ok=False, detail=f"cannot read the catalogue: {type(exc).__name__}")
    if found is None:
        return Condition(ok=False, detail="no worker has published the optimizer catalogue yet")
    optimizers, published_at = len(found.catalogue.optimizers), found.published_at
    return Condition(ok=True, detail=f"{optimizers} optimizers, published {published_at.isoformat()}")
