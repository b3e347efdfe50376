"""ORM tables. API schemas live in `service.schemas`; these are storage only."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobs.result import JobStatus


def utcnow() -> datetime:
    return datetime.now(UTC)


class StatusColumn(TypeDecorator[JobStatus]):
    """A `JobStatus` stored as its bare string (VARCHAR(16), as the migrations made it): no
    migration, and a value that is no status fails on write or read instead of spreading."""

    impl = String(16)
    cache_ok = True

    def process_bind_param(self, value: JobStatus | str | None, dialect: Dialect) -> str | None:
        return None if value is None else JobStatus(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> JobStatus | None:
        return None if value is None else JobStatus(value)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    status: Mapped[JobStatus] = mapped_column(StatusColumn(), index=True)
    # "train" (a JobSpec) or "check" (a CheckSpec: the conformance checks on one optimizer).
    kind: Mapped[str] = mapped_column(String(16), index=True, default="train", server_default="train")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # Times it was queued again after its process was killed from outside (OPTLAB_JOB_RETRIES caps it).
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Every attempt that ended, oldest first: a service.schemas.AttemptRecord each.
    attempt_history: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list, server_default="[]")
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer)
    latest_loss: Mapped[float | None] = mapped_column(Float)
    mlflow: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    workdir: Mapped[str | None] = mapped_column(String(1000))
    # The name (never the secret) of the API token that submitted it; None on an open API.
    submitted_by: Mapped[str | None] = mapped_column(String(64), index=True)
    # The name of the token whose cancel (of the job, or of its study) came first; None on an open API.
    cancelled_by: Mapped[str | None] = mapped_column(String(64))
    # The study it belongs to (POST /studies); None for a job submitted on its own.
    study_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("studies.id"), index=True)
    # The last verified checkpoint progress reported (a reference any worker can load): a new
    # attempt resumes from it, in the MLflow run `mlflow.run_id` names.
    checkpoint_step: Mapped[int | None] = mapped_column(Integer)
    checkpoint_ref: Mapped[str | None] = mapped_column(String(2000))
    # What holds the running attempt up, as its progress says (its tracking server not answering);
    # None while it goes on, and cleared when it ends or is claimed again.
    waiting: Mapped[str | None] = mapped_column(Text)


class CatalogueSnapshot(Base):
    """The optimizer catalogue as a worker's job environment produced it (one row per worker)."""

    __tablename__ = "catalogue"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    published_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Study(Base):
    """A study (optimizers x grid points x seeds); its jobs are rows of `jobs` with its `study_id`.

    The worker creates its MLflow parent run before its first job and, once every job has ended,
    computes the summary once: `finalizing_until` is that claim's lease, `finalized_at` its end.
    """

    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Per job: {"job_id", "optimizer" (the entry's label), "grid" (its grid values), "seed"}.
    members: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    submitted_by: Mapped[str | None] = mapped_column(String(64), index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # The MLflow experiment and parent run, set once by the worker that starts its first job.
    experiment_id: Mapped[str | None] = mapped_column(String(64))
    parent_run_id: Mapped[str | None] = mapped_column(String(64))
    finalizing_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalized_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)
    finalize_error: Mapped[str | None] = mapped_column(Text)
    # What a summary still being made waits on (MLflow not answering), said while it waits.
    summary_waiting: Mapped[str | None] = mapped_column(Text)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    report_html: Mapped[str | None] = mapped_column(Text)


class WorkerRow(Base):
    """A worker and what it can run; it claims only jobs that fit, and the API refuses devices
    no live worker offers. Live: seen within one lease."""

    __tablename__ = "workers"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    frameworks: Mapped[list[str]] = mapped_column(JSON)  # those its catalogue has optimizers for
    devices: Mapped[list[str]] = mapped_column(JSON)  # kinds: ["cpu"] or ["cpu", "cuda"]
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    slots: Mapped[int] = mapped_column(Integer, default=1)
    catalogue_sha256: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    # Why it claims no job now (its disk is full); None while it claims. Kept by its heartbeat.
    not_claiming: Mapped[str | None] = mapped_column(Text)


class IdempotencyKey(Base):
    """A submission's `Idempotency-Key` and what it created: the same key and request again get
    that job or study back instead of a second one (a client retrying after a timeout).

    Keys are scoped by the submitting token's name ('' on an open API) and kept as long as the
    store is: jobs and studies are never deleted.
    """

    __tablename__ = "idempotency_keys"

    scope: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # sha256 of the route and the validated request body: the same key with another request is refused.
    request_sha256: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("jobs.id"))
    study_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("studies.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
