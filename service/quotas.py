"""Caps on queued jobs, in total and per token name: one client cannot fill the store.

The count and the insert happen under one lock (`service.db.submission_lock`), so submissions
racing at the limit cannot both pass. Single jobs (`POST /jobs`, `POST /checks`) go through a
`SubmissionQueue`, which stores the submissions that arrive together in one transaction: one
lock, one count and one commit (one fsync) for all of them, each accepted or refused exactly as
it would have been alone, in the order they came. That transaction also checks that each was
validated against the catalogue still the latest (`CatalogueChanged` otherwise).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import HTTPException
from sqlalchemy.orm import Session, sessionmaker

from jobs.spec import AnySpec
from service import store
from service.db import submission_lock
from service.idempotency import IdempotentRequest
from service.models import Job, Study
from service.settings import Settings
from service.store import CatalogueVersion

# What a refused client is told to wait: a job of the demo's size takes about this long here.
RETRY_AFTER_S = 30


@contextmanager
def queue_room(
    *,
    session: Session,
    settings: Settings,
    submitted_by: str | None,
    jobs: int = 1,
    idempotency: IdempotentRequest | None = None,
) -> Iterator[Study | None]:
    """Room for `jobs` more queued jobs, or 429 with Retry-After; the caller inserts them inside.

    A submission of several jobs (a study) is refused whole or stored whole. Where an earlier
    request with its `idempotency` key made a study, that study is given instead, before the queue
    is counted: the caller inserts nothing then.
    """
    with submission_lock(session):
        earlier = None if idempotency is None else idempotency.earlier_study(session)
        if earlier is None:
            room = QueueRoom.count(session=session, settings=settings, names=[submitted_by])
            refusal = room.refusal(submitted_by, jobs)
            if refusal is not None:
                raise refusal
        yield earlier


@dataclass
class QueueRoom:
    """The queue as counted under the submission lock, kept up to date as jobs are added to it."""

    settings: Settings
    queued: int
    by_submitter: Counter[str]

    @classmethod
    def count(cls, *, session: Session, settings: Settings, names: Iterable[str | None]) -> QueueRoom:
        """The queue now, in total and for these token names (None: an open API's submitter)."""
        named = [name for name in names if name is not None]
        own = store.count_queued_of(session=session, names=named) if named else {}
        return cls(settings, store.count_queued(session=session), Counter(own))

    def refusal(self, submitted_by: str | None, jobs: int = 1) -> HTTPException | None:
        """The 429 for adding `jobs` more by `submitted_by`, or None when they fit; a 422 for more
        than could ever fit, which no wait changes."""
        settings = self.settings
        caps = [(settings.max_queued, "this service holds", "OPTLAB_MAX_QUEUED")]
        if submitted_by is not None:
            caps.append((settings.max_queued_per_token, "one token may have", "OPTLAB_MAX_QUEUED_PER_TOKEN"))
        for cap, whose, setting in caps:
            if jobs > cap:
                return _never_fits(
                    f"this request adds {jobs} jobs, more than the {cap} queued jobs {whose} at any time "
                    f"({setting}): submit it in parts (a study: fewer grid values or seeds), or raise "
                    "the limit"
                )
        adds = "" if jobs == 1 else f"; this request adds {jobs}"
        if self.queued + jobs > settings.max_queued:
            return _full(
                f"{self.queued} jobs are queued{adds}, the most this service holds is "
                f"{settings.max_queued} (OPTLAB_MAX_QUEUED)"
            )
        if submitted_by is None:
            return None
        own = self.by_submitter[submitted_by]
        if own + jobs > settings.max_queued_per_token:
            return _full(
                f"token {submitted_by!r} has {own} jobs queued{adds}, the most one token may have is "
                f"{settings.max_queued_per_token} "
                "(OPTLAB_MAX_QUEUED_PER_TOKEN); wait for some to start, or cancel some"
            )
        return None

    def add(self, submitted_by: str | None, jobs: int = 1) -> None:
        self.queued += jobs
        if submitted_by is not None:
            self.by_submitter[submitted_by] += jobs


def _full(message: str) -> HTTPException:
    return HTTPException(
        status_code=429,
        detail=f"{message}; retry in {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _never_fits(message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": ["body"], "msg": message, "type": "too_many_jobs"}])


