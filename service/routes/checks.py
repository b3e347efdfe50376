"""Check routes: queue the conformance checks on a registered optimizer as a job.

The job is an ordinary job (`GET /jobs/{id}` shows its progress and, once finished, the
report in its result); only its spec differs.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from jobs.spec import CheckSpec, check_errors, timeout_errors, with_resolved_style
from service import store
from service.auth import CallerDep, submitter
from service.deps import CatalogueDep, SessionDep, SettingsDep
from service.quotas import queue_room
from service.schemas import WRITES, JobRead, responses

router = APIRouter(prefix="/checks", tags=["checks"])


@router.post("", status_code=201, response_model=JobRead, responses=responses(*WRITES, 429, 503))
def submit_check(
    spec: CheckSpec, session: SessionDep, settings: SettingsDep, catalogue: CatalogueDep, caller: CallerDep
) -> JobRead:
    errors = check_errors(spec, catalogue) + timeout_errors(spec, max_job_seconds=settings.max_job_seconds)
    if errors:
        raise HTTPException(status_code=422, detail=[e.model_dump() for e in errors])
    spec = with_resolved_style(spec, catalogue)
    with queue_room(session=session, settings=settings, submitted_by=submitter(caller)):
        job = store.create_job(session=session, spec=spec, submitted_by=submitter(caller))
    return JobRead.from_row(job)
