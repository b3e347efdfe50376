"""The job store on both databases it runs on: SQLite (embedded) and PostgreSQL (compose)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, inspect, text, update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import CheckpointRecord, ErrorRecord, JobResult, JobStatus, MlflowInfo, Progress
from jobs.spec import CheckSpec, JobSpec
from service import store
from service.db import MIGRATIONS, make_engine, migrate, session_factory
from service.models import Job, utcnow
from service.progress import interruption_line
from service.schemas import JobRead
from tests.postgres import throwaway_database

SPEC = JobSpec.model_validate(
    {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "adam", "params": {"lr": 0.001}}, "steps": 10}
)


def check_spec(
    name: str = "adam", framework: str = "torch", style: str | None = None, **params: Any
) -> CheckSpec:
    optimizer = {"name": name, "params": params, "style": style}
    return CheckSpec.model_validate({"framework": framework, "optimizer": optimizer, "checks": ["construct"]})


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    engine = make_engine(url)
    migrate(engine)
    migrate(engine)  # idempotent
    factory = session_factory(engine)
    yield factory
    with engine.begin() as connection:  # the PostgreSQL database is shared by the session
        connection.execute(text("DELETE FROM jobs"))
        connection.execute(text("DELETE FROM catalogue"))
    engine.dispose()


def test_create_get_list(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        ids = [store.create_job(session=session, spec=SPEC).id for _ in range(3)]
        job = store.get_job(session=session, job_id=ids[0])
        assert job is not None and job.status == "queued" and job.total_steps == 10
        assert job.status is JobStatus.QUEUED  # the stored string reads back as the enum
        assert JobSpec.model_validate(job.spec) == SPEC
        page, total = store.list_jobs(session=session, status="queued", limit=2, offset=0)
        assert total == 3 and [j.id for j in page] == [ids[2], ids[1]]
        assert store.list_jobs(session=session, status="running", limit=10, offset=0) == ([], 0)


def test_claim_takes_the_oldest_and_marks_it_running(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        first = store.create_job(session=session, spec=SPEC).id
        store.create_job(session=session, spec=SPEC)
    with sessions() as session:
        claimed = store.claim_next(session=session, worker_id="w1", lease_s=30)
    assert claimed is not None and claimed.id == first
    assert claimed.status == "running" and claimed.attempt == 1 and claimed.worker_id == "w1"
    assert claimed.started_at is not None and claimed.lease_expires_at is not None


def test_concurrent_claims_never_share_a_job(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        expected = {store.create_job(session=session, spec=SPEC).id for _ in range(30)}
    claimed: list[int] = []
    lock = threading.Lock()

    def claimer(name: str) -> None:
        while True:
            with sessions() as session:
                job = store.claim_next(session=session, worker_id=name, lease_s=30)
            if job is None:
                return
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == sorted(expected), "a job was claimed twice or not at all"


def test_cancel_queued_at_once_running_by_flag(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        queued = store.create_job(session=session, spec=SPEC).id
        running = store.create_job(session=session, spec=SPEC).id
    with sessions() as session:
        assert store.claim_next(session=session, worker_id="w", lease_s=30).id == queued  # type: ignore[union-attr]
    with sessions() as session:
        store.request_cancel(session=session, job_id=queued)
        store.request_cancel(session=session, job_id=running)
    with sessions() as session:
        first, second = (
            store.get_job(session=session, job_id=queued),
            store.get_job(session=session, job_id=running),
        )
        assert first is not None and first.status == "running" and first.cancel_requested
        assert second is not None and second.status == "cancelled" and second.finished_at is not None
        assert store.request_cancel(session=session, job_id=12345) is None


def test_a_cancel_records_whose_it_was_and_the_first_one_counts(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        running = store.create_job(session=session, spec=SPEC).id
        queued = store.create_job(session=session, spec=SPEC).id
    with sessions() as session:
        assert store.claim_next(session=session, worker_id="w", lease_s=30).id == running  # type: ignore[union-attr]
    with sessions() as session:
        for job_id in (running, queued):
            store.request_cancel(session=session, job_id=job_id, by="carol")
            again = store.request_cancel(session=session, job_id=job_id, by="alice")
            assert again is not None and again.cancelled_by == "carol"
            assert again.cancel_requested if job_id == running else again.status == "cancelled"
        open_api = store.create_job(session=session, spec=SPEC).id
        cancelled = store.request_cancel(session=session, job_id=open_api)
        assert cancelled is not None and cancelled.status == "cancelled" and cancelled.cancelled_by is None


def test_progress_finish_and_requeue(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
    mlflow = {"tracking_uri": "http://x", "experiment_id": "1", "run_id": "r", "run_url": "http://x/#/r"}
    with sessions() as session:
        cancel = store.record_progress(
            session=session,
            job_id=job_id,
            worker_id="w",
            attempt=1,
            progress=Progress(step=4, total=10, loss=0.5, mlflow=MlflowInfo.model_validate(mlflow)),
            workdir="/tmp/w",
            lease_s=30,
        )
        assert cancel is store.Lease.HELD
        store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason="worker stopped")
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.status == "queued" and job.step == 4 and job.mlflow == mlflow
        assert (
            job.error is not None
            and job.error["message"] == "worker stopped; it will run again from the start"
        )
        again = store.claim_next(session=session, worker_id="w2", lease_s=30)
        assert again is not None and again.attempt == 2
        result = JobResult(
            job_id=str(job_id),
            attempt=2,
            workdir="/tmp/w",
            status=JobStatus.SUCCEEDED,
            steps_completed=10,
            final={"train_loss": 0.25},
        )
        finish = {"session": session, "job_id": job_id, "result": result, "error": None}
        assert not store.finish_job(worker_id="w", attempt=2, status=JobStatus.FAILED, **finish)  # not w's
        assert not store.finish_job(worker_id="w2", attempt=1, status=JobStatus.FAILED, **finish)  # fenced
        assert store.finish_job(worker_id="w2", attempt=2, status=JobStatus.SUCCEEDED, **finish)
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.status == "succeeded" and job.step == 10 and job.latest_loss == 0.25
        history = JobRead.from_row(job).attempt_history  # the fenced-out finishes left no trace
        assert [(a.attempt, a.worker_id, a.step, a.ended, a.reason) for a in history] == [
            (1, "w", 4, "interrupted", "worker stopped; it will run again from the start"),
            (2, "w2", 10, "succeeded", None),
        ]
        with pytest.raises(ValueError, match="terminal status"):
            store.finish_job(
                session=session,
                job_id=job_id,
                worker_id="w2",
                attempt=2,
                status="running",
                result=None,
                error=None,
            )


def test_a_diverged_job_counts_the_steps_it_ran_ahead_of_its_progress(
    sessions: sessionmaker[Session],
) -> None:
    """Diverged at step 10 of a short job, before any progress report: it showed step 0, and its
    study's steps done left it out."""
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        result = JobResult(
            job_id=str(job_id), attempt=1, workdir="/tmp/w", status=JobStatus.DIVERGED, diverged_at_step=10
        )
        assert store.finish_job(
            session=session,
            job_id=job_id,
            worker_id="w",
            attempt=1,
            status=JobStatus.DIVERGED,
            result=result,
            error=ErrorRecord(type="Diverged", message="train/loss became nan at step 10"),
            step=0,
        )
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.step == 10


