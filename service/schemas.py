"""API schemas, kept apart from the ORM tables (after full-stack-fastapi-template)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from jobs.result import AttemptRecord, ErrorRecord, JobResult, JobStatus, MlflowInfo
from service.models import Job, utcnow
from service.secrets import redact_url
from service.store import as_utc

__all__ = ["CheckSummary", "Health", "JobKind", "JobRead", "JobStatus", "JobsPage", "Progress"]

JobKind = Literal["train", "check"]


class Progress(BaseModel):
    step: int
    total: int
    fraction: float


class JobRead(BaseModel):
    id: int
    kind: JobKind
    status: JobStatus
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    progress: Progress
    latest_loss: float | None
    spec: dict[str, Any]
    mlflow: MlflowInfo | None
    # result.json as the job wrote it (validated as jobs.result.JobResult, shown with the keys it set)
    result: dict[str, Any] | None
    error: dict[str, Any] | None = Field(
        description="how the job ended, where it did not succeed (a jobs.result.ErrorRecord); None until then"
    )
    interruption: dict[str, Any] | None = Field(
        default=None,
        description=(
            "why its previous attempt ended before the job did (its worker stopped answering, or was "
            "stopped), while it waits to run again or runs again: an ErrorRecord, with the checkpoint "
            "it resumes from"
        ),
    )
    cancel_requested: bool
    attempt_history: list[AttemptRecord] = Field(
        default_factory=list,
        description=(
            "every attempt that ended, oldest first: its worker, start and end, the step it reached, "
            "how it ended (the job's status, or `interrupted` or `lease expired` where the job ran again) "
            "and why"
        ),
    )
    submitted_by: str | None = Field(description="the name of the API token that submitted it")
    cancelled_by: str | None = Field(
        default=None,
        description=(
            "the name of the API token whose cancel (of the job or of its study) came first; on a job "
            "that ended otherwise (succeeded, failed), with `cancel_requested`, the cancel came as it was "
            "ending and stopped nothing"
        ),
    )
    study_id: int | None = Field(default=None, description="the study it belongs to (POST /studies)")
    waiting_reason: str | None = Field(
        default=None,
        description=(
            "why the job waits: a running one, what holds it up (its MLflow server not answering, its"
            " process stopped) or that its progress has not moved for long (OPTLAB_STALL_NOTICE_S);"
            " GET /jobs/{id} of a queued one, why no live worker can run it"
        ),
    )

    @classmethod
    def from_row(cls, job: Job) -> JobRead:
        return cls(
            id=job.id,
            kind=job.kind,  # type: ignore[arg-type]
            status=job.status,
            created_at=as_utc(job.created_at),  # type: ignore[arg-type]
            updated_at=as_utc(job.updated_at),  # type: ignore[arg-type]
            started_at=as_utc(job.started_at),
            finished_at=as_utc(job.finished_at),
            attempt=job.attempt,
            progress=Progress(
                step=job.step,
                total=job.total_steps,
                fraction=round(job.step / job.total_steps, 4) if job.total_steps else 0.0,
            ),
            latest_loss=job.latest_loss,
            spec=job.spec,
            mlflow=_shown_mlflow(job.mlflow),
            result=_shown_result(job.result),
            # The store keeps an interrupted attempt's reason in `error` until the job ends; shown
            # apart, so `error` on a job that runs means it failed, never that it was moved.
            error=_record(job.error) if job.status.terminal else None,
            interruption=None if job.status.terminal else _stranded(job) or _record(job.error),
            cancel_requested=job.cancel_requested,
            attempt_history=[AttemptRecord.model_validate(record) for record in job.attempt_history or []],
            submitted_by=job.submitted_by,
            cancelled_by=job.cancelled_by,
            study_id=job.study_id,
            waiting_reason=job.waiting if job.status is JobStatus.RUNNING else None,
        )


def _stranded(job: Job) -> dict[str, Any] | None:
    """A running job whose worker stopped answering (its lease expired), until a worker takes it over:
    it had read as running well, with nothing to say why it made no progress."""
    expired = as_utc(job.lease_expires_at)
    if job.status is not JobStatus.RUNNING or expired is None or expired >= utcnow():
        return None
    resumes = (
        "from the start"
        if job.checkpoint_step is None
        else f"from its checkpoint of step {job.checkpoint_step}"
    )
    message = (
        f"its worker {job.worker_id} stopped answering (its lease expired at {expired.isoformat()}): "
        f"the next worker to claim a job takes it over, {resumes}"
    )
    return ErrorRecord(type="LeaseExpired", message=message).to_json()


def _record(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    return ErrorRecord.model_validate(stored).to_json() if stored else None


def _shown_mlflow(stored: dict[str, Any] | None) -> MlflowInfo | None:
    """The job's MLflow run as shown: no credential in a URL, even one stored by an older worker."""
    if not stored:
        return None
    info = MlflowInfo.model_validate(stored)
    return info.model_copy(
        update={"tracking_uri": redact_url(info.tracking_uri), "run_url": redact_url(info.run_url)}
    )


