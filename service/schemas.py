"""API schemas, kept apart from the ORM tables (after full-stack-fastapi-template)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from service.models import Job
from service.store import as_utc

JobStatus = Literal["queued", "running", "succeeded", "failed", "diverged", "cancelled"]


class MlflowLink(BaseModel):
    tracking_uri: str
    experiment_id: str
    run_id: str
    run_url: str


class Progress(BaseModel):
    step: int
    total: int
    fraction: float


class JobRead(BaseModel):
    id: int
    status: JobStatus
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    progress: Progress
    latest_loss: float | None
    spec: dict[str, Any]
    mlflow: MlflowLink | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    cancel_requested: bool

    @classmethod
    def from_row(cls, job: Job) -> JobRead:
        return cls(
            id=job.id,
            status=job.status,  # type: ignore[arg-type]
            created_at=as_utc(job.created_at),  # type: ignore[arg-type]
            updated_at=as_utc(job.updated_at),  # type: ignore[arg-type]
            started_at=as_utc(job.started_at),
            finished_at=as_utc(job.finished_at),
            attempt=job.attempt,
            progress=Progress(
                step=job.step,
                total=job.total_steps,
                fraction=round(job.step / job.total_steps, 4) if job.total_steps else 0.0,
            ),
            latest_loss=job.latest_loss,
            spec=job.spec,
            mlflow=MlflowLink(**job.mlflow) if job.mlflow else None,
            result=job.result,
            error=job.error,
            cancel_requested=job.cancel_requested,
        )


class JobsPage(BaseModel):
    items: list[JobRead]
    total: int
    limit: int
    offset: int


class Health(BaseModel):
    status: Literal["ok"]
    database: Literal["ok"]
    catalogue_published_at: datetime | None
    optimizers: int
