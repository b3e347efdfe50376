"""Check routes: queue the conformance checks on a registered optimizer as a job.

The job is an ordinary job (`GET /jobs/{id}` shows its progress and, once finished, the
report in its result); only its spec differs.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from jobs.spec import Catalogue, CheckSpec, SpecError, check_errors, timeout_errors
from service.auth import CallerDep, submitter
from service.deps import SettingsDep, submit_validated
from service.schemas import WRITES, JobRead, responses

router = APIRouter(prefix="/checks", tags=["checks"])


@router.post("", status_code=201, response_model=JobRead, responses=responses(*WRITES, 429, 503))
def submit_check(spec: CheckSpec, request: Request, settings: SettingsDep, caller: CallerDep) -> JobRead:
    def errors_in(catalogue: Catalogue) -> list[SpecError]:
        return check_errors(spec, catalogue) + timeout_errors(spec, max_job_seconds=settings.max_job_seconds)

    return JobRead.from_row(submit_validated(request, spec, errors_in, submitted_by=submitter(caller)))