def test_an_attempt_that_fails_before_loading_its_checkpoint_keeps_the_checkpoints_step(
    sessions: sessionmaker[Session],
) -> None:
    """It showed 0/80000 after failing, though 12000 verified steps were done (and a resume starts there)."""
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        store.record_progress(
            session=session, job_id=job_id, worker_id="w", attempt=1, workdir=None, lease_s=30,
            progress=Progress(step=0, total=10), resumed_from=8,
        )  # fmt: skip
        assert store.finish_job(
            session=session,
            job_id=job_id,
            worker_id="w",
            attempt=1,
            status=JobStatus.FAILED,
            result=None,
            error=ErrorRecord(type="TrackingUnreachable", message="no answer"),
            step=0,
        )
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.step == 8
        assert JobRead.from_row(job).attempt_history[-1].step == 8


def test_a_running_job_says_what_holds_it_up_and_only_while_it_does(sessions: sessionmaker[Session]) -> None:
    held_up = "waiting for the MLflow server at http://x:5000 to start the job's run: 40 s so far"
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
    fenced: dict[str, Any] = {"job_id": job_id, "worker_id": "w", "workdir": None, "lease_s": 30}

    def report(session: Session, attempt: int, waiting: str | None) -> None:
        progress = Progress(step=0, total=10, waiting=waiting)
        assert (
            store.record_progress(session=session, attempt=attempt, progress=progress, **fenced)
            is store.Lease.HELD
        )

    def shown(session: Session) -> str | None:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None
        assert JobRead.from_row(job).waiting_reason == (
            job.waiting if job.status is JobStatus.RUNNING else None
        )
        return store.waiting_reason(session=session, job=job, within_s=30)

    with sessions() as session:
        report(session, 1, held_up)
        assert shown(session) == held_up
        report(session, 1, None)  # it goes on
        assert shown(session) is None
        report(session, 1, held_up)
        store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason="worker stopped")
    with sessions() as session:  # queued: why no worker runs it (none is live here), not the old wait
        assert shown(session) == "waiting for a worker: none is running (none was seen in the last lease)"
        store.claim_next(session=session, worker_id="w", lease_s=30)
        assert shown(session) is None  # a new attempt starts with nothing holding it up
        report(session, 2, held_up)
        assert store.finish_job(
            session=session,
            job_id=job_id,
            worker_id="w",
            attempt=2,
            status=JobStatus.FAILED,
            result=None,
            error=None,
        )
        assert shown(session) is None
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.waiting is None


