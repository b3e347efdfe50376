"""Fencing by attempt, claims by capability, waiting reasons, device refusals, slots, settings."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import CheckpointRecord, JobResult, JobStatus, Progress
from jobs.spec import CheckSpec, JobSpec
from service import store
from service import worker as worker_module
from service.app import create_app
from service.capabilities import catalogue_frameworks
from service.db import make_engine, migrate, session_factory
from service.models import Job, WorkerRow, utcnow
from service.settings import Settings
from service.store import ClaimFilter, Lease
from service.worker import Worker
from tests.conftest import ROOT

BODY: dict[str, Any] = {"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 10}


def spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({**BODY, **fields})


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else ""
    engine = make_engine(url or f"sqlite:///{tmp_path / 'optlab.db'}")
    migrate(engine)
    yield session_factory(engine)
    with engine.begin() as connection:  # the PostgreSQL database is shared by the session: leave it empty
        for table in ("jobs", "catalogue", "workers"):
            connection.execute(text(f"DELETE FROM {table}"))
    engine.dispose()


def test_every_write_of_a_superseded_attempt_is_refused(any_store: sessionmaker[Session]) -> None:
    with any_store() as session:
        job_id = store.create_job(session=session, spec=spec()).id
        store.claim_next(session=session, worker_id="w", lease_s=30)
        # Attempt 1's worker went quiet; the job went back to the queue and attempt 2 took it.
        assert store.requeue_job(session=session, job_id=job_id, worker_id="w", attempt=1, reason="test")
        again = store.claim_next(session=session, worker_id="w", lease_s=30)
        assert again is not None and again.attempt == 2
        stale: dict[str, Any] = {"session": session, "job_id": job_id, "worker_id": "w", "attempt": 1}
        late = Progress(step=9, total=10, checkpoint=CheckpointRecord(step=9, ok=True, path="/x"))
        assert store.record_progress(**stale, progress=late, workdir=None, lease_s=30) is Lease.LOST
        assert store.lease_of(**stale) is Lease.LOST
        result = JobResult(job_id=str(job_id), attempt=1, workdir="/w", status=JobStatus.SUCCEEDED)
        assert not store.finish_job(**stale, status=JobStatus.SUCCEEDED, result=result, error=None)
        assert not store.requeue_job(**stale, reason="late")
        current = {**stale, "attempt": 2}
        now = Progress(step=4, total=10, checkpoint=CheckpointRecord(step=4, ok=True, path="runs:/r/ck"))
        assert store.record_progress(**current, progress=now, workdir=None, lease_s=30) is Lease.HELD
        store.request_cancel(session=session, job_id=job_id)
        assert store.lease_of(**current) is Lease.CANCEL
    job = store.get_job(session=any_store(), job_id=job_id)
    assert job is not None and job.status is JobStatus.RUNNING and job.attempt == 2
    assert (job.step, job.checkpoint_step, job.checkpoint_ref) == (4, 4, "runs:/r/ck")


def test_a_worker_claims_only_the_jobs_it_can_run(any_store: sessionmaker[Session]) -> None:
    with any_store() as session:
        gpu = store.create_job(session=session, spec=spec(device="cuda")).id
        tensorflow = store.create_job(session=session, spec=spec(framework="tensorflow")).id
        two = store.create_job(session=session, spec=spec(distribution={"strategy": "ddp", "devices": 2})).id
        plain = store.create_job(session=session, spec=spec(device="cpu")).id
        cpu_worker = ClaimFilter(frameworks=("torch",), free_slots=1, free_gpu_slots=0)
        claimed = store.claim_next(session=session, worker_id="cpu", lease_s=30, fits=cpu_worker)
        assert claimed is not None and claimed.id == plain
        assert store.claim_next(session=session, worker_id="cpu", lease_s=30, fits=cpu_worker) is None
        wide = ClaimFilter(frameworks=("torch",), free_slots=2, free_gpu_slots=0)
        claimed = store.claim_next(session=session, worker_id="cpu2", lease_s=30, fits=wide)
        assert claimed is not None and claimed.id == two
        gpu_worker = ClaimFilter(frameworks=("torch", "tensorflow"), free_slots=1, free_gpu_slots=1)
        claimed = store.claim_next(session=session, worker_id="gpu", lease_s=30, fits=gpu_worker)
        assert claimed is not None and claimed.id == gpu
        claimed = store.claim_next(session=session, worker_id="gpu", lease_s=30, fits=gpu_worker)
        assert claimed is not None and claimed.id == tensorflow


@pytest.mark.parametrize(
    ("first", "free_slots", "free_gpu_slots", "claimed"),
    [
        ("ddp2", 1, 0, None),  # one of 2 CPU slots busy: the single job behind it waits too
        ("ddp2", 2, 0, "ddp2"),
        ("cuda", 1, 0, "single"),  # its GPU slot busy: a CPU job still takes the free CPU slot
        ("single", 1, 0, "single"),
    ],
)
def test_a_job_that_needs_more_slots_than_are_free_is_not_overtaken_by_younger_ones(
    any_store: sessionmaker[Session], first: str, free_slots: int, free_gpu_slots: int, claimed: str | None
) -> None:
    """A DDP job needing both slots of a 2-slot worker waited while every single-slot job submitted
    after it ran in the slot left free (a probe: a steady stream would hold it for ever)."""
    specs = {
        "ddp2": spec(batch_size=64, distribution={"strategy": "ddp", "devices": 2}, device="cpu"),
        "cuda": spec(device="cuda"),
        "single": spec(device="auto"),
    }
    with any_store() as session:
        ids = {first: store.create_job(session=session, spec=specs[first]).id}
        if first != "single":
            ids["single"] = store.create_job(session=session, spec=specs["single"]).id
        gpu_slots = 1 if first == "cuda" else 0
        fits = ClaimFilter(
            frameworks=("torch",),
            free_slots=free_slots,
            free_gpu_slots=free_gpu_slots,
            slots=2,
            gpu_slots=gpu_slots,
        )
        job = store.claim_next(session=session, worker_id="w", lease_s=30, fits=fits)
        assert (job.id if job else None) == (ids[claimed] if claimed else None)
        # A worker that could never run the older job (one slot in all) is not held back by it.
        narrow = ClaimFilter(frameworks=("torch",), free_slots=1, free_gpu_slots=0, slots=1)
        if first == "ddp2":
            taken = store.claim_next(session=session, worker_id="narrow", lease_s=30, fits=narrow)
            assert taken is not None and taken.id == ids["single"]


def test_the_store_lets_an_auto_ddp_job_claim_slots_of_one_kind_only(
    any_store: sessionmaker[Session],
) -> None:
    def claimable(free_slots: int, free_gpu_slots: int) -> list[str]:
        fits = ClaimFilter(frameworks=("torch",), free_slots=free_slots, free_gpu_slots=free_gpu_slots)
        with any_store() as session:
            rows = session.execute(select(Job.spec).where(store._fits(fits)).order_by(Job.id)).scalars()
            return [str(row["device"]) for row in rows]

    ddp = {"strategy": "ddp", "devices": 2}
    with any_store() as session:
        for device in ("auto", "cpu", "cuda"):
            store.create_job(session=session, spec=spec(batch_size=64, distribution=ddp, device=device))
    assert claimable(2, 1) == ["cpu"]  # one GPU slot and one CPU-only slot: `auto` would mix
    assert claimable(3, 2) == ["auto", "cpu", "cuda"]
    assert claimable(3, 1) == ["auto", "cpu"]  # two CPU-only slots
    assert claimable(2, 0) == ["auto", "cpu"]
    assert claimable(1, 1) == []


# Jobs of each kind a claim by optimizer tells apart, by what they run: a worker of plugins differing
# from its neighbours' (a rolling deploy, a plugin failing to import on one host) must leave a job of
# an optimizer it lacks to a worker that has it.
OPTIMIZER_JOBS: dict[str, dict[str, Any]] = {
    "plugin": {"optimizer": {"name": "sign_momentum"}},
    "builtin": {"optimizer": {"name": "adam"}},
    "tf plugin": {"framework": "tensorflow", "optimizer": {"name": "sign_momentum"}},
    "legacy plugin": {
        "framework": "tensorflow",
        "optimizer": {"name": "sign_momentum", "style": "tf_legacy"},
    },
    "wrapping plugin": {"optimizer": {"name": "lookahead", "base": {"name": "sign_momentum"}}},
    "wrapping builtin": {"optimizer": {"name": "lookahead", "base": {"name": "adam"}}},
}


@pytest.mark.parametrize(
    ("offered", "claimable"),
    [
        (
            None,
            [
                "plugin",
                "builtin",
                "tf plugin",
                "legacy plugin",
                "wrapping plugin",
                "wrapping builtin",
                "check",
            ],
        ),
        (
            {"torch": {"adam", "sign_momentum", "lookahead"}},
            ["plugin", "builtin", "wrapping plugin", "wrapping builtin", "check"],
        ),
        (
            {"torch": {"adam", "lookahead"}, "keras": {"sign_momentum"}},
            ["builtin", "tf plugin", "wrapping builtin"],
        ),
        # Offered in Keras 3's style only: a tf_legacy job of the name is not this worker's (claimed, it
        # had failed as "no tf_legacy style").
        ({"tf_legacy": {"sign_momentum"}}, ["legacy plugin"]),
        ({"torch": {"adam", "sign_momentum"}}, ["plugin", "builtin", "check"]),  # no wrapper here
        # A check job names a catalogue's optimizer as a training job does: claimed by a worker without
        # its plugin, it had failed "no optimizer named ... is registered".
        ({}, []),
    ],
)
def test_a_worker_claims_only_jobs_of_optimizers_its_own_catalogue_has(
    any_store: sessionmaker[Session], offered: dict[str, set[str]] | None, claimable: list[str]
) -> None:
    with any_store() as session:
        ids = {
            label: store.create_job(session=session, spec=spec(**fields)).id
            for label, fields in OPTIMIZER_JOBS.items()
        }
        check = CheckSpec.model_validate({"framework": "torch", "optimizer": {"name": "sign_momentum"}})
        ids["check"] = store.create_job(session=session, spec=check).id
    optimizers = None if offered is None else {f: frozenset(names) for f, names in offered.items()}
    fits = ClaimFilter(
        frameworks=("torch", "tensorflow"), free_slots=1, free_gpu_slots=0, optimizers=optimizers
    )
    with any_store() as session:
        found = session.execute(select(Job.id).where(store._fits(fits)).order_by(Job.id)).scalars().all()
    assert [label for label, job_id in ids.items() if job_id in found] == claimable


def with_plugin(catalogue: dict[str, Any]) -> dict[str, Any]:
    """`catalogue` as a worker whose plugin folder holds `sign_momentum` (a torch one) publishes it."""
    lion = next(o for o in catalogue["optimizers"] if (o["name"], o["style"]) == ("lion", "torch"))
    return {**catalogue, "optimizers": [*catalogue["optimizers"], {**lion, "name": "sign_momentum"}]}


def publish_as_worker(
    sessions: sessionmaker[Session], worker_id: str, catalogue: dict[str, Any], *, live: bool = True
) -> None:
    """What a worker's `publish_catalogue` stores: its snapshot and its row; not `live`: last seen a
    minute ago (stopped, as far as a 30 s lease tells)."""
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id=worker_id, catalogue=catalogue)
        store.register_worker(
            session=session,
            worker_id=worker_id,
            frameworks=catalogue_frameworks(catalogue),
            devices=["cpu"],
            gpus=0,
            slots=1,
            catalogue_sha256="0" * 64,
        )
        if not live:
            seen = utcnow() - timedelta(seconds=60)
            session.execute(update(WorkerRow).where(WorkerRow.worker_id == worker_id).values(last_seen=seen))
            session.commit()


@pytest.mark.parametrize(
    ("live", "published_last", "offered"),
    [
        (("with", "without"), "without", True),  # what any live worker offers, whichever published last
        (("without",), "with", False),  # not what a worker that stopped offered, though it published last
        ((), "with", True),  # none live (an API before its workers): the newest, as a job may wait
        ((), "without", False),
    ],
)
def test_the_api_validates_against_the_catalogues_of_the_live_workers(
    any_store: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    live: tuple[str, ...],
    published_last: str,
    offered: bool,
) -> None:
    catalogues = {"with": with_plugin(catalogue_data), "without": catalogue_data}
    for worker_id in sorted(catalogues, key=lambda worker_id: worker_id == published_last):
        publish_as_worker(any_store, worker_id, catalogues[worker_id], live=worker_id in live)
    cache = store.CatalogueCache(within_s=30)
    with any_store() as session:
        found = cache.latest(session=session)
        assert found is not None
        assert (found.catalogue.optimizer("sign_momentum", "torch") is not None) is offered
        # The union: each implementation once, the plugin's beside every built-in one.
        assert len(found.catalogue.optimizers) == len(catalogue_data["optimizers"]) + offered
        assert cache.latest(session=session) is found  # nothing changed: not read again
        assert store.catalogue_version(session=session, within_s=30) == found.version


def test_a_catalogue_of_several_live_workers_is_the_same_version_whatever_the_collation(
    catalogue_data: dict[str, Any],
) -> None:
    """ICU's en-US orders `worker-a` before `Worker-b`, Python the other way: the version asked and
    the version loaded had never compared equal, so every submission was retried, then refused (503)."""
    from tests.postgres import throwaway_database

    icu = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
    with throwaway_database("optlab_collation", icu) as url:
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        for worker in ("Worker-b", "worker-a"):
            publish_as_worker(sessions, worker, catalogue_data)
        cache = store.CatalogueCache(within_s=30)
        with sessions() as session:
            asked = store.catalogue_version(session=session, within_s=30)
            loaded = cache.latest(session=session)
            assert loaded is not None and loaded.version == asked
            assert cache.latest(session=session) is loaded  # read once, not at every submission
        engine.dispose()


def test_a_queued_job_of_an_optimizer_no_live_worker_offers_says_so(
    any_store: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    with any_store() as session:
        plugin = store.create_job(session=session, spec=spec(optimizer={"name": "sign_momentum"})).id
        wrapped = {"name": "lookahead", "base": {"name": "sign_momentum"}}
        wrapper_of_plugin = store.create_job(session=session, spec=spec(optimizer=wrapped)).id
        builtin = store.create_job(session=session, spec=spec()).id
    publish_as_worker(any_store, "without", catalogue_data)
    publish_as_worker(any_store, "stopped", with_plugin(catalogue_data), live=False)

    def reason(job_id: int) -> str | None:
        with any_store() as session:
            job = store.get_job(session=session, job_id=job_id)
            assert job is not None
            return store.waiting_reason(session=session, job=job, within_s=30)

    unoffered = "no live worker offers optimizer 'sign_momentum' for torch jobs (its plugin is missing"
    assert (reason(plugin) or "").startswith(unoffered)
    assert (reason(wrapper_of_plugin) or "").startswith("no live worker offers optimizer 'lookahead'")
    assert reason(builtin) is None  # it only waits its turn
    publish_as_worker(any_store, "with", with_plugin(catalogue_data))
    assert reason(plugin) is None


def test_a_worker_claims_by_its_catalogue_as_its_plugins_change(
    settings: Settings,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    produced = [catalogue_data]
    monkeypatch.setattr(worker_module, "produce_catalogue", lambda _settings: produced[-1])
    with sessions() as session:
        first, second = (
            store.create_job(session=session, spec=spec(optimizer={"name": "sign_momentum"})).id
            for _ in range(2)
        )
    worker = Worker(settings, sessions, worker_id="rolling", slots=2)
    worker.publish_catalogue()
    assert worker.claim() is None  # not deployed here yet: left queued
    produced.append(with_plugin(catalogue_data))
    worker.publish_catalogue()  # the plugin arrived
    claimed = worker.claim()
    assert claimed is not None and claimed[0].id == first
    produced.append(catalogue_data)
    worker.publish_catalogue()  # it went (or stopped importing)
    assert worker.claim() is None
    with sessions() as session:  # the other waits for a worker that has the plugin
        job = store.get_job(session=session, job_id=second)
        assert job is not None and job.status is JobStatus.QUEUED


def test_a_job_only_one_worker_offers_is_accepted_and_left_to_that_worker(
    client: TestClient,
    settings: Settings,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rolling deploy: worker A has the plugin, B not yet, and B published last. The API had
    refused the job (B's catalogue, the newest), or accepted it for B to claim and fail."""
    workers = {}
    for worker_id, catalogue in (("a", with_plugin(catalogue_data)), ("b", catalogue_data)):
        monkeypatch.setattr(worker_module, "produce_catalogue", lambda _settings, c=catalogue: c)
        workers[worker_id] = Worker(settings, sessions, worker_id=worker_id)
        workers[worker_id].publish_catalogue()
    body = {**BODY, "optimizer": {"name": "sign_momentum", "params": {"lr": 0.01}}}

    submitted = client.post("/jobs", json=body)

    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    assert workers["b"].claim() is None
    shown = client.get(f"/jobs/{job_id}").json()
    assert (shown["status"], shown["waiting_reason"]) == ("queued", None)  # A runs it: it waits its turn
    claimed = workers["a"].claim()
    assert claimed is not None and claimed[0].id == job_id
    with sessions() as session:  # A stops: no live worker offers it any more
        session.execute(
            update(WorkerRow)
            .where(WorkerRow.worker_id == "a")
            .values(last_seen=utcnow() - timedelta(seconds=60))
        )
        session.commit()
    refused = client.post("/jobs", json=body)
    assert refused.status_code == 422 and "unknown optimizer 'sign_momentum'" in refused.text


