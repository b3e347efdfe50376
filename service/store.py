"""The job store: small keyword-only functions over a SQLAlchemy session.

Works on SQLite and PostgreSQL alike. Claiming uses `FOR UPDATE SKIP LOCKED` where the
database has it, and a conditional UPDATE everywhere, so two workers never run one job.
A job's attempt number fences every worker write: progress, heartbeat, outcome and requeue
are conditional UPDATEs on (id, attempt, worker); one that matches no row means the lease is
gone (another attempt exists), and the worker stops its job process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, bindparam, case, false, func, or_, select, update
from sqlalchemy.orm import Session

from jobs.result import TERMINAL_STATUSES, AttemptRecord, ErrorRecord, JobResult, JobStatus, Progress
from jobs.spec import STYLES_OF_FRAMEWORK, AnySpec, Catalogue, CheckSpec, default_style, framework_of_style
from service.capabilities import JobNeeds, OfferedOptimizers, needs_of, optimizers_named
from service.db import submission_lock
from service.models import CatalogueSnapshot, Job, WorkerRow, utcnow


class Lease(StrEnum):
    """What a fenced write (or read) learnt about the worker's hold on a job."""

    HELD = "held"
    CANCEL = "cancel"  # held, and cancellation was requested
    LOST = "lost"  # another attempt exists, or the job ended: stop the job process at once


@dataclass(frozen=True)
class ClaimFilter:
    """What a worker can take now: its frameworks, its free slots (GPU slots among them) and the
    optimizers its own catalogue has (None: not known yet, any)."""

    frameworks: tuple[str, ...]
    free_slots: int
    free_gpu_slots: int
    optimizers: OfferedOptimizers | None = None
    # All its slots, busy or free (None: unknown, no slots are kept for an older job that needs more).
    slots: int | None = None
    gpu_slots: int = 0

    def when_idle(self) -> ClaimFilter | None:
        """What the worker could take with every slot free; None where its slots are unknown."""
        if self.slots is None:
            return None
        return replace(self, free_slots=self.slots, free_gpu_slots=self.gpu_slots)

    def leaving_room_for(self, needs: JobNeeds) -> ClaimFilter | None:
        """What younger jobs may take while an older one that needs more slots than are free waits
        for them: none of the slots it waits on (the GPU ones for a `cuda` job, so CPU jobs still run
        beside it; every slot otherwise). None: nothing."""
        if needs.gpu and self.free_slots > self.free_gpu_slots:
            return replace(self, free_slots=self.free_slots - self.free_gpu_slots, free_gpu_slots=0)
        return None


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


def count_queued_of(*, session: Session, names: Iterable[str]) -> dict[str, int]:
    """Queued jobs of each of these token names, in one query (a name with none is absent)."""
    query = (
        select(Job.submitted_by, func.count())
        .where(Job.status == JobStatus.QUEUED, Job.submitted_by.in_(sorted(set(names))))
        .group_by(Job.submitted_by)
    )
    return {str(name): int(count) for name, count in session.execute(query).all()}


def get_job(*, session: Session, job_id: int) -> Job | None:
    return session.get(Job, job_id)


