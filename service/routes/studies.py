"""Study routes: thin; expansion and validation are `jobs.spec`, storage is `service.studies.store`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from jobs.spec import Catalogue, StudySpec, study_errors, with_sources
from service.admission import device_errors
from service.auth import CallerDep, submitter
from service.capabilities import needs_of
from service.deps import BeforeQuery, CatalogueDep, SessionDep, SettingsDep
from service.idempotency import REPLAYED_ANSWER, IdempotentRequest, KeyHeader, mark_replayed
from service.models import Study
from service.quotas import queue_room
from service.schemas import COMMON, WRITES, responses
from service.settings import Settings
from service.studies import store as study_store
from service.studies.schemas import StudiesPage, StudyRead
from service.studies.summary import first_line

router = APIRouter(prefix="/studies", tags=["studies"])

StudyId = Annotated[int, Path(ge=1, le=2**31 - 1, description="the study's id")]
HTML_BODY: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/html": {"schema": {"type": "string"}}},
        "description": "the report, images inline",
    }
}


def json_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses(...)` for a route whose own body is not JSON: its errors still are (FastAPI would
    otherwise declare them in the route's media type)."""
    declared = responses(*statuses)
    for answer in declared.values():
        model = answer.pop("model")
        answer["content"] = {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
        }
    return declared


@router.post(
    "",
    status_code=201,
    response_model=StudyRead,
    responses={**responses(*WRITES, 429, 503), **REPLAYED_ANSWER},
)
def submit_study(
    spec: StudySpec,
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    catalogue: CatalogueDep,
    caller: CallerDep,
    idempotency_key: KeyHeader = None,
) -> StudyRead:
    key = IdempotentRequest.of(
        request, idempotency_key, route="POST /studies", body=spec, submitted_by=submitter(caller)
    )
    # A retry of a request that was stored gets its study, whatever the catalogue or queue say now.
    study = None if key is None else key.earlier_study(session)
    replayed = study is not None
    if study is None:
        study, replayed = _stored_study(
            spec, session, settings, catalogue, submitted_by=submitter(caller), key=key
        )
    mark_replayed(response, replayed)
    return _read(session, study, settings.mlflow_tracking_uri)


def _stored_study(
    spec: StudySpec,
    session: Session,
    settings: Settings,
    catalogue: Catalogue,
    *,
    submitted_by: str | None,
    key: IdempotentRequest | None,
) -> tuple[Study, bool]:
    """The study and its jobs, validated and stored; or the one a request with `key` racing this
    one stored first (replayed: True)."""
    errors, jobs = study_errors(
        spec,
        catalogue,
        max_steps=settings.max_steps,
        max_jobs=settings.max_study_jobs,
        data_roots=settings.data_root_paths,
    )
    # Its jobs' needs, the first job's standing for all: they differ in optimizer, grid point and seed.
    if jobs:
        needs = needs_of(jobs[0][1].model_dump(mode="json"))
        errors += device_errors(needs, spec.device, session=session, settings=settings)
    if errors:
        raise HTTPException(status_code=422, detail=[e.model_dump() for e in errors])
    jobs = [(member, with_sources(job, catalogue)) for member, job in jobs]  # the classes validated against
    with queue_room(
        session=session, settings=settings, submitted_by=submitted_by, jobs=len(jobs), idempotency=key
    ) as earlier:
        if earlier is not None:
            session.rollback()  # nothing to store; ends the transaction, and the lock it holds
            return earlier, True
        study = study_store.create_study(
            session=session, spec=spec, jobs=jobs, submitted_by=submitted_by, idempotency=key
        )
        return study, False


@router.get("", response_model=StudiesPage, responses=responses(*COMMON))
def list_studies(
    session: SessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    before: BeforeQuery = None,
) -> StudiesPage:
    studies, total = study_store.list_studies(session=session, limit=limit, offset=offset, before_id=before)
    items = [_read(session, study, settings.mlflow_tracking_uri) for study in studies]
    next_before = StudiesPage.next_before_of([study.id for study in studies], limit)
    return StudiesPage(items=items, total=total, limit=limit, offset=offset, next_before=next_before)


@router.get("/{study_id}", response_model=StudyRead, responses=responses(*COMMON, 404))
def get_study(study_id: StudyId, session: SessionDep, settings: SettingsDep) -> StudyRead:
    return _read(session, _found(session, study_id), settings.mlflow_tracking_uri)


@router.post("/{study_id}/cancel", response_model=StudyRead, responses=responses(*WRITES, 404, 409))
def cancel_study(
    study_id: StudyId, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> StudyRead:
    _found(session, study_id)
    try:
        cancelled = study_store.cancel_study(session=session, study_id=study_id, by=submitter(caller))
    except study_store.NothingToCancel as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    assert cancelled is not None
    return _read(session, cancelled, settings.mlflow_tracking_uri)


@router.get(
    "/{study_id}/report",
    response_class=HTMLResponse,
    responses={**HTML_BODY, **json_errors(*COMMON, 404, 409)},
)
def study_report(study_id: StudyId, session: SessionDep) -> HTMLResponse:
    study = _found(session, study_id)
    if study.report_html is None:
        why = "it is made once every job has ended"
        if study.finalize_error:  # every job ended, and making it failed: say why, not "wait"
            why = f"making it failed and is retried: {first_line(study.finalize_error)}"
        elif study.summary_waiting:  # being made, and slow: say for how long, and on what
            why = study.summary_waiting
        raise HTTPException(status_code=409, detail=f"study {study_id} has no report yet: {why}")
    return HTMLResponse(study.report_html)


def _found(session: Session, study_id: int) -> Study:
    study = study_store.get_study(session=session, study_id=study_id)
    if study is None:
        raise HTTPException(status_code=404, detail=f"no study with id {study_id}")
    return study


def _read(session: Session, study: Study, tracking_uri: str) -> StudyRead:
    jobs = study_store.study_jobs(session=session, study_id=study.id)
    return StudyRead.from_row(study, jobs, tracking_uri=tracking_uri)
