"""Caps on queued jobs, in total and per token name: one client cannot fill the store."""

from __future__ import annotations

from fastapi import HTTPException
from sqlalchemy.orm import Session

from service import store
from service.settings import Settings

# What a refused client is told to wait: a job of the demo's size takes about this long here.
RETRY_AFTER_S = 30


def enforce_queue_limits(
    *, session: Session, settings: Settings, submitted_by: str | None, adding: int = 1
) -> None:
    """429 with Retry-After when the queue, or this token's share of it, cannot take `adding` more
    jobs (a study's are counted together: all of them or none).

    Counted before the insert, so two submissions racing at the limit may both pass: the cap is
    a guard against floods, not an exact count.
    """
    queued = store.count_queued(session=session)
    adds = "" if adding == 1 else f"; this request adds {adding}"
    if queued + adding > settings.max_queued:
        raise _full(
            f"{queued} jobs are queued{adds}, the most this service holds is {settings.max_queued} "
            "(OPTLAB_MAX_QUEUED)"
        )
    if submitted_by is None:
        return
    own = store.count_queued(session=session, submitted_by=submitted_by)
    if own + adding > settings.max_queued_per_token:
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
