"""The job store: small keyword-only functions over a SQLAlchemy session.

Works on SQLite and PostgreSQL alike. Claiming uses `FOR UPDATE SKIP LOCKED` where the
database has it, and a conditional UPDATE everywhere, so two workers never run one job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from jobs.result import TERMINAL_STATUSES, ErrorRecord, JobResult, JobStatus, Progress
from jobs.spec import AnySpec, Catalogue, CheckSpec, default_style, framework_of_style
from service.models import CatalogueSnapshot, Job, utcnow


def as_utc(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything stored here is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def create_job(*, session: Session, spec: AnySpec, submitted_by: str | None = None) -> Job:
    """Queue a training job, or a check job (its progress counts checks instead of steps)."""
    job = job_row(spec=spec, submitted_by=submitted_by)
    session.add(job)
    session.commit()
    return job


def job_row(*, spec: AnySpec, submitted_by: str | None, study_id: int | None = None) -> Job:
    """A queued job, not yet added to a session (a study adds all of its jobs in one transaction)."""
    return Job(
        submitted_by=submitted_by,
        status=JobStatus.QUEUED,
        kind="check" if isinstance(spec, CheckSpec) else "train",
        spec=spec.model_dump(mode="json"),
        total_steps=spec.total_steps,
        step=0,
        attempt=0,
        cancel_requested=False,
        study_id=study_id,
    )


def count_queued(*, session: Session, submitted_by: str | None = None) -> int:
    """Queued jobs in total, or those one token name submitted."""
    query = select(func.count()).select_from(Job).where(Job.status == JobStatus.QUEUED)
    if submitted_by is not None:
        query = query.where(Job.submitted_by == submitted_by)
    return int(session.scalar(query) or 0)


def get_job(*, session: Session, job_id: int) -> Job | None:
    return session.get(Job, job_id)


def list_jobs(
    *,
    session: Session,
    status: JobStatus | None,
    limit: int,
    offset: int,
    kind: str | None = None,
    study_id: int | None = None,
) -> tuple[list[Job], int]:
    query = select(Job)
    count = select(func.count()).select_from(Job)
    if status is not None:
        query = query.where(Job.status == status)
        count = count.where(Job.status == status)
    if kind is not None:
        query = query.where(Job.kind == kind)
        count = count.where(Job.kind == kind)
    if study_id is not None:
        query = query.where(Job.study_id == study_id)
        count = count.where(Job.study_id == study_id)
    jobs = session.scalars(query.order_by(Job.id.desc()).limit(limit).offset(offset)).all()
    return list(jobs), int(session.scalar(count) or 0)


def latest_checks(*, session: Session, name: str, styles: Iterable[str]) -> dict[str, Job | None]:
    """Per style, the most recently finished check job of optimizer `name` whose checks ran.

    A check job succeeds whenever its checks ran (some may have failed), so `succeeded` is
    exactly "has a report". The spec is JSON: its path expressions work on SQLite and PostgreSQL.
    """
    named = (
        (Job.kind == "check")
        & (Job.status == JobStatus.SUCCEEDED)
        & (Job.spec[("optimizer", "name")].as_string() == name)
    )
    latest: dict[str, Job | None] = {}
    for style in styles:
        query = (
            select(Job)
            .where(named, _ran_style(style))
            .order_by(Job.finished_at.desc(), Job.id.desc())
            .limit(1)
        )
        latest[style] = session.scalars(query).first()
    return latest


def _ran_style(style: str) -> Any:
    """A job's spec ran `style`: it names it, or names none and `style` is its framework's default."""
    framework = framework_of_style(style)
    named = Job.spec[("optimizer", "style")].as_string()
    by_default = [named.is_(None)] if default_style(framework) == style else []
    return (Job.spec[("framework",)].as_string() == framework) & or_(named == style, *by_default)


def request_cancel(*, session: Session, job_id: int) -> Job | None:
    """A queued job is cancelled at once; a running one is flagged for its worker to stop.

    Conditional updates, not read-then-write: a worker claiming the job at the same moment
    either sees it cancelled or gets the flag, never neither.
    """
    cancelled = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .values(
            status=JobStatus.CANCELLED,
            finished_at=utcnow(),
            error=_error("Cancelled", "cancelled before it started"),
        )
    )
    if _rowcount(cancelled) == 0:
        session.execute(
            update(Job).where(Job.id == job_id, Job.status == JobStatus.RUNNING).values(cancel_requested=True)
        )
    session.commit()
    return session.get(Job, job_id, populate_existing=True)


def claim_next(*, session: Session, worker_id: str, lease_s: float) -> Job | None:
    """Take the oldest claimable job for `worker_id`, or None when there is none.

    Claimable: queued, or running under a lease that expired (its worker died without
    handing it back); such a job starts again as its next attempt. A stranded job whose
    cancellation was requested is cancelled instead.
    """
    now = utcnow()
    expired = (Job.status == JobStatus.RUNNING) & (Job.lease_expires_at < now)
    session.execute(
        update(Job)
        .where(expired, Job.cancel_requested.is_(True))
        .values(
            status=JobStatus.CANCELLED,
            finished_at=now,
            lease_expires_at=None,
            error=_error("Cancelled", "cancelled; its worker had stopped answering"),
        )
    )
    session.commit()
    claimable = (Job.status == JobStatus.QUEUED) | expired
    for _ in range(5):
        candidate = session.execute(
            select(Job.id, Job.status, Job.worker_id)
            .where(claimable)
            .order_by(Job.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if candidate is None:
            session.rollback()
            return None
        job_id, previous_status, previous_worker = candidate
        values: dict[str, Any] = {
            "status": JobStatus.RUNNING,
            "worker_id": worker_id,
            "attempt": Job.attempt + 1,
            "started_at": now,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "cancel_requested": False,
        }
        if previous_status == JobStatus.RUNNING:
            values["error"] = _error(
                "LeaseExpired", f"worker {previous_worker} stopped answering; the job was started again"
            )
        claimed = session.execute(update(Job).where(Job.id == job_id, claimable).values(**values))
        session.commit()
        if _rowcount(claimed) == 1:
            return session.get(Job, job_id, populate_existing=True)
    return None


def record_progress(
    *,
    session: Session,
    job_id: int,
    worker_id: str,
    progress: Progress | None,
    workdir: str | None,
    lease_s: float,
) -> bool:
    """Store progress (None: nothing new) and extend the lease; return whether the worker must
    stop the job (cancellation requested, or the job is no longer this worker's)."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.status is not JobStatus.RUNNING or job.worker_id != worker_id:
        session.rollback()
        return True
    if progress is not None:
        job.step = progress.step
        if _finite(progress.loss):
            job.latest_loss = progress.loss
        if progress.mlflow is not None:
            job.mlflow = progress.mlflow.to_json()
    if workdir is not None:
        job.workdir = workdir
    job.lease_expires_at = utcnow() + timedelta(seconds=lease_s)
    session.commit()
    return job.cancel_requested


def finish_job(
    *,
    session: Session,
    job_id: int,
    worker_id: str,
    status: JobStatus,
    result: JobResult | None,
    error: ErrorRecord | None,
) -> bool:
    """Record the outcome, if the job is still running under `worker_id`; return whether it was."""
    if status not in TERMINAL_STATUSES:
        allowed = ", ".join(sorted(TERMINAL_STATUSES))
        raise ValueError(f"finish_job needs a terminal status ({allowed}); received {status!r}")
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.status is not JobStatus.RUNNING or job.worker_id != worker_id:
        session.rollback()
        return False
    job.status = status
    job.result = None if result is None else result.to_json()
    job.error = None if error is None else error.to_json()
    job.finished_at = utcnow()
    job.lease_expires_at = None
    if result is not None:
        job.step = result.steps_completed or job.step
        job.mlflow = result.mlflow.to_json() if result.mlflow else job.mlflow
        if _finite(result.final_train_loss):
            job.latest_loss = result.final_train_loss
    session.commit()
    return True


def _finite(value: float | None) -> bool:
    """NaN and infinities stay out of latest_loss: JSON (the API's) has no such numbers."""
    return value is not None and math.isfinite(value)


def _error(type_: str, message: str) -> dict[str, Any]:
    """An error the store writes itself, in the shape of a job's (no traceback)."""
    return ErrorRecord(type=type_, message=message).to_json()


def requeue_job(*, session: Session, job_id: int, worker_id: str, reason: str) -> None:
    """Hand a running job back to the queue (its worker is stopping); the next claim retries it.

    A job whose cancellation was requested is cancelled instead.
    """
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.status is not JobStatus.RUNNING or job.worker_id != worker_id:
        session.rollback()
        return
    if job.cancel_requested:
        job.status = JobStatus.CANCELLED
        job.finished_at = utcnow()
        job.error = _error("Cancelled", "cancelled while its worker was stopping")
    else:
        job.status = JobStatus.QUEUED
        job.error = _error("Interrupted", reason)
    job.worker_id = None
    job.lease_expires_at = None
    session.commit()


def publish_catalogue(*, session: Session, worker_id: str, catalogue: dict[str, Any]) -> None:
    Catalogue.model_validate(catalogue)  # refuse to publish something the API cannot read
    snapshot = session.get(CatalogueSnapshot, worker_id)
    if snapshot is None:
        session.add(CatalogueSnapshot(worker_id=worker_id, data=catalogue, published_at=utcnow()))
    else:
        snapshot.data = catalogue
        snapshot.published_at = utcnow()
    session.commit()


def latest_catalogue(*, session: Session) -> tuple[Catalogue, datetime] | None:
    snapshot = session.scalars(
        select(CatalogueSnapshot).order_by(CatalogueSnapshot.published_at.desc()).limit(1)
    ).first()
    if snapshot is None:
        return None
    published = as_utc(snapshot.published_at)
    assert published is not None
    return Catalogue.model_validate(snapshot.data), published


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