def register(sessions: sessionmaker[Session], worker_id: str, **fields: Any) -> None:
    values: dict[str, Any] = {"frameworks": ["torch"], "devices": ["cpu"], "gpus": 0, "slots": 1}
    with sessions() as session:
        store.register_worker(
            session=session, worker_id=worker_id, catalogue_sha256="0" * 64, **{**values, **fields}
        )


def test_a_running_job_whose_worker_died_says_when_no_live_worker_can_take_it_over(
    any_store: sessionmaker[Session],
) -> None:
    """Its 2-slot worker killed and replaced by a 1-slot one, a DDP job read as running, with no word."""
    with any_store() as session:
        ddp = spec(batch_size=64, distribution={"strategy": "ddp", "devices": 2})
        job_id = store.create_job(session=session, spec=ddp).id
        assert store.claim_next(session=session, worker_id="gone", lease_s=0.01) is not None

    def reason() -> str | None:
        with any_store() as session:
            job = store.get_job(session=session, job_id=job_id)
            assert job is not None and job.status is JobStatus.RUNNING
            return store.waiting_reason(session=session, job=job, within_s=30)

    register(any_store, "narrow", slots=1)
    time.sleep(0.05)  # its lease expired
    assert reason() == (
        "needs 2 slots of one kind (GPU or CPU-only) (distribution.devices); the largest live worker has 1"
    )
    register(any_store, "wide", slots=2)
    assert reason() is None  # it will be taken over