def test_a_requeued_job_says_it_resumes_from_the_checkpoint_the_store_holds(
    sessions: sessionmaker[Session],
) -> None:
    """The checkpoint reported after the claim, not the one known at it (none): the message had said
    "from the start" of a job that then resumed from its step 800."""
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        checkpoint = CheckpointRecord(step=8, ok=True, path="runs:/r/checkpoints/step-8.pt")
        store.record_progress(
            session=session, job_id=job_id, worker_id="w", attempt=1, workdir=None, lease_s=30,
            progress=Progress(step=9, total=10, checkpoint=checkpoint),
        )  # fmt: skip
        assert store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason="stopped")
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.error is not None
        assert job.error["message"] == "stopped; it will run again from its checkpoint of step 8"
        # Shown as the interruption of a job that waits to run again, not as its error: it has not failed.
        shown = JobRead.from_row(job)
        assert shown.error is None and shown.interruption is not None
        assert shown.interruption["type"] == "Interrupted"
        assert interruption_line(shown.model_dump(mode="json")) == (
            "attempt 2: stopped; it will run again from its checkpoint of step 8"
        )
        # The next attempt reports step 0 until it has loaded that checkpoint: shown from step 8.
        again = store.claim_next(session=session, worker_id="w", lease_s=30)
        assert again is not None and again.attempt == 2
        for reported, shown_step in ((0, 8), (9, 9)):
            store.record_progress(
                session=session, job_id=job_id, worker_id="w", attempt=2, workdir=None, lease_s=30,
                progress=Progress(step=reported, total=10), resumed_from=8,
            )  # fmt: skip
            job = store.get_job(session=session, job_id=job_id)
            assert job is not None and job.step == shown_step


def test_a_job_cancelled_while_queued_to_run_again_is_not_said_never_to_have_started(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        ran = store.create_job(session=session, spec=SPEC).id
        never = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)  # the oldest: `ran`
        store.requeue_job(session=session, job_id=ran, worker_id="w", attempt=1, reason="worker stopped")
        messages = {}
        for job_id in (ran, never):
            job = store.request_cancel(session=session, job_id=job_id)
            assert job is not None and job.status == "cancelled" and job.error is not None
            messages[job_id] = job.error["message"]
    assert messages[never] == "cancelled before it started"
    assert messages[ran] == "cancelled while queued to run again (its earlier attempts: attempt_history)"


