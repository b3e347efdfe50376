"""FastAPI dependencies as `Annotated` aliases; tests override `get_session` and friends."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from jobs.spec import Catalogue, SpecError, SpecT, with_resolved_style, with_sources
from service import store
from service.idempotency import IdempotentRequest
from service.quotas import CatalogueChanged, Stored, SubmissionQueue
from service.settings import Settings

log = logging.getLogger("optlab.api")

# A list's cursor: the page after one whose `next_before` this was (stable while new items are added).
BeforeQuery = Annotated[
    int | None,
    Query(
        ge=1,
        le=2**31 - 1,
        description="only older ones (a lower id): the page after one whose `next_before` this was",
    ),
]


async def get_settings(request: Request) -> Settings:
    # async: FastAPI runs a plain `def` dependency in the thread pool, one hop per dependency.
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        _close(session)


def _close(session: Session) -> None:
    """Close the request's session (its rollback of anything left open). A connection the store
    dropped meanwhile (restarted, or terminated) fails that rollback after the answer was sent, had
    been logged as an unhandled error with two tracebacks, the answer standing: one line now."""
    try:
        session.close()
    except DBAPIError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("could not close a store session after its request (the answer stands): %s", first_line)


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


def get_catalogue(request: Request, session: SessionDep) -> Catalogue:
    return _found(request.app.state.catalogues.latest(session=session)).catalogue


def published_catalogue(request: Request, *, cached: bool = False) -> store.PublishedCatalogue:
    """The latest catalogue, or 503 while no worker has published one; `cached`: the one the app
    loaded last, if any, without asking the store (see `submit_validated` for when that is safe)."""
    catalogues: store.CatalogueCache = request.app.state.catalogues
    found = catalogues.cached() if cached else None
    if found is None:
        with request.app.state.sessions() as session:
            found = catalogues.latest(session=session)
    return _found(found)


def _found(published: store.PublishedCatalogue | None) -> store.PublishedCatalogue:
    if published is None:
        raise HTTPException(
            status_code=503,
            detail="the optimizer catalogue has not been published yet: "
            "start a worker (`optlab worker`, or `optlab serve`) and retry in a few seconds",
        )
    return published


# How often a submission is validated again because the catalogue changed meanwhile before it
# gives up with a 503: it changes when a worker starts, stops or its plugins change
# (`store.catalogue_version`), so one retry is the rare case and three in a row a storm.
CATALOGUE_RETRIES = 3
CATALOGUE_RETRY_AFTER_S = 5


Refusals = Callable[[Catalogue], list[SpecError]]  # what a catalogue refuses in a spec


def submit_validated(
    request: Request,
    spec: SpecT,
    errors_in: Refusals,
    *,
    submitted_by: str | None,
    idempotency: IdempotentRequest | None = None,
) -> Stored:
    """`spec` validated against the latest catalogue (`errors_in` lists what it refuses: a 422)
    and stored as a queued job through the app's `SubmissionQueue`; or, where an earlier request
    with its `Idempotency-Key` made a job, that job, before any validation: a retry of a request
    that was stored gets its job even if the catalogue or the queue would refuse it now.

    Submitting is the API's hot path, so the catalogue is the app's cached one, without asking
    the store first (on PostgreSQL that question cost a check-out with its ping, BEGIN, the version
    query and ROLLBACK a request: benchmarks/README, phase 5). A stale cache still gives the
    answer a fresh one would: a spec it refuses is checked again against the store's latest
    before the 422, and one it accepts is stored only if that catalogue is still the latest when
    its batch commits, else validated again against the new one.
    """
    if idempotency is not None:
        with request.app.state.sessions() as session:
            earlier = idempotency.earlier_job(session)
        if earlier is not None:
            return Stored(earlier, replayed=True)
    submissions: SubmissionQueue = request.app.state.submissions
    for attempt in range(CATALOGUE_RETRIES):
        # The cached catalogue first; after a `CatalogueChanged`, the latest.
        published = published_catalogue(request, cached=attempt == 0)
        errors = errors_in(published.catalogue)
        if errors:
            latest = published_catalogue(request)
            if latest is not published:
                published = latest
                errors = errors_in(published.catalogue)
        if errors:
            raise HTTPException(status_code=422, detail=[e.model_dump() for e in errors])
        # As the job will run it: its style, and the plugin class it was validated against.
        resolved = with_sources(with_resolved_style(spec, published.catalogue), published.catalogue)
        try:
            return submissions.submit(
                resolved, submitted_by=submitted_by, catalogue=published.version, idempotency=idempotency
            )
        except CatalogueChanged:
            continue
    raise HTTPException(
        status_code=503,
        detail=f"the optimizer catalogue changed {CATALOGUE_RETRIES} times while this submission was "
        f"being stored (workers starting or reloading plugins); retry in {CATALOGUE_RETRY_AFTER_S} s",
        headers={"Retry-After": str(CATALOGUE_RETRY_AFTER_S)},
    )


CatalogueDep = Annotated[Catalogue, Depends(get_catalogue)]