def test_devices_no_live_worker_offers_are_refused_and_waiting_jobs_say_why(
    client: TestClient, settings: Settings, sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    # A fresh start: no worker yet; the job is accepted and says it waits for one.
    first = client.post("/jobs", json={**BODY, "device": "cuda"})
    assert first.status_code == 201, first.text
    assert "none is running" in client.get(f"/jobs/{first.json()['id']}").json()["waiting_reason"]
    register(sessions, "cpu-only", slots=2)
    refused = client.post("/jobs", json={**BODY, "device": "cuda"})
    assert refused.status_code == 422
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["body", "device"] and "live workers offer: cpu" in problem["msg"]
    assert "needs a GPU" in client.get(f"/jobs/{first.json()['id']}").json()["waiting_reason"]
    # More slots than any live worker has: refused as an absent device is (it had waited for good,
    # counted against the queue's quotas); as many as the largest has, accepted.
    four = {**BODY, "batch_size": 64, "distribution": {"strategy": "ddp", "devices": 4}}
    refused = client.post("/jobs", json=four)
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["body", "distribution", "devices"]
    assert problem["msg"].startswith(
        "distribution.devices must be at most 2, the most slots a live worker running torch jobs has; "
        "received 4 (OPTLAB_QUEUE_FOR_ABSENT_DEVICES=true"
    )
    two = {**four, "distribution": {"strategy": "ddp", "devices": 2}}
    assert client.post("/jobs", json=two).status_code == 201
    cpu = client.post("/jobs", json={**BODY, "device": "cpu"}).json()
    assert client.get(f"/jobs/{cpu['id']}").json()["waiting_reason"] is None  # it only waits its turn
    over = client.post("/jobs", json={**BODY, "timeout_s": 10**6})
    assert over.status_code == 422 and "at most 86400 (OPTLAB_MAX_JOB_SECONDS)" in over.text
    lenient = settings.model_copy(update={"queue_for_absent_devices": True})
    with TestClient(create_app(lenient)) as other:
        assert other.post("/jobs", json={**BODY, "device": "cuda"}).status_code == 201
        waiting = other.post("/jobs", json=four).json()
        assert "needs 4 slots" in other.get(f"/jobs/{waiting['id']}").json()["waiting_reason"]


WRITES_ITS_GPUS = """#!/bin/sh
while [ $# -gt 0 ] && [ "$1" != "--workdir" ]; do shift; done; W="$2"
echo "${CUDA_VISIBLE_DEVICES-unset}" > "$W/gpus"
echo '{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}' > "$W/result.json"
"""


def test_slots_hand_each_job_its_own_gpus(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    program = tmp_path / "fake-python"
    program.write_text(WRITES_ITS_GPUS)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    with sessions() as session:
        jobs = [
            store.create_job(session=session, spec=spec(device="cuda")).id,
            store.create_job(session=session, spec=spec(device="cuda")).id,
            store.create_job(session=session, spec=spec(distribution={"strategy": "ddp", "devices": 2})).id,
        ]
    fast = settings.model_copy(update={"job_python": str(program), "poll_interval_s": 0.05})
    worker = Worker(fast, sessions, worker_id="gpu-host", gpus=["3", "5"])
    assert len(worker.slots) == 2  # one per GPU by default
    first, second = worker.claim(), worker.claim()  # both slots taken: nothing more fits
    assert first is not None and second is not None and worker.claim() is None
    assert [s.gpu for s in first[1] + second[1]] == ["3", "5"]
    for claimed in (first, second):
        worker._run_claimed(*claimed)
    assert worker.run_next() is True  # the two-device job, once both slots are free
    seen = [(fast.jobs_dir / str(j) / "attempt-1" / "gpus").read_text().strip() for j in jobs]
    assert seen == ["3", "5", "3,5"]


def test_optlab_db_upgrade_and_the_worker_options(tmp_path: Path) -> None:
    def optlab(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        environment = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "OPTLAB_DATA_DIR": str(tmp_path),
            **env,
        }
        return subprocess.run(
            [sys.executable, "-m", "service.cli", *args],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
        )

    upgraded = optlab("db", "upgrade")
    assert upgraded.returncode == 0 and "latest revision" in upgraded.stdout
    engine = make_engine(f"sqlite:///{tmp_path / 'optlab.db'}")
    assert {"jobs", "workers"} <= set(inspect(engine).get_table_names())
    engine.dispose()
    refused = optlab("worker", "--slots", "0")
    assert refused.returncode == 2 and "--slots: must be at least 1; received 0" in refused.stderr
    misconfigured = optlab("worker", OPTLAB_LEASE_S="15", OPTLAB_HEARTBEAT_S="8")
    assert misconfigured.returncode == 2
    assert "OPTLAB_HEARTBEAT_S must be under OPTLAB_LEASE_S / 2 (7.5); received 8" in misconfigured.stderr
