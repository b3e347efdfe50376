"""Check routes: queue the conformance checks on a registered optimizer as a job.

The job is an ordinary job (`GET /jobs/{id}` shows its progress and, once finished, the
report in its result); only its spec differs.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from jobs.spec import CheckSpec, check_errors, timeout_errors, with_resolved_style
from service.auth import CallerDep, submitter
from service.deps import SettingsDep, published_catalogue
from service.quotas import SubmissionQueue
from service.schemas import WRITES, JobRead, responses

router = APIRouter(prefix="/checks", tags=["checks"])


@router.post("", status_code=201, response_model=JobRead, responses=responses(*WRITES, 429, 503))
def submit_check(spec: CheckSpec, request: Request, settings: SettingsDep, caller: CallerDep) -> JobRead:
    with request.app.state.sessions() as session:  # as POST /jobs: closed before the batch waits
        catalogue = published_catalogue(request, session)
    errors = check_errors(spec, catalogue) + timeout_errors(spec, max_job_seconds=settings.max_job_seconds)
    if errors:
        raise HTTPException(status_code=422, detail=[e.model_dump() for e in errors])
    submissions: SubmissionQueue = request.app.state.submissions
    job = submissions.submit(with_resolved_style(spec, catalogue), submitted_by=submitter(caller))
    return JobRead.from_row(job)