def test_catalogue_publish_and_latest(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    with sessions() as session:
        assert store.latest_catalogue(session=session, within_s=30) is None
        store.publish_catalogue(session=session, worker_id="w1", catalogue=catalogue_data)
        store.publish_catalogue(session=session, worker_id="w1", catalogue=catalogue_data)  # replaces
        found = store.latest_catalogue(session=session, within_s=30)
        assert found is not None and found.catalogue.optimizer("ema_momentum") is not None
        with pytest.raises(ValueError):
            store.publish_catalogue(session=session, worker_id="w2", catalogue={"optimizers": "nope"})


def test_a_job_whose_worker_stopped_answering_is_claimed_again(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        stranded = store.create_job(session=session, spec=SPEC).id
        doomed = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="dead", lease_s=30)
        store.claim_next(session=session, worker_id="dead", lease_s=30)
        store.request_cancel(session=session, job_id=doomed)  # flagged, but nobody is watching
        # The worker died: nothing renews its leases, and they run out.
        session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    with sessions() as session:
        again = store.claim_next(session=session, worker_id="alive", lease_s=30)
        assert again is not None and again.id == stranded and again.attempt == 2
        assert again.error is not None and again.error["type"] == "LeaseExpired"
        assert JobRead.from_row(again).error is None
        assert JobRead.from_row(again).interruption == again.error  # why attempt 2 runs
        [lost] = JobRead.from_row(again).attempt_history
        assert (lost.attempt, lost.worker_id, lost.ended) == (1, "dead", "lease expired")
        assert lost.reason == again.error["message"]
        assert interruption_line(JobRead.from_row(again).model_dump(mode="json")) == (
            "attempt 2: worker dead stopped answering; another attempt took the job over, from the start"
        )
        cancelled = store.get_job(session=session, job_id=doomed)
        assert cancelled is not None and cancelled.status == "cancelled"
        # The dead worker, should it wake up, can no longer touch the job.
        late = Progress(step=1, total=10)
        assert store.record_progress(
            session=session, job_id=stranded, worker_id="dead", attempt=1, progress=late,
            workdir=None, lease_s=30,
        ) is store.Lease.LOST  # fmt: skip
        assert store.claim_next(session=session, worker_id="alive", lease_s=30) is None


def test_a_job_whose_only_worker_died_says_so_and_a_cancel_ends_it_at_once(
    sessions: sessionmaker[Session],
) -> None:
    """With no worker left to claim it, it read `running` with nothing said, and a cancel stayed
    pending (attempt_history empty) until a worker started."""
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="dead", lease_s=30)
        shown = JobRead.from_row(store.get_job(session=session, job_id=job_id))  # type: ignore[arg-type]
        assert shown.interruption is None  # its lease holds: it runs
        session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
        shown = JobRead.from_row(store.get_job(session=session, job_id=job_id))  # type: ignore[arg-type]
        assert shown.status == "running" and shown.interruption is not None
        assert shown.interruption["type"] == "LeaseExpired"
        assert shown.interruption["message"].startswith(
            "its worker dead stopped answering (its lease expired at "
        )
        assert shown.interruption["message"].endswith("takes it over, from the start")
        cancelled = store.request_cancel(session=session, job_id=job_id, by="alice")
        assert cancelled is not None and cancelled.status == "cancelled" and cancelled.cancelled_by == "alice"
        [ended] = JobRead.from_row(cancelled).attempt_history
        assert (ended.attempt, ended.worker_id, ended.ended) == (1, "dead", "lease expired")
        assert JobRead.from_row(cancelled).interruption is None
        assert cancelled.cancel_requested  # its MLflow run is a worker's to end (runs_left_open)
        assert store.record_progress(
            session=session, job_id=job_id, worker_id="dead", attempt=1, progress=Progress(step=1, total=10),
            workdir=None, lease_s=30,
        ) is store.Lease.LOST  # fmt: skip


def test_a_cancel_requested_before_a_worker_stops_is_not_undone(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        store.request_cancel(session=session, job_id=job_id)
        killed = "its process was killed by signal 9 (SIGKILL) before it ended; retry 1 of 2"
        store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason=killed, retry=True)
        job = store.get_job(session=session, job_id=job_id)
        assert job is not None and job.status == "cancelled"
        # What ended the attempt, not "while its worker was stopping": no worker stopped.
        assert job.error == {"type": "Cancelled", "message": f"cancelled as its attempt ended ({killed})"}
        assert store.claim_next(session=session, worker_id="w", lease_s=30) is None


def finish_next(
    session: Session, status: JobStatus = JobStatus.SUCCEEDED, failed: tuple[str, ...] = ()
) -> int:
    job = store.claim_next(session=session, worker_id="w", lease_s=30)
    assert job is not None
    summary = {"pass": 1, "fail": len(failed), "warn": 0, "skip": 0, "failed": list(failed), "warned": []}
    result = JobResult(
        job_id=str(job.id),
        attempt=job.attempt,
        workdir="/tmp/w",
        status=status,
        report={"summary": summary},
        checks_failed=len(failed),
        steps_completed=1,
    )
    store.finish_job(
        session=session,
        job_id=job.id,
        worker_id="w",
        attempt=job.attempt,
        status=status,
        result=result,
        error=None,
    )
    return job.id


