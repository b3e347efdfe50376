"""Caps on queued jobs, in total and per token name: one client cannot fill the store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import HTTPException
from sqlalchemy.orm import Session

from service import store
from service.db import submission_lock
from service.settings import Settings

# What a refused client is told to wait: a job of the demo's size takes about this long here.
RETRY_AFTER_S = 30


@contextmanager
def queue_room(
    *, session: Session, settings: Settings, submitted_by: str | None, jobs: int = 1
) -> Iterator[None]:
    """Room for `jobs` more queued jobs, or 429 with Retry-After; the caller inserts them inside.

    The count and the insert happen under one lock, so submissions racing at the limit cannot
    both pass, and a submission of several jobs (a study) is refused whole or stored whole.
    """
    with submission_lock(session):
        _refuse_when_full(session=session, settings=settings, submitted_by=submitted_by, jobs=jobs)
        yield


def _refuse_when_full(*, session: Session, settings: Settings, submitted_by: str | None, jobs: int) -> None:
    queued = store.count_queued(session=session)
    adds = "" if jobs == 1 else f"; this request adds {jobs}"
    if queued + jobs > settings.max_queued:
        raise _full(
            f"{queued} jobs are queued{adds}, the most this service holds is {settings.max_queued} "
            "(OPTLAB_MAX_QUEUED)"
        )
    if submitted_by is None:
        return
    own = store.count_queued(session=session, submitted_by=submitted_by)
    if own + jobs > settings.max_queued_per_token:
        raise _full(
            f"token {submitted_by!r} has {own} jobs queued{adds}, the most one token may have is "
            f"{settings.max_queued_per_token} "
            "(OPTLAB_MAX_QUEUED_PER_TOKEN); wait for some to start, or cancel some"
        )


def _full(message: str) -> HTTPException:
    return HTTPException(
        status_code=429,
        detail=f"{message}; retry in {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