def list_jobs(
    *,
    session: Session,
    status: JobStatus | str | Sequence[JobStatus] | None,
    limit: int,
    offset: int,
    kind: str | None = None,
    study_id: int | None = None,
    before_id: int | None = None,
    experiment: str | None = None,
    optimizer: str | None = None,
) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match; `status`: one or any of several; `before_id`:
    older than that job only (a cursor), counted among those that match all the same.
    `experiment` and `optimizer` (its name) are read from the spec: its JSON path expressions work on
    SQLite and PostgreSQL, as in `latest_checks`, without an index (a filter, not a hot path)."""
    matching: list[ColumnElement[bool]] = []
    if status is not None:
        statuses = [status] if isinstance(status, str) else list(status)
        matching.append(Job.status.in_(statuses))
    if kind is not None:
        matching.append(Job.kind == kind)
    if study_id is not None:
        matching.append(Job.study_id == study_id)
    if experiment is not None:
        matching.append(Job.spec["experiment"].as_string() == experiment)
    if optimizer is not None:
        matching.append(Job.spec[("optimizer", "name")].as_string() == optimizer)
    older = [Job.id < before_id] if before_id is not None else []
    query = select(Job).where(*matching, *older).order_by(Job.id.desc()).limit(limit).offset(offset)
    count = select(func.count()).select_from(Job).where(*matching)
    return list(session.scalars(query).all()), int(session.scalar(count) or 0)


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


def request_cancel(*, session: Session, job_id: int, by: str | None = None) -> Job | None:
    """A queued job is cancelled at once; a running one is flagged for its worker to stop.

    Conditional updates, not read-then-write: a worker claiming the job at the same moment
    either sees it cancelled or gets the flag, never neither. A job queued to run again keeps
    `cancel_requested` once cancelled: its MLflow run, which an earlier attempt left open for the
    next, is a worker's to end (`runs_left_open`). `by`: the name of the token that asked, kept as
    `cancelled_by` unless an earlier cancel's is there.
    """
    cancelled_by = func.coalesce(Job.cancelled_by, by)
    cancelled = 0
    for ran, message in (
        (False, "cancelled before it started"),
        (True, "cancelled while queued to run again (its earlier attempts: attempt_history)"),
    ):
        cancelled += _rowcount(
            session.execute(
                update(Job)
                .where(
                    Job.id == job_id,
                    Job.status == JobStatus.QUEUED,
                    Job.attempt > 0 if ran else Job.attempt == 0,
                )
                .values(
                    status=JobStatus.CANCELLED,
                    finished_at=utcnow(),
                    error=_error("Cancelled", message),
                    cancel_requested=ran,
                    cancelled_by=cancelled_by,
                )
            )
        )
    if cancelled == 0:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.RUNNING)
            .values(cancel_requested=True, cancelled_by=cancelled_by)
        )
        # One whose worker stopped answering ends now: it had waited, running, for a worker to start.
        _cancel_stranded(session, Job.id == job_id, utcnow())
    session.commit()
    return session.get(Job, job_id, populate_existing=True)


def runs_left_open(*, session: Session) -> list[tuple[int, str]]:
    """(job id, MLflow run id) of each job cancelled while queued to run again, whose run no attempt
    will end now (`request_cancel`); `run_closed` takes a job off this list."""
    rows = session.execute(
        select(Job.id, Job.mlflow).where(Job.status == JobStatus.CANCELLED, Job.cancel_requested.is_(True))
    ).all()
    session.rollback()
    return [(row.id, str(row.mlflow["run_id"])) for row in rows if (row.mlflow or {}).get("run_id")]


def run_closed(*, session: Session, job_id: int) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=False))
    session.commit()


def _fits(fits: ClaimFilter) -> Any:
    """SQL for "this worker can run it now", over the stored spec JSON (absent keys: defaults)."""
    framework = func.coalesce(Job.spec[("framework",)].as_string(), "torch")
    # A check job has no device: one slot of either kind, as `auto` (JobNeeds).
    device = func.coalesce(Job.spec[("device",)].as_string(), "auto")
    slots = func.coalesce(Job.spec[("distribution", "devices")].as_integer(), 1)
    free_cpu_slots = fits.free_slots - fits.free_gpu_slots
    one_kind = (slots <= free_cpu_slots) | (slots <= fits.free_gpu_slots)
    gpu, cpu = device.like("cuda%"), device == "cpu"
    fitting = framework.in_(fits.frameworks) & (
        (gpu & (slots <= fits.free_gpu_slots)) | (cpu & (slots <= fits.free_slots)) | (~gpu & ~cpu & one_kind)
    )
    return fitting if fits.optimizers is None else fitting & _offers_optimizers(framework, fits.optimizers)


def _offers_optimizers(framework: Any, offered: OfferedOptimizers) -> Any:
    """SQL for "the worker's catalogue has the job's optimizer, and its wrapper's base if it names one,
    for the job's framework". Left unclaimed, a job another worker's plugin offers waits for that
    worker (claimed here, it had failed as an unknown optimizer). A check job too: it names a
    catalogue's optimizer as a training job does (a class in a file is checked locally only)."""

    # The style the job runs: the one its spec names (the API stores it resolved), else its framework's first.
    first = case(*((framework == f, default_style(f)) for f in STYLES_OF_FRAMEWORK), else_=None)

    def has(choice: tuple[str, ...]) -> Any:
        name = Job.spec[(*choice, "name")].as_string()
        style = func.coalesce(Job.spec[(*choice, "style")].as_string(), first)
        offers = [(style == s) & name.in_(sorted(names)) for s, names in offered.items()]
        return or_(false(), *offers)

    base = Job.spec[("optimizer", "base", "name")].as_string()
    return has(("optimizer",)) & (base.is_(None) | has(("optimizer", "base")))


