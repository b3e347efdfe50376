"""Check routes: queue the conformance checks on a registered optimizer as a job.

The job is an ordinary job (`GET /jobs/{id}` shows its progress and, once finished, the
report in its result); only its spec differs.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from jobs.spec import Catalogue, CheckSpec, SpecError, check_errors, timeout_errors
from service.auth import CallerDep, submitter
from service.deps import SettingsDep, submit_validated
from service.idempotency import REPLAYED_ANSWER, IdempotentRequest, KeyHeader, mark_replayed
from service.schemas import WRITES, JobRead, responses

router = APIRouter(prefix="/checks", tags=["checks"])


@router.post(
    "", status_code=201, response_model=JobRead, responses={**responses(*WRITES, 429, 503), **REPLAYED_ANSWER}
)
def submit_check(
    spec: CheckSpec,
    request: Request,
    response: Response,
    settings: SettingsDep,
    caller: CallerDep,
    idempotency_key: KeyHeader = None,
) -> JobRead:
    def errors_in(catalogue: Catalogue) -> list[SpecError]:
        return check_errors(spec, catalogue) + timeout_errors(spec, max_job_seconds=settings.max_job_seconds)

    key = IdempotentRequest.of(
        request, idempotency_key, route="POST /checks", body=spec, submitted_by=submitter(caller)
    )
    stored = submit_validated(request, spec, errors_in, submitted_by=submitter(caller), idempotency=key)
    mark_replayed(response, stored.replayed)
    return JobRead.from_row(stored.job)
