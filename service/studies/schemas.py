"""What the study routes answer (apart from the ORM rows, as service.schemas does for jobs)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from jobs.result import JobStatus
from jobs.tracking import run_overview_url
from service.models import Job, Study
from service.schemas import Page
from service.secrets import redact_url, split_credentials
from service.store import as_utc
from service.studies.runs import study_runs_url
from service.studies.summary import StudySummary

StudyStatus = Literal["running", "summarizing", "done"]


class StatusCounts(BaseModel):
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    diverged: int = 0
    cancelled: int = 0

    @classmethod
    def of(cls, jobs: list[Job]) -> StatusCounts:
        counts = cls()
        for job in jobs:
            setattr(counts, job.status.value, getattr(counts, job.status.value) + 1)
        return counts


STEPS_DONE = (
    "steps its jobs have trained: a succeeded job's all, any other's the last it reported (a job "
    "cancelled, failed or diverged stopped there)"
)
FRACTION = (
    "steps_done / steps_total: the share of the planned training that ran, below 1 for good once a "
    "job stopped early (whether every job has ended is `ended` and the counts)"
)


class OptimizerProgress(BaseModel):
    optimizer: str = Field(description="the study's optimizer entry (its label, else its name)")
    jobs: int
    counts: StatusCounts
    steps_done: int = Field(description=STEPS_DONE)
    steps_total: int
    fraction: float = Field(description=FRACTION)


class StudyProgress(BaseModel):
    jobs: int
    ended: int
    counts: StatusCounts
    steps_done: int = Field(description=STEPS_DONE)
    steps_total: int
    fraction: float = Field(description=FRACTION)
    optimizers: list[OptimizerProgress]


class StudyJob(BaseModel):
    """One job of the study: which optimizer, grid point and seed, and where it stands."""

    job_id: int
    optimizer: str
    grid: dict[str, Any]
    seed: int
    status: JobStatus
    step: int
    total: int
    run_id: str | None


class StudyMlflow(BaseModel):
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    url: str = Field(description="the study's own job runs in the MLflow UI, as charts, listed flat")
    parent_run_url: str = Field(
        description="the parent run's overview: the study's params, its child runs, the summary's metrics, "
        "the report and summary as artifacts"
    )


class StudyRead(BaseModel):
    id: int
    name: str
    status: StudyStatus = Field(
        description="running until every job has ended, summarizing while a worker computes the "
        "summary, then done"
    )
    created_at: datetime
    finished_at: datetime | None = Field(description="when the summary was recorded")
    submitted_by: str | None
    cancel_requested: bool
    spec: dict[str, Any]
    progress: StudyProgress
    jobs: list[StudyJob]
    mlflow: StudyMlflow | None = Field(description="null until its first job started")
    summary: StudySummary | None = Field(description="statistics, ranking, comparisons; once done")
    summary_error: str | None = Field(
        description="why the summary could not be made yet (retried); once done, why MLflow does not "
        "hold it (its parent run was deleted)"
    )
    summary_waiting: str | None = Field(
        description="what the summary, being made, has waited on for long (MLflow not answering)"
    )
    report_url: str | None = Field(description="the HTML report (GET /studies/{id}/report), once done")

    @classmethod
    def from_row(cls, study: Study, jobs: list[Job], *, tracking_uri: str) -> StudyRead:
        by_id = {job.id: job for job in jobs}
        members = [(member, by_id[member["job_id"]]) for member in study.members if member["job_id"] in by_id]
        ended = sum(job.status.terminal for job in jobs)
        status: StudyStatus = (
            "done" if study.finalized_at is not None else "summarizing" if ended == len(jobs) else "running"
        )
        return cls(
            id=study.id,
            name=study.name,
            status=status,
            created_at=as_utc(study.created_at),  # type: ignore[arg-type]
            finished_at=as_utc(study.finalized_at),
            submitted_by=study.submitted_by,
            cancel_requested=study.cancel_requested,
            spec=study.spec,
            progress=_progress(members),
            jobs=[
                StudyJob(
                    job_id=job.id,
                    optimizer=member["optimizer"],
                    grid=member["grid"],
                    seed=member["seed"],
                    status=job.status,
                    step=job.step,
                    total=job.total_steps,
                    run_id=(job.mlflow or {}).get("run_id"),
                )
                for member, job in members
            ],
            mlflow=_mlflow(study, tracking_uri),
            summary=StudySummary.model_validate(study.summary) if study.summary else None,
            summary_error=study.finalize_error,
            summary_waiting=study.summary_waiting if study.finalized_at is None else None,
            report_url=f"/studies/{study.id}/report" if study.finalized_at is not None else None,
        )


def steps_run(job: Job) -> int:
    """The steps a job has trained: all of them once it succeeded, else the last step it reported (a
    job cancelled, failed or diverged stopped there; counting its total had shown a study cancelled
    early as all done)."""
    if job.status is JobStatus.SUCCEEDED:
        return job.total_steps
    return job.step


def _progress(members: list[tuple[dict[str, Any], Job]]) -> StudyProgress:
    def steps(jobs: list[Job]) -> tuple[int, int, float]:
        done = sum(steps_run(job) for job in jobs)
        total = sum(job.total_steps for job in jobs)
        return done, total, round(done / total, 4) if total else 0.0

    by_optimizer: dict[str, list[Job]] = {}
    for member, job in members:
        by_optimizer.setdefault(member["optimizer"], []).append(job)
    jobs = [job for _, job in members]
    done, total, fraction = steps(jobs)
    return StudyProgress(
        jobs=len(jobs),
        ended=sum(job.status.terminal for job in jobs),
        counts=StatusCounts.of(jobs),
        steps_done=done,
        steps_total=total,
        fraction=fraction,
        optimizers=[
            OptimizerProgress(
                optimizer=name,
                jobs=len(group),
                counts=StatusCounts.of(group),
                steps_done=group_steps[0],
                steps_total=group_steps[1],
                fraction=group_steps[2],
            )
            for name, group in by_optimizer.items()
            for group_steps in [steps(group)]
        ],
    )


def _mlflow(study: Study, tracking_uri: str) -> StudyMlflow | None:
    if study.experiment_id is None or study.parent_run_id is None:
        return None
    shown = redact_url(split_credentials(tracking_uri)[0])
    return StudyMlflow(
        tracking_uri=shown,
        experiment_id=study.experiment_id,
        parent_run_id=study.parent_run_id,
        url=study_runs_url(shown, study.experiment_id, study.id),
        parent_run_url=run_overview_url(shown, study.experiment_id, study.parent_run_id),
    )


class StudiesPage(Page):
    items: list[StudyRead]
