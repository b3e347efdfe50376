"""The study store: a study row and its jobs, written together; the worker's claims on a study."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from datetime import timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from jobs.result import JobStatus
from jobs.spec import JobSpec, StudyMember, StudySpec
from service import store
from service.idempotency import IdempotentRequest
from service.models import Job, Study, utcnow

ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)


def create_study(
    *,
    session: Session,
    spec: StudySpec,
    jobs: list[tuple[StudyMember, JobSpec]],
    submitted_by: str | None,
    idempotency: IdempotentRequest | None = None,
) -> Study:
    """The study and every one of its jobs in one transaction: all of them or, on any error, none;
    with the `Idempotency-Key` of the request that made it, if it had one."""
    try:
        study = Study(
            name=spec.name,
            spec=spec.model_dump(mode="json"),
            members=[],
            submitted_by=submitted_by,
            cancel_requested=False,
        )
        session.add(study)
        session.flush()
        rows = [store.job_row(spec=job, submitted_by=submitted_by, study_id=study.id) for _, job in jobs]
        session.add_all(rows)
        session.flush()
        study.members = [
            {"job_id": row.id, **member.model_dump(mode="json")}
            for row, (member, _) in zip(rows, jobs, strict=True)
        ]
        if idempotency is not None:
            idempotency.remember(session, study=study)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return study


def get_study(*, session: Session, study_id: int) -> Study | None:
    return session.get(Study, study_id, populate_existing=True)


def list_studies(
    *, session: Session, limit: int, offset: int, before_id: int | None = None
) -> tuple[list[Study], int]:
    """A page of studies, newest first (`before_id`: older than that one only), and how many there are."""
    query = select(Study) if before_id is None else select(Study).where(Study.id < before_id)
    studies = session.scalars(query.order_by(Study.id.desc()).limit(limit).offset(offset)).all()
    return list(studies), int(session.scalar(select(func.count()).select_from(Study)) or 0)


def study_jobs(*, session: Session, study_id: int) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.study_id == study_id).order_by(Job.id)).all())


def member_of(study: Study, job_id: int) -> StudyMember | None:
    for member in study.members:
        if member["job_id"] == job_id:
            return StudyMember.model_validate({k: v for k, v in member.items() if k != "job_id"})
    return None


class NothingToCancel(Exception):
    """The study has no job left to cancel (the route's 409); the message says how its jobs ended."""


def cancel_study(*, session: Session, study_id: int, by: str | None = None) -> Study | None:
    """Queued jobs are cancelled at once, running ones flagged for their workers (as a job's cancel).

    None for no such study; NothingToCancel when it has no job left to cancel (`_flag_cancel`).
    """
    if session.get(Study, study_id) is None:
        return None
    if not _flag_cancel(session=session, study_id=study_id):
        raise _nothing_to_cancel(session=session, study_id=study_id)
    for job in study_jobs(session=session, study_id=study_id):
        if job.status in ACTIVE:
            store.request_cancel(session=session, job_id=job.id, by=by)
    return get_study(session=session, study_id=study_id)


def _flag_cancel(*, session: Session, study_id: int) -> bool:
    """Flag the study cancelled if a job of it is still queued or running, or a cancel was already
    flagged (a retry, answered as a cancelled job's is); whether it was.

    One conditional update, so a study whose jobs have all ended, being summarized, is never flagged.
    A cancel racing its last job's end can still flag it just before that job succeeds: the
    finalizer judges the parent run's end by the jobs' own ends (`finalize.parent_run_status`).
    """
    active = select(Job.id).where(Job.study_id == Study.id, Job.status.in_(ACTIVE)).exists()
    flagged = session.execute(
        update(Study)
        .where(Study.id == study_id, Study.finalized_at.is_(None), or_(Study.cancel_requested, active))
        .values(cancel_requested=True)
    )
    session.commit()
    return int(getattr(flagged, "rowcount", 0) or 0) == 1


def _nothing_to_cancel(*, session: Session, study_id: int) -> NothingToCancel:
    """Why a study has no job left to cancel. Decided here, not in the route: only the conditional
    update knows, at the moment it runs, that no job was left."""
    study = get_study(session=session, study_id=study_id)
    if study is not None and study.finalized_at is not None:
        return NothingToCancel(f"study {study_id} has already ended")
    jobs = study_jobs(session=session, study_id=study_id)
    ends = Counter(job.status.value for job in jobs)
    said = ", ".join(f"{status} {count}" for status, count in sorted(ends.items()))
    return NothingToCancel(
        f"study {study_id} has no job left to cancel: its {len(jobs)} jobs have all ended ({said}) "
        "and its summary is being made"
    )


def set_parent_run(*, session: Session, study_id: int, experiment_id: str, run_id: str) -> str | None:
    """Record the parent run unless another worker already did; return the one recorded."""
    session.execute(
        update(Study)
        .where(Study.id == study_id, Study.parent_run_id.is_(None))
        .values(experiment_id=experiment_id, parent_run_id=run_id)
    )
    session.commit()
    study = get_study(session=session, study_id=study_id)
    return None if study is None else study.parent_run_id


def claim_study_to_finalize(*, session: Session, lease_s: float) -> Study | None:
    """An ended study (no job queued or running) not yet summarized, claimed for `lease_s`: one
    finalizer at a time; a finalizer that died leaves the claim to expire and the next one redoes it."""
    now = utcnow()
    unfinished = select(Job.id).where(Job.study_id == Study.id, Job.status.in_(ACTIVE)).exists()
    free = or_(Study.finalizing_until.is_(None), Study.finalizing_until < now)
    candidate = session.scalars(
        select(Study.id).where(Study.finalized_at.is_(None), free, ~unfinished).order_by(Study.id).limit(1)
    ).first()
    if candidate is None:
        session.rollback()
        return None
    claimed = session.execute(
        update(Study)
        .where(Study.id == candidate, Study.finalized_at.is_(None), free)
        # A note left by a finalizer that stopped mid-way is no longer true: this one says its own.
        .values(finalizing_until=now + timedelta(seconds=lease_s), summary_waiting=None)
    )
    session.commit()
    if int(getattr(claimed, "rowcount", 0) or 0) != 1:
        return None
    return get_study(session=session, study_id=candidate)


def record_summary(
    *,
    session: Session,
    study_id: int,
    summary: dict[str, Any],
    report_html: str,
    not_in_mlflow: str | None = None,
) -> None:
    """The study is done; `not_in_mlflow`: why its parent run does not hold the summary (deleted),
    kept as its `summary_error`, a summary recorded all the same."""
    session.execute(
        update(Study)
        .where(Study.id == study_id)
        .values(
            summary=summary,
            report_html=report_html,
            finalized_at=utcnow(),
            finalizing_until=None,
            finalize_error=not_in_mlflow,
            summary_waiting=None,
        )
    )
    session.commit()


def renew_finalize_claim(*, session: Session, study_id: int, lease_s: float) -> None:
    """The claim on a study whose summary is still being made, for `lease_s` more."""
    session.execute(
        update(Study)
        .where(Study.id == study_id, Study.finalized_at.is_(None))
        .values(finalizing_until=utcnow() + timedelta(seconds=lease_s))
    )
    session.commit()


def release_finalize_claims(*, session: Session, study_ids: Collection[int]) -> None:
    """Claims a stopping worker gives back, its summaries unfinished: the next worker makes them at
    once, not once the claims expire."""
    if not study_ids:
        return
    session.execute(
        update(Study)
        .where(Study.id.in_(list(study_ids)), Study.finalized_at.is_(None))
        .values(finalizing_until=None, summary_waiting=None)
    )
    session.commit()


def record_summary_waiting(*, session: Session, study_id: int, note: str | None) -> None:
    """What a summary still being made waits on; None once it no longer waits."""
    session.execute(
        update(Study).where(Study.id == study_id, Study.finalized_at.is_(None)).values(summary_waiting=note)
    )
    session.commit()


def record_finalize_error(*, session: Session, study_id: int, error: str, retry_s: float) -> None:
    """The summary could not be made (MLflow unreachable, say): shown, and tried again after `retry_s`.
    Never on a study done meanwhile (a worker that stopped gave it back, and another made it)."""
    session.execute(
        update(Study)
        .where(Study.id == study_id, Study.finalized_at.is_(None))
        .values(
            finalize_error=error[-4000:],
            summary_waiting=None,
            finalizing_until=utcnow() + timedelta(seconds=retry_s),
        )
    )
    session.commit()