def test_jobs_have_a_kind_to_list_by(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        trained = store.create_job(session=session, spec=SPEC)
        checked = store.create_job(session=session, spec=check_spec())
        assert (trained.kind, checked.kind) == ("train", "check")
        assert (trained.total_steps, checked.total_steps) == (10, 1)
        page, total = store.list_jobs(session=session, status=None, kind="check", limit=10, offset=0)
        assert total == 1 and [j.id for j in page] == [checked.id]
        page, total = store.list_jobs(session=session, status="queued", kind="train", limit=10, offset=0)
        assert total == 1 and [j.id for j in page] == [trained.id]


def test_the_latest_check_with_a_report_per_style(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        for spec in (
            check_spec(lr=0.1),  # torch, superseded by the next
            check_spec(lr=0.2),  # torch, the latest with a report
            check_spec(framework="tensorflow", style="keras"),
            check_spec("sgd"),  # another optimizer
            SPEC,  # a training job of the same optimizer
            check_spec(lr=0.3),  # torch, newer but failed: no report
            check_spec(framework="tensorflow", style="tf_legacy"),  # still queued
        ):
            store.create_job(session=session, spec=spec)
        finished = [finish_next(session) for _ in range(5)]
        finish_next(session, status=JobStatus.FAILED)
        latest = store.latest_checks(session=session, name="adam", styles=["torch", "keras", "tf_legacy"])
        assert latest["tf_legacy"] is None
        assert latest["keras"] is not None and latest["keras"].id == finished[2]
        assert latest["torch"] is not None and latest["torch"].id == finished[1]
        assert latest["torch"].spec["optimizer"]["params"] == {"lr": 0.2}
        assert store.latest_checks(session=session, name="lion", styles=["torch"]) == {"torch": None}


def alembic_config(connection: object) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A database with no tables yet, on each backend."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'migrate.db'}")
        yield engine
        engine.dispose()
        return
    with throwaway_database("optlab_migrate") as url:
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


def test_jobs_from_before_kinds_become_training_jobs(empty_engine: Engine) -> None:
    with empty_engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0001")
        connection.execute(
            text(
                "INSERT INTO jobs (status, spec, created_at, updated_at, attempt, step, total_steps, "
                "cancel_requested) VALUES ('succeeded', :spec, :now, :now, 1, 10, 10, false)"
            ),
            {"spec": SPEC.model_dump_json(), "now": utcnow()},
        )
    migrate(empty_engine)
    assert "ix_jobs_kind" in {index["name"] for index in inspect(empty_engine).get_indexes("jobs")}
    with session_factory(empty_engine)() as session:
        (old,) = store.list_jobs(session=session, status=None, kind="train", limit=10, offset=0)[0]
        assert old.kind == "train" and JobSpec.model_validate(old.spec) == SPEC
        assert store.create_job(session=session, spec=check_spec()).kind == "check"
    with empty_engine.begin() as connection:  # and back down
        command.downgrade(alembic_config(connection), "0001")
    assert "kind" not in {column["name"] for column in inspect(empty_engine).get_columns("jobs")}


@pytest.mark.parametrize(("checkpoint_step", "starts_at"), [(None, 0), (500, 500)])
def test_a_new_attempt_starts_at_its_checkpoint_not_at_the_step_the_last_one_reached(
    sessions: sessionmaker[Session], checkpoint_step: int | None, starts_at: int
) -> None:
    """An attempt that ran again from the start and reported nothing had been recorded, and shown, at
    the step the attempt before it reached (700)."""
    with sessions() as session:
        job_id = store.create_job(session=session, spec=SPEC).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        checkpoint = (
            None
            if checkpoint_step is None
            else CheckpointRecord(step=checkpoint_step, ok=True, path="runs:/r/checkpoints/step.pt")
        )
        store.record_progress(
            session=session, job_id=job_id, worker_id="w", attempt=1, workdir=None, lease_s=30,
            progress=Progress(step=700, total=1000, checkpoint=checkpoint),
        )  # fmt: skip
        assert store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason="stopped")
        again = store.claim_next(session=session, worker_id="w", lease_s=30)
        assert again is not None and again.attempt == 2 and again.step == starts_at
        assert again.attempt_history is not None and again.attempt_history[0]["step"] == 700  # its own
