"""The study store's claims, on a real SQLite store: the parent run is recorded once, and a study
is finalized once, only after every job ended, by one claimant at a time."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import JobStatus
from jobs.spec import Catalogue, StudySpec, study_errors
from service.models import Job, Study, utcnow
from service.studies import store as study_store
from service.studies.finalize import parent_run_status, target_of

SPEC = StudySpec.model_validate(
    {
        "name": "claims",
        "workload": {"name": "digits_mlp"},
        "optimizers": [{"name": "sgd", "params": {"lr": [0.1, 0.2]}}],
        "seeds": [0],
        "steps": 10,
    }
)


def make_study(sessions: sessionmaker[Session], catalogue_data: dict[str, Any]) -> Study:
    errors, jobs = study_errors(SPEC, Catalogue.model_validate(catalogue_data), max_steps=100, max_jobs=10)
    assert not errors
    with sessions() as session:
        return study_store.create_study(session=session, spec=SPEC, jobs=jobs, submitted_by="alice")


def test_the_first_parent_run_recorded_stays(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    study = make_study(sessions, catalogue_data)
    with sessions() as session:
        assert (
            study_store.set_parent_run(session=session, study_id=study.id, experiment_id="1", run_id="a")
            == "a"
        )
        assert (
            study_store.set_parent_run(session=session, study_id=study.id, experiment_id="1", run_id="b")
            == "a"
        )


def test_a_study_is_claimed_once_its_jobs_ended_and_finalized_once(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    study = make_study(sessions, catalogue_data)
    with sessions() as session:
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is None  # jobs queued
        session.execute(
            update(Job).where(Job.id == study.members[0]["job_id"]).values(status=JobStatus.SUCCEEDED)
        )
        session.commit()
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is None  # one still queued
        session.execute(update(Job).where(Job.study_id == study.id).values(status=JobStatus.FAILED))
        session.commit()
        claimed = study_store.claim_study_to_finalize(session=session, lease_s=60)
        assert claimed is not None and claimed.id == study.id
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is None  # held
        # The claimant died: once its lease has run out, another takes the study.
        session.execute(update(Study).values(finalizing_until=utcnow() - timedelta(seconds=1)))
        session.commit()
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is not None
        study_store.record_summary(session=session, study_id=study.id, summary={"x": 1}, report_html="<p>")
        session.execute(update(Study).values(finalizing_until=None))
        session.commit()
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is None  # done: never again
        done = study_store.get_study(session=session, study_id=study.id)
        assert done is not None and done.finalized_at is not None and done.report_html == "<p>"


def set_status(sessions: sessionmaker[Session], job_id: int, status: JobStatus) -> None:
    with sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=status))
        session.commit()


def ended(sessions: sessionmaker[Session], study_id: int) -> tuple[Study, list[Job]]:
    with sessions() as session:
        study = study_store.get_study(session=session, study_id=study_id)
        assert study is not None
        return study, study_store.study_jobs(session=session, study_id=study_id)


def test_a_cancel_racing_the_last_jobs_end_does_not_kill_an_all_succeeded_study(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    """The cancel flags the study while its last job runs; the job succeeds before its worker sees the
    flag. Its parent run had ended KILLED (the finalizer read only the flag) over two succeeded jobs."""
    study = make_study(sessions, catalogue_data)
    first, last = (member["job_id"] for member in study.members)
    set_status(sessions, first, JobStatus.SUCCEEDED)
    set_status(sessions, last, JobStatus.RUNNING)
    with sessions() as session:
        cancelled = study_store.cancel_study(session=session, study_id=study.id)
    assert cancelled is not None and cancelled.cancel_requested
    set_status(sessions, last, JobStatus.SUCCEEDED)
    assert parent_run_status(*ended(sessions, study.id)) == "FINISHED"


def test_a_study_whose_cancel_stopped_a_job_ends_killed(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    study = make_study(sessions, catalogue_data)
    set_status(sessions, study.members[0]["job_id"], JobStatus.SUCCEEDED)
    with sessions() as session:
        study_store.cancel_study(session=session, study_id=study.id)  # the queued one: cancelled
    assert parent_run_status(*ended(sessions, study.id)) == "KILLED"


def test_a_job_cancelled_on_its_own_does_not_kill_its_study(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    study = make_study(sessions, catalogue_data)
    set_status(sessions, study.members[0]["job_id"], JobStatus.CANCELLED)
    set_status(sessions, study.members[1]["job_id"], JobStatus.SUCCEEDED)
    assert parent_run_status(*ended(sessions, study.id)) == "FINISHED"


def test_a_study_without_a_target_takes_its_workloads_default(catalogue_data: dict[str, Any]) -> None:
    data = json.loads(json.dumps(catalogue_data))
    data["workloads"][0]["default_target"] = {"metric": "val/accuracy", "mode": "max", "value": 0.9}
    assert data["workloads"][0]["name"] == "digits_mlp"
    target = target_of(SPEC, Catalogue.model_validate(data))
    assert target is not None and (target.metric, target.mode, target.value) == ("val/accuracy", "max", 0.9)
    given = StudySpec.model_validate(
        {**SPEC.model_dump(), "target": {"metric": "val/loss", "mode": "min", "value": 0.5}}
    )
    chosen = target_of(given, Catalogue.model_validate(data))
    assert chosen is not None and chosen.metric == "val/loss"
    data["workloads"][0].pop("default_target")
    assert target_of(SPEC, Catalogue.model_validate(data)) is None  # no default: none