def _cancel_stranded(session: Session, which: Any, now: datetime) -> None:
    """Cancel the running jobs `which` selects whose worker stopped answering (their lease expired):
    no attempt of theirs is live to stop, and none may write once they are cancelled (the fence). Their
    attempt ends in the history as the lease expired; `cancel_requested` stays, so that a worker ends
    the MLflow run the attempt left open (`runs_left_open`)."""
    stranded = (Job.status == JobStatus.RUNNING) & (Job.lease_expires_at < now) & which
    rows = session.execute(select(Job.id, *RUNNING_ATTEMPT).where(stranded).with_for_update()).all()
    reason = "its worker stopped answering (its lease expired), and it was cancelled meanwhile"
    for row in rows:
        session.execute(
            update(Job)
            .execution_options(synchronize_session=False)  # SQLite's naive datetimes: no in-Python evaluation
            .where(Job.id == row.id, stranded)
            .values(
                status=JobStatus.CANCELLED,
                finished_at=now,
                lease_expires_at=None,
                cancel_requested=True,
                error=_error("Cancelled", "cancelled; its worker had stopped answering"),
                attempt_history=RunningAttempt.of(row).ended("lease expired", reason, now),
            )
        )
    session.commit()


def claim_next(
    *, session: Session, worker_id: str, lease_s: float, fits: ClaimFilter | None = None
) -> Job | None:
    """Take the oldest claimable job for `worker_id`, or None when there is none.

    Claimable: queued, or running under a lease that expired (its worker died without
    handing it back); such a job starts again as its next attempt. A stranded job whose
    cancellation was requested is cancelled instead.
    """
    now = utcnow()
    expired = (Job.status == JobStatus.RUNNING) & (Job.lease_expires_at < now)
    _cancel_stranded(session, Job.cancel_requested.is_(True), now)
    claimable = (Job.status == JobStatus.QUEUED) | expired
    if fits is not None:
        fits = _keeping_slots_for_the_oldest(session, claimable, fits)
        if fits is None:
            session.rollback()
            return None
    runnable = claimable if fits is None else claimable & _fits(fits)
    for _ in range(5):
        candidate = session.execute(
            select(Job.id, Job.status, Job.checkpoint_step, *RUNNING_ATTEMPT)
            .where(runnable)
            .order_by(Job.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if candidate is None:
            session.rollback()
            return None
        job_id, previous_status, previous_worker = candidate.id, candidate.status, candidate.worker_id
        values: dict[str, Any] = {
            "status": JobStatus.RUNNING,
            "worker_id": worker_id,
            "attempt": Job.attempt + 1,
            "started_at": now,
            "lease_expires_at": now + timedelta(seconds=lease_s),
            "cancel_requested": False,
            "waiting": None,
            # Where this attempt starts: its checkpoint's step, or 0. The last attempt's step had stood
            # until this one reported, and an attempt that reported nothing was recorded as reaching it.
            "step": func.coalesce(Job.checkpoint_step, 0),
        }
        if previous_status == JobStatus.RUNNING:
            how = (
                "from the start"
                if candidate.checkpoint_step is None
                else (f"from its checkpoint of step {candidate.checkpoint_step}")
            )
            reason = f"worker {previous_worker} stopped answering; another attempt took the job over, {how}"
            values["error"] = _error("LeaseExpired", reason)
            values["attempt_history"] = RunningAttempt.of(candidate).ended("lease expired", reason, now)
        claimed = session.execute(
            update(Job)
            .execution_options(synchronize_session=False)
            .where(Job.id == job_id, claimable)
            .values(**values)
        )
        session.commit()
        if _rowcount(claimed) == 1:
            return session.get(Job, job_id, populate_existing=True)
    return None


def _keeping_slots_for_the_oldest(session: Session, claimable: Any, fits: ClaimFilter) -> ClaimFilter | None:
    """`fits`, or less where the oldest job this worker could run with all its slots does not fit its
    free ones now (a DDP job needing 2 slots while 1 is busy): younger jobs then take none of the slots
    it waits on, or a steady stream of single-slot jobs would overtake it for ever (a probe saw one
    wait for every later job). None: the worker claims nothing now."""
    idle = fits.when_idle()
    if idle is None or (fits.free_slots, fits.free_gpu_slots) == (idle.free_slots, idle.free_gpu_slots):
        return fits  # every slot free: what fits when idle fits now (and a claim costs no more query)
    oldest = session.execute(
        select(Job.id, Job.spec, _fits(fits).label("fits_now"))
        .where(claimable & _fits(idle))
        .order_by(Job.id)
        .limit(1)
    ).first()
    if oldest is None or oldest.fits_now:
        return fits
    return fits.leaving_room_for(needs_of(oldest.spec))


def _fenced(job_id: int, worker_id: str, attempt: int) -> Any:
    return (
        (Job.id == job_id)
        & (Job.attempt == attempt)
        & (Job.worker_id == worker_id)
        & (Job.status == JobStatus.RUNNING)
    )


def record_progress(
    *,
    session: Session,
    job_id: int,
    worker_id: str,
    attempt: int,
    progress: Progress | None,
    workdir: str | None,
    lease_s: float,
    resumed_from: int | None = None,
) -> Lease:
    """Store progress (None: nothing new) and renew the lease, fenced by `attempt`; `resumed_from`:
    the checkpoint step the attempt resumes from, the least step it shows."""
    values: dict[str, Any] = {"lease_expires_at": utcnow() + timedelta(seconds=lease_s)}
    if progress is not None:
        # A resumed attempt reports step 0 until its checkpoint is loaded: shown from the checkpoint.
        values["step"] = max(progress.step, resumed_from or 0)
        values["waiting"] = progress.waiting
        if _finite(progress.loss):
            values["latest_loss"] = progress.loss
        if progress.mlflow is not None:
            values["mlflow"] = progress.mlflow.to_json()
        checkpoint = progress.checkpoint  # the last verified one: a new attempt resumes from it
        if checkpoint is not None and checkpoint.ok:
            values["checkpoint_step"], values["checkpoint_ref"] = checkpoint.step, checkpoint.path
    if workdir is not None:
        values["workdir"] = workdir
    updated = session.execute(
        update(Job)
        .where(_fenced(job_id, worker_id, attempt))
        .values(**values)
        .returning(Job.cancel_requested)
    ).first()
    session.commit()
    if updated is None:
        return Lease.LOST
    return Lease.CANCEL if updated[0] else Lease.HELD


def lease_of(*, session: Session, job_id: int, worker_id: str, attempt: int) -> Lease:
    """The worker's hold on the job, read only (between heartbeats: no write)."""
    row = session.execute(select(Job.cancel_requested).where(_fenced(job_id, worker_id, attempt))).first()
    session.rollback()
    if row is None:
        return Lease.LOST
    return Lease.CANCEL if row[0] else Lease.HELD


def finish_job(
    *,
    session: Session,
    job_id: int,
    worker_id: str,
    attempt: int,
    status: JobStatus,
    result: JobResult | None,
    error: ErrorRecord | None,
    step: int | None = None,
) -> bool:
    """Record the outcome if `attempt` of the job still runs under `worker_id`; return whether it did.

    `step`: the last step the job reported, for an outcome whose result does not say (a cancelled,
    failed or killed job's), so its progress and history agree with its error's "at step N"."""
    if status not in TERMINAL_STATUSES:
        allowed = ", ".join(sorted(TERMINAL_STATUSES))
        raise ValueError(f"finish_job needs a terminal status ({allowed}); received {status!r}")
    values: dict[str, Any] = {
        "status": status,
        "result": None if result is None else result.to_json(),
        "error": None if error is None else error.to_json(),
        "finished_at": utcnow(),
        "lease_expires_at": None,
        "waiting": None,
    }
    if step is not None:
        values["step"] = step
    if result is not None:
        if result.steps_completed:
            values["step"] = result.steps_completed
        elif result.diverged_at_step is not None:  # ahead of the last progress report, in a short job
            values["step"] = max(values.get("step") or 0, result.diverged_at_step)
        if result.mlflow:
            values["mlflow"] = result.mlflow.to_json()
        if _finite(result.final_train_loss):
            values["latest_loss"] = result.final_train_loss
    fenced = _fenced(job_id, worker_id, attempt)
    running = _running_attempt(session, fenced)
    if running is None:
        session.rollback()
        return False
    if values.get("step") is not None:
        # Never below what the attempt showed: one that failed before loading its checkpoint last
        # reported step 0, while its row showed the checkpoint it resumed from (record_progress).
        values["step"] = max(values["step"], running.step)
    why = None if error is None else error.message
    values["attempt_history"] = running.ended(
        status.value, why, values["finished_at"], step=values.get("step")
    )
    finished = session.execute(update(Job).where(fenced).values(**values))
    session.commit()
    return _rowcount(finished) == 1


def _finite(value: float | None) -> bool:
    """NaN and infinities stay out of latest_loss: JSON (the API's) has no such numbers."""
    return value is not None and math.isfinite(value)


def _error(type_: str, message: str) -> dict[str, Any]:
    """An error the store writes itself, in the shape of a job's (no traceback)."""
    return ErrorRecord(type=type_, message=message).to_json()


@dataclass(frozen=True)
class RunningAttempt:
    """A job's running attempt as its row holds it, and the job's history of attempts that ended."""

    attempt: int
    worker_id: str | None
    started_at: datetime | None
    step: int
    history: list[dict[str, Any]]

    @classmethod
    def of(cls, row: Any) -> RunningAttempt:
        """From a row with the columns RUNNING_ATTEMPT names."""
        history = list(row.attempt_history or [])
        return cls(row.attempt, row.worker_id, as_utc(row.started_at), row.step or 0, history)

    def ended(
        self, how: str, reason: str | None, at: datetime, step: int | None = None
    ) -> list[dict[str, Any]]:
        """The history with this attempt appended, ended `at`: how (a status, `interrupted`, `lease
        expired`), why, and at which step (default: the last one it reported)."""
        record = AttemptRecord(
            attempt=self.attempt,
            worker_id=self.worker_id,
            started_at=self.started_at,
            ended_at=at,
            step=self.step if step is None else step,
            ended=how,
            reason=reason,
        )
        return [*self.history, record.model_dump(mode="json")]


RUNNING_ATTEMPT = (Job.attempt, Job.worker_id, Job.started_at, Job.step, Job.attempt_history)


def _running_attempt(session: Session, fenced: Any) -> RunningAttempt | None:
    """The attempt `fenced` selects (None: not this worker's any more), its row locked on PostgreSQL
    until the caller's update rewrites the history."""
    row = session.execute(select(*RUNNING_ATTEMPT).where(fenced).with_for_update()).first()
    return None if row is None else RunningAttempt.of(row)


def requeue_job(
    *, session: Session, job_id: int, worker_id: str, attempt: int, reason: str, retry: bool = False
) -> bool:
    """Hand a running job back to the queue (its worker is stopping; `retry`: its process was killed
    from outside, counted in `retries`); the next claim resumes it.

    The error it is left with is `reason` and where it will run again from: the last verified
    checkpoint the store holds for it (what the next claim resumes from), or the start. A job whose
    cancellation was requested is cancelled instead. Fenced: False when `attempt` was no longer
    this worker's.
    """
    fenced = _fenced(job_id, worker_id, attempt)
    running = _running_attempt(session, fenced)
    if running is None:
        session.rollback()
        return False
    checkpoint_step = session.execute(select(Job.checkpoint_step).where(fenced)).scalar()
    how = "from the start" if checkpoint_step is None else f"from its checkpoint of step {checkpoint_step}"
    # Its own cause: not always its worker stopping (a job process killed from outside is retried).
    cancelled = f"cancelled as its attempt ended ({reason})"
    reason = f"{reason}; it will run again {how}"
    now = utcnow()
    released = {"worker_id": None, "lease_expires_at": None, "waiting": None}
    handed_back = session.execute(
        update(Job)
        .where(fenced & Job.cancel_requested.is_(True))
        .values(
            status=JobStatus.CANCELLED,
            finished_at=now,
            error=_error("Cancelled", cancelled),
            attempt_history=running.ended(JobStatus.CANCELLED.value, cancelled, now),
            **released,
        )
    )
    if _rowcount(handed_back) == 0:  # not cancelled: back to the queue
        handed_back = session.execute(
            update(Job)
            .where(fenced)
            .values(
                status=JobStatus.QUEUED,
                error=_error("Interrupted", reason),
                retries=Job.retries + int(retry),
                attempt_history=running.ended("interrupted", reason, now),
                **released,
            )
        )
    session.commit()
    return _rowcount(handed_back) == 1


def publish_catalogue(*, session: Session, worker_id: str, catalogue: dict[str, Any]) -> None:
    Catalogue.model_validate(catalogue)  # refuse to publish something the API cannot read
    # Under the submission lock: a batch of submissions checks that its catalogue is the latest
    # and commits under it too (service.quotas), so no publication lands in between.
    with submission_lock(session):
        snapshot = session.get(CatalogueSnapshot, worker_id)
        if snapshot is None:
            session.add(CatalogueSnapshot(worker_id=worker_id, data=catalogue, published_at=utcnow()))
        else:
            snapshot.data = catalogue
            snapshot.published_at = utcnow()
        session.commit()


# The snapshots a catalogue is made of: the worker that published each, and when, by worker id.
CatalogueVersion = tuple[tuple[str, datetime], ...]

# Newest first, ties (two workers in one microsecond) broken the same way by every query.
_NEWEST_FIRST = (CatalogueSnapshot.published_at.desc(), CatalogueSnapshot.worker_id.desc())
# Built once: a statement is immutable, and building it costs more than running it.
_NEWEST_CATALOGUE = (
    select(CatalogueSnapshot.worker_id, CatalogueSnapshot.published_at).order_by(*_NEWEST_FIRST).limit(1)
)
_LIVE_CATALOGUES = (
    select(CatalogueSnapshot.worker_id, CatalogueSnapshot.published_at)
    .join(WorkerRow, WorkerRow.worker_id == CatalogueSnapshot.worker_id)
    .where(WorkerRow.last_seen >= bindparam("since"))
)


def catalogue_version(*, session: Session, within_s: float) -> CatalogueVersion | None:
    """Which snapshots the API validates against (a few bytes each, not their 40 KB of JSON): those
    of the workers live within `within_s` (`live_workers`), so a job is accepted for an optimizer a
    live worker offers, whichever published last, and not for one only a stopped worker had. With
    none live (an API started before its workers, every worker gone) the newest snapshot of any, as
    a job may wait for a worker to come; None before any was published."""
    since = utcnow() - timedelta(seconds=within_s)
    live = session.execute(_LIVE_CATALOGUES, {"since": since}).all()
    if live:
        # Sorted here, as `_load_catalogue` sorts what it read: the database's collation may order
        # worker ids otherwise (ICU's en-US puts `worker-a` before `Worker-b`), and two versions of one
        # catalogue had never compared equal (every submission retried, then refused with a 503).
        return tuple(sorted((row.worker_id, row.published_at) for row in live))
    newest = session.execute(_NEWEST_CATALOGUE).first()
    return None if newest is None else ((newest.worker_id, newest.published_at),)


@dataclass(frozen=True)
class PublishedCatalogue:
    """A catalogue, validated (the union of the snapshots it is made of), with its version."""

    catalogue: Catalogue
    version: CatalogueVersion

    @property
    def published_at(self) -> datetime:
        """When the newest of its snapshots was published."""
        published = as_utc(max(when for _, when in self.version))
        assert published is not None
        return published


def latest_catalogue(*, session: Session, within_s: float) -> PublishedCatalogue | None:
    """The catalogue `catalogue_version` names, read and merged; None before any was published."""
    version = catalogue_version(session=session, within_s=within_s)
    return None if version is None else _load_catalogue(session, version, within_s)


def _load_catalogue(
    session: Session, version: CatalogueVersion, within_s: float
) -> PublishedCatalogue | None:
    snapshots = [session.get(CatalogueSnapshot, worker, populate_existing=True) for worker, _ in version]
    found = [snapshot for snapshot in snapshots if snapshot is not None]
    if len(found) < len(version):  # a worker's row went in between: read what is latest now
        return latest_catalogue(session=session, within_s=within_s)
    found.sort(key=lambda snapshot: (as_utc(snapshot.published_at), snapshot.worker_id), reverse=True)
    catalogues = [Catalogue.model_validate(snapshot.data) for snapshot in found]
    actual = tuple(sorted((snapshot.worker_id, snapshot.published_at) for snapshot in found))
    return PublishedCatalogue(catalogue_union(catalogues), actual)


def catalogue_union(catalogues: Sequence[Catalogue]) -> Catalogue:
    """Everything any of `catalogues` has, newest first: where two have the same optimizer (name,
    framework and style), schedule or workload, the first one's entry is kept; load errors of all."""
    if len(catalogues) == 1:
        return catalogues[0]
    optimizers = _first_of_each(catalogues, "optimizers", lambda o: (o["name"], o["framework"], o["style"]))
    schedules = _first_of_each(catalogues, "schedules", lambda s: s["name"])
    workloads = _first_of_each(catalogues, "workloads", lambda w: w["name"])
    errors = _first_of_each(catalogues, "errors", lambda e: tuple(sorted(e.items())))
    return Catalogue(optimizers=optimizers, schedules=schedules, workloads=workloads, errors=errors)


def _first_of_each(catalogues: Sequence[Catalogue], field: str, key: Callable[[Any], Hashable]) -> list[Any]:
    kept: dict[Hashable, Any] = {}
    for catalogue in catalogues:
        for entry in getattr(catalogue, field):
            kept.setdefault(key(entry), entry)
    return list(kept.values())


class CatalogueCache:
    """The catalogue the API validates against (`catalogue_version`), read and validated once per
    change.

    A snapshot is about 40 KB of JSON: decoding and validating it took over a millisecond, on
    every submission. `latest` asks only which snapshots make it up and reloads them when that
    changed (a worker published, started or stopped), so a catalogue published a moment ago is
    seen at once. `cached` asks nothing: its callers check the version where it matters (see
    `service.deps.submit_validated`). Shared by the API's threads; `Catalogue` is read-only.
    `within_s`: the lease within which a worker is live (the API's settings).
    """

    def __init__(self, *, within_s: float) -> None:
        self.within_s = within_s
        self._latest: PublishedCatalogue | None = None

    def cached(self) -> PublishedCatalogue | None:
        """The catalogue last loaded, without asking the store (None before the first load)."""
        return self._latest

    def latest(self, *, session: Session) -> PublishedCatalogue | None:
        version = catalogue_version(session=session, within_s=self.within_s)
        if version is None:
            return None
        cached = self._latest  # one read: another thread may replace it meanwhile
        if cached is not None and cached.version == version:
            return cached
        loaded = _load_catalogue(session, version, self.within_s)
        self._latest = loaded
        return loaded


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


def register_worker(
    *,
    session: Session,
    worker_id: str,
    frameworks: list[str],
    devices: list[str],
    gpus: int,
    slots: int,
    catalogue_sha256: str,
) -> None:
    """Advertise (or update) what a worker can run; `touch_worker` keeps it live."""
    now = utcnow()
    row = session.get(WorkerRow, worker_id)
    if row is None:
        row = WorkerRow(worker_id=worker_id, started_at=now)
        session.add(row)
    row.frameworks, row.devices, row.gpus, row.slots = frameworks, devices, gpus, slots
    row.catalogue_sha256, row.last_seen = catalogue_sha256, now
    session.commit()


def touch_worker(*, session: Session, worker_id: str, not_claiming: str | None = None) -> None:
    """The worker is live; `not_claiming`: why it claims no job now (None: it claims)."""
    session.execute(
        update(WorkerRow)
        .where(WorkerRow.worker_id == worker_id)
        .values(last_seen=utcnow(), not_claiming=not_claiming)
    )
    session.commit()


def worker_stopped(*, session: Session, worker_id: str) -> None:
    """A worker that stopped is not live from now on (`live_workers`), not only once its lease passed."""
    session.execute(
        update(WorkerRow)
        .where(WorkerRow.worker_id == worker_id)
        .values(last_seen=datetime(1970, 1, 1, tzinfo=UTC))
    )
    session.commit()


def live_workers(*, session: Session, within_s: float) -> list[WorkerRow]:
    """Workers seen within `within_s` seconds (a lease: a dead one is gone from here as fast as its jobs)."""
    since = utcnow() - timedelta(seconds=within_s)
    return list(session.scalars(select(WorkerRow).where(WorkerRow.last_seen >= since)).all())


def waiting_reason(
    *, session: Session, job: Job, within_s: float, catalogues: CatalogueCache | None = None
) -> str | None:
    """Why a queued job is not running, when no live worker can run it; None: it waits its turn.
    A running job: what holds it up, as its progress says (None: nothing does); one whose lease
    expired (its worker died) waits to be taken over as a queued one waits to start, and is told so
    where no live worker can take it (a DDP job's 2 slots after its 2-slot worker was replaced by a
    1-slot one). `catalogues`: the API's cache of what live workers offer (None: read from the store)."""
    lease = as_utc(job.lease_expires_at)
    stranded = job.status is JobStatus.RUNNING and lease is not None and lease < utcnow()
    if job.status is JobStatus.RUNNING and not stranded:
        return job.waiting
    if job.status is not JobStatus.QUEUED and not stranded:
        return None
    workers = live_workers(session=session, within_s=within_s)
    if not workers:
        return "waiting for a worker: none is running (none was seen in the last lease)"
    needs = needs_of(job.spec)
    if not any(needs.framework in w.frameworks for w in workers):
        offered = sorted({f for w in workers for f in w.frameworks})
        return f"no live worker runs {needs.framework} jobs (live workers run: {', '.join(offered)})"
    largest = largest_offer(workers, needs)
    if needs.gpu and largest == 0:
        return f"needs a GPU (device {job.spec.get('device')!r}); no live worker has one"
    if needs.slots > largest:
        return (
            f"needs {needs.slots} {'GPU ' if needs.gpu else ''}slots"
            f"{' of one kind (GPU or CPU-only)' if not needs.gpu and not needs.mixes else ''} "
            "(distribution.devices); "
            f"the largest live worker has {largest}"
        )
    able = [w for w in workers if needs.framework in w.frameworks]
    if all(w.not_claiming for w in able):  # the disk of each that could run it is full, say
        said = "; ".join(f"worker {w.worker_id}: {w.not_claiming}" for w in able[:3])
        more = f" (and {len(able) - 3} more)" if len(able) > 3 else ""
        return f"no live worker that could run it claims jobs now: {said}{more}"
    return _unoffered_optimizer(session, job, workers, catalogues or CatalogueCache(within_s=within_s))


def _unoffered_optimizer(
    session: Session, job: Job, workers: Sequence[WorkerRow], catalogues: CatalogueCache
) -> str | None:
    """Why a queued job (training or check) waits when no live worker's catalogue has its optimizer (or its
    wrapper's base): each worker claims only what its own has (`_fits`); None where one has them."""
    published = catalogues.latest(session=session)
    live = {worker.worker_id for worker in workers}
    if published is None or not live & {worker for worker, _ in published.version}:
        return None  # no live worker's catalogue to judge by: `catalogue_version` fell back
    framework = needs_of(job.spec).framework
    for name, style in optimizers_named(job.spec):
        if published.catalogue.optimizer(name, framework, style) is None:
            return (
                f"no live worker offers optimizer {name!r} for {framework} jobs (its plugin is missing "
                "or failed to load where workers run: GET /optimizers lists load errors); it waits "
                "for a worker that does"
            )
    return None


def largest_offer(workers: Sequence[WorkerRow], needs: JobNeeds) -> int:
    """The most slots (for a GPU job: GPUs; for an `auto` one: of one kind) one of `workers` that runs
    the job's framework has; 0 where none does."""
    able = [w for w in workers if needs.framework in w.frameworks and (w.gpus > 0 or not needs.gpu)]
    return max((_offer(w, needs) for w in able), default=0)


def _offer(worker: WorkerRow, needs: JobNeeds) -> int:
    """The most slots `worker` may give the job: GPU ones for a GPU job, any for a `cpu` job, and
    for others all of one kind (`JobNeeds`)."""
    if needs.gpu:
        return worker.gpus
    return worker.slots if needs.mixes else max(worker.gpus, worker.slots - worker.gpus)
