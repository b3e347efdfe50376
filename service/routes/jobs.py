"""Job routes: thin; validation is `jobs.spec`, storage is `service.store`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from jobs.result import JobStatus
from jobs.spec import (
    NAME_PATTERN,
    SAFE_NAME_PATTERN,
    Catalogue,
    JobSpec,
    SpecError,
    catalogue_errors,
    timeout_errors,
)
from service import store
from service.admission import device_errors_asking
from service.auth import CallerDep, submitter
from service.capabilities import needs_of
from service.deps import BeforeQuery, SessionDep, SettingsDep, submit_validated
from service.idempotency import REPLAYED_ANSWER, IdempotentRequest, KeyHeader, mark_replayed
from service.quotas import Stored
from service.schemas import COMMON, WRITES, JobKind, JobRead, JobsPage, responses
from service.settings import ApiToken, Settings

router = APIRouter(prefix="/jobs", tags=["jobs"])

# Job ids are 32-bit integers in every database the store runs on.
JobId = Annotated[int, Path(ge=1, le=2**31 - 1, description="the job's id")]


@router.post(
    "", status_code=201, response_model=JobRead, responses={**responses(*WRITES, 429, 503), **REPLAYED_ANSWER}
)
async def submit_job(
    spec: JobSpec,
    request: Request,
    response: Response,
    settings: SettingsDep,
    caller: CallerDep,
    idempotency_key: KeyHeader = None,
) -> JobRead:
    # async, with the blocking part in one explicit pass through the thread pool: FastAPI runs a
    # plain `def` route there and then a second time to validate what it returned.
    key = IdempotentRequest.of(
        request, idempotency_key, route="POST /jobs", body=spec, submitted_by=submitter(caller)
    )
    stored = await run_in_threadpool(_submit_job, spec, request, settings, caller, key)
    mark_replayed(response, stored.replayed)
    return JobRead.from_row(stored.job)


def _submit_job(
    spec: JobSpec,
    request: Request,
    settings: Settings,
    caller: ApiToken | None,
    key: IdempotentRequest | None,
) -> Stored:
    needs = needs_of(spec.model_dump(mode="json"))
    refused_device = device_errors_asking(request.app.state.sessions, needs, spec.device, settings=settings)

    def errors_in(catalogue: Catalogue) -> list[SpecError]:
        errors = catalogue_errors(
            spec, catalogue, max_steps=settings.max_steps, data_roots=settings.data_root_paths
        )
        return errors + timeout_errors(spec, max_job_seconds=settings.max_job_seconds) + refused_device

    return submit_validated(request, spec, errors_in, submitted_by=submitter(caller), idempotency=key)


@router.get("", response_model=JobsPage, responses=responses(*COMMON))
def list_jobs(
    session: SessionDep,
    status: Annotated[
        list[JobStatus] | None,
        Query(
            description="only jobs in this status; repeated, in any of them (?status=queued&status=running)"
        ),
    ] = None,
    kind: JobKind | None = None,
    study: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="only this study's jobs")] = None,
    experiment: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=200,
            pattern=SAFE_NAME_PATTERN,
            description="only this MLflow experiment's jobs",
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=100,
            pattern=NAME_PATTERN,
            description="only jobs of this optimizer (its name)",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    before: BeforeQuery = None,
) -> JobsPage:
    jobs, total = store.list_jobs(
        session=session,
        status=status,
        kind=kind,
        study_id=study,
        experiment=experiment,
        optimizer=optimizer,
        limit=limit,
        offset=offset,
        before_id=before,
    )
    return JobsPage(
        items=[JobRead.from_row(j) for j in jobs],
        total=total,
        limit=limit,
        offset=offset,
        next_before=JobsPage.next_before_of([job.id for job in jobs], limit),
    )


@router.get("/{job_id}", response_model=JobRead, responses=responses(*COMMON, 404))
def get_job(job_id: JobId, request: Request, session: SessionDep, settings: SettingsDep) -> JobRead:
    job = store.get_job(session=session, job_id=job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job with id {job_id}")
    reason = store.waiting_reason(
        session=session, job=job, within_s=settings.lease_s, catalogues=request.app.state.catalogues
    )
    return JobRead.from_row(job).model_copy(update={"waiting_reason": reason})


@router.post("/{job_id}/cancel", response_model=JobRead, responses=responses(*WRITES, 404, 409))
def cancel_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> JobRead:
    job = store.request_cancel(session=session, job_id=job_id, by=submitter(caller))
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job with id {job_id}")
    if job.status.terminal and job.status is not JobStatus.CANCELLED:
        raise HTTPException(status_code=409, detail=f"job {job_id} already ended as {job.status}")
    return JobRead.from_row(job)