class CatalogueChanged(Exception):
    """A submission was validated against a catalogue that is no longer the latest: nothing was
    stored for it; validate it again against the latest."""


@dataclass(frozen=True)
class Stored:
    """A submission's job; `replayed`: an earlier request with its `Idempotency-Key` made it."""

    job: Job
    replayed: bool = False


@dataclass(eq=False)
class _Submission:
    spec: AnySpec
    submitted_by: str | None
    catalogue: CatalogueVersion
    idempotency: IdempotentRequest | None
    handled: bool = False
    job: Job | None = None
    replayed: bool = False
    error: BaseException | None = None


@dataclass(eq=False)
class SubmissionQueue:
    """Single-job submissions, stored in batches: whoever finds no batch being stored stores every
    submission waiting at that moment, its own among them (group commit).

    A commit waits for the disk (an fsync on SQLite, the WAL flush on PostgreSQL: milliseconds),
    and submissions are serialised by the quota lock, so committing one at a time capped the API
    at about one submission per fsync. Batching keeps each answer's guarantees: a 201 is sent only
    after its job's transaction committed, and the quota is checked job by job in arrival order
    under the lock. Under light load a batch is one submission and nothing waits.
    """

    sessions: sessionmaker[Session]
    settings: Settings
    _waiting: list[_Submission] = field(default_factory=list)
    _waiting_lock: threading.Lock = field(default_factory=threading.Lock)
    _storing: threading.Lock = field(default_factory=threading.Lock)

    def submit(
        self,
        spec: AnySpec,
        *,
        submitted_by: str | None,
        catalogue: CatalogueVersion,
        idempotency: IdempotentRequest | None = None,
    ) -> Stored:
        """The stored job, or the 429, `CatalogueChanged` (or the store's error) raised.

        `catalogue`: the version of the catalogue `spec` was validated against. `idempotency`: its
        key; a job an earlier request with it made comes back instead (replayed), and nothing is
        stored.
        """
        mine = _Submission(spec, submitted_by, catalogue, idempotency)
        with self._waiting_lock:
            self._waiting.append(mine)
        with self._storing:
            if not mine.handled:  # else the batch before took it along
                with self._waiting_lock:
                    batch, self._waiting = self._waiting, []
                self._store(batch)
        if mine.error is not None:
            raise mine.error
        assert mine.job is not None
        return Stored(mine.job, mine.replayed)

    def _store(self, batch: list[_Submission]) -> None:
        try:
            with self.sessions() as session, submission_lock(session):
                names = [submission.submitted_by for submission in batch]
                room = QueueRoom.count(session=session, settings=self.settings, names=names)
                newest = store.catalogue_version(session=session, within_s=self.settings.lease_s)
                for submission in batch:
                    self._store_one(submission, session=session, room=room, newest=newest)
                session.commit()
        except BaseException as exc:
            for submission in batch:  # nothing of this batch was stored
                if submission.job is not None:
                    submission.job, submission.replayed, submission.error = None, False, exc
                elif submission.error is None:
                    submission.error = exc
        finally:
            for submission in batch:
                submission.handled = True

    @staticmethod
    def _store_one(
        submission: _Submission, *, session: Session, room: QueueRoom, newest: CatalogueVersion | None
    ) -> None:
        """One submission of a batch into the batch's transaction, or its refusal into `error`."""
        key = submission.idempotency
        try:
            # Under the lock: a request racing this one with its key stored first, maybe in this batch.
            submission.job = None if key is None else key.earlier_job(session)
        except HTTPException as refused:
            submission.error = refused
            return
        if submission.job is not None:
            submission.replayed = True
            return
        stale = submission.catalogue != newest
        submission.error = CatalogueChanged() if stale else room.refusal(submission.submitted_by)
        if submission.error is None:
            room.add(submission.submitted_by)
            submission.job = store.job_row(spec=submission.spec, submitted_by=submission.submitted_by)
            session.add(submission.job)
            if key is not None:
                key.remember(session, job=submission.job)