def _shown_result(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    if not stored:
        return None
    shown = JobResult.model_validate(stored).to_json()
    if shown.get("mlflow"):
        mlflow = _shown_mlflow(shown["mlflow"])
        shown["mlflow"] = mlflow.model_dump(mode="json") if mlflow else None
    return shown


class CheckSummary(BaseModel):
    """The latest finished check job of one optimizer in one style, in short."""

    job_id: int
    finished_at: datetime | None
    params: dict[str, Any]
    checks: list[str] | None  # the subset that was asked for; None: all of them
    pass_: int = Field(alias="pass")
    fail: int
    warn: int
    skip: int
    failed: list[str]
    warned: list[str]
    duration_s: float | None

    @classmethod
    def from_row(cls, job: Job) -> CheckSummary:
        report = JobResult.model_validate(job.result).report if job.result else None
        summary = (report or {}).get("summary") or {}
        return cls.model_validate(
            {
                "job_id": job.id,
                "finished_at": as_utc(job.finished_at),
                "params": job.spec["optimizer"].get("params", {}),
                "checks": job.spec.get("checks"),
                **{status: int(summary.get(status, 0)) for status in ("pass", "fail", "warn", "skip")},
                "failed": list(summary.get("failed", [])),
                "warned": list(summary.get("warned", [])),
                "duration_s": summary.get("duration_s"),
            }
        )

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


class Page(BaseModel):
    """Where a page of a list, newest first, stands."""

    total: int
    limit: int
    offset: int
    next_before: int | None = Field(
        default=None,
        description=(
            "for the next page, `?before=` this (the last item's id) while the page is full: stable while "
            "new ones are added, where an offset shifts by each"
        ),
    )

    @staticmethod
    def next_before_of(ids: Sequence[int], limit: int) -> int | None:
        return ids[-1] if len(ids) == limit else None


class JobsPage(Page):
    items: list[JobRead]


class Health(BaseModel):
    status: Literal["ok"]
    database: str = Field(description='"ok", or "does not answer (...)": the process is alive all the same')
    catalogue_published_at: datetime | None
    optimizers: int


class OptimizerList(BaseModel):
    """`GET /optimizers`: every implementation (one per name and style), and plugin load errors."""

    items: list[dict[str, Any]] = Field(description="name, style, framework, params with ranges, ...")
    errors: list[dict[str, str]] = Field(description="plugin files that failed to load: source, error")


class OptimizerDetail(BaseModel):
    """`GET /optimizers/{name}`: its implementations, each with `latest_check` (null: never checked)."""

    name: str
    implementations: list[dict[str, Any]]


class CatalogueItems(BaseModel):
    """`GET /schedules`, `GET /workloads`: the items with their parameters."""

    items: list[dict[str, Any]]


class ProblemItem(BaseModel):
    """One problem in a request, located like FastAPI's validation errors (`["body", "steps"]`)."""

    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """Every refusal: `detail` says what was wrong and what is allowed."""

    detail: str


class InvalidRequest(BaseModel):
    """422: each problem in the request, each naming its field, what is allowed and what came."""

    detail: list[ProblemItem]


# Why each status is answered; routes declare the ones they can return (service.routes.responses).
STATUS_REASONS: dict[int, tuple[type[BaseModel], str]] = {
    400: (Problem, "the Host header is not one of OPTLAB_TRUSTED_HOSTS"),
    401: (Problem, "no bearer token, or one this API does not know (header WWW-Authenticate)"),
    403: (Problem, "the token is read-only (NAME:TOKEN:read) and this request changes something"),
    404: (Problem, "no such job, study or optimizer"),
    409: (Problem, "the job already ended otherwise, or the study has not ended yet / has ended"),
    413: (Problem, "the body is over OPTLAB_MAX_BODY_BYTES"),
    415: (Problem, "a write without a token and without `Content-Type: application/json` (open API)"),
    422: (
        InvalidRequest,
        "invalid input: the body, a path or query parameter, or a header (Idempotency-Key)",
    ),
    429: (
        Problem,
        "the queue is full (OPTLAB_MAX_QUEUED or OPTLAB_MAX_QUEUED_PER_TOKEN); header Retry-After",
    ),
    503: (Problem, "no worker has published the optimizer catalogue yet"),
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these statuses, each with its body schema (and headers it sets)."""
    declared: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        model, reason = STATUS_REASONS[status]
        declared[status] = {"model": model, "description": reason}
        if status == 429:
            declared[status]["headers"] = {
                "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
            }
        if status == 401:
            declared[status]["headers"] = {
                "WWW-Authenticate": {"description": "the Bearer challenge", "schema": {"type": "string"}}
            }
    return declared


# Every authenticated route: a foreign Host, a missing token, a body too large, bad parameters.
COMMON = (400, 401, 413, 422)
WRITES = (*COMMON, 403, 415)
