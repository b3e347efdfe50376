"""Which GPUs a job sees through the service: a worker picks them, so a spec cannot name one by
index (`cuda:1`), and a job's slots are all GPU or all CPU-only ones (`auto` DDP)."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import JobStatus
from service import store
from service.app import create_app
from service.settings import Settings
from service.worker import Worker
from tests.service.test_capabilities import BODY, WRITES_ITS_GPUS, register, spec
from tests.service.test_studies_api import STUDY

DDP2 = {"batch_size": 64, "distribution": {"strategy": "ddp", "devices": 2}}


def gpu_worker(tmp_path: Path, settings: Settings, sessions: sessionmaker[Session], **kw: Any) -> Worker:
    """A worker with simulated GPUs whose job processes write the CUDA_VISIBLE_DEVICES they got."""
    program = tmp_path / "fake-python"
    program.write_text(WRITES_ITS_GPUS)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    fast = settings.model_copy(update={"job_python": str(program), "poll_interval_s": 0.05})
    return Worker(fast, sessions, worker_id="gpu-host", **kw)


def seen_gpus(settings: Settings, job_id: int) -> str:
    return (settings.jobs_dir / str(job_id) / "attempt-1" / "gpus").read_text().strip()


@pytest.mark.parametrize("queue_for_absent", [False, True])
def test_a_gpu_index_is_refused_at_submission_saying_what_to_write(
    client: TestClient,
    settings: Settings,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    queue_for_absent: bool,
) -> None:
    register(sessions, "gpu-host", devices=["cpu", "cuda"], gpus=2, slots=2)
    lenient = settings.model_copy(update={"queue_for_absent_devices": queue_for_absent})
    with TestClient(create_app(lenient)) as api:
        for body in ({**BODY, "device": "cuda:1"}, {**BODY, **DDP2, "device": "cuda:1"}):
            refused = api.post("/jobs", json=body)
            assert refused.status_code == 422, refused.text
            [problem] = refused.json()["detail"]
            assert problem["loc"] == ["body", "device"]
            assert "device 'cuda:1' names a GPU by its index" in problem["msg"]
            assert "write 'cuda'" in problem["msg"] and "python -m jobs.run" in problem["msg"]
        study = api.post("/studies", json={**STUDY, "device": "cuda:3"})
        assert study.status_code == 422, study.text
        assert [p["loc"] for p in study.json()["detail"]] == [["body", "device"]]
        # The first GPU the job sees (what `cuda` means too) names no physical GPU: accepted.
        for device in ("cuda", "cuda:0", "auto"):
            assert api.post("/jobs", json={**BODY, "device": device}).status_code == 201, device
        assert api.post("/jobs", json={**BODY, **DDP2, "device": "cuda:0"}).status_code == 201
    with sessions() as session:  # nothing of the refused ones was stored
        stored, _ = store.list_jobs(session=session, status=None, limit=50, offset=0)
        assert [j.spec["device"] for j in stored] == [
            "cuda:0",
            "auto",
            "cuda:0",
            "cuda",
        ]


def test_a_stored_gpu_index_fails_at_once_without_a_process(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # Stored before the API refused it: the worker says what to write, and starts nothing.
    with sessions() as session:
        job_id = store.create_job(session=session, spec=spec(device="cuda:1")).id
    worker = gpu_worker(tmp_path, settings, sessions, gpus=["3", "5"])
    assert worker.run_next() is True
    assert worker.free == {0, 1}
    with sessions() as session:
        job = store.get_job(session=session, job_id=job_id)
    assert job is not None and job.status is JobStatus.FAILED and job.error is not None
    assert job.error["type"] == "DeviceRefused"
    assert "device 'cuda:1' names a GPU by its index" in job.error["message"]
    assert not (worker.settings.jobs_dir / str(job_id) / "attempt-1" / "gpus").exists()


def test_an_auto_ddp_job_takes_gpu_slots_only_or_cpu_slots_only(
    tmp_path: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # Two GPUs and one CPU-only slot: an `auto` job's two ranks both get a GPU, never one GPU and
    # one CPU slot; a one-slot `auto` job takes the CPU-only slot first, as before.
    with sessions() as session:
        ddp = store.create_job(session=session, spec=spec(**DDP2)).id
        single = store.create_job(session=session, spec=spec()).id
    worker = gpu_worker(tmp_path, settings, sessions, gpus=["3", "5"], slots=3)
    first, second = worker.claim(), worker.claim()
    assert first is not None and second is not None and worker.claim() is None
    assert [s.gpu for s in first[1]] == ["3", "5"] and [s.gpu for s in second[1]] == [None]
    for claimed in (first, second):
        worker._run_claimed(*claimed)
    assert seen_gpus(worker.settings, ddp) == "3,5" and seen_gpus(worker.settings, single) == ""
    # Enough CPU-only slots: all of them, and the job sees no GPU (its ranks run on the CPU).
    with sessions() as session:
        on_cpu = store.create_job(session=session, spec=spec(**DDP2)).id
    host = gpu_worker(tmp_path, settings, sessions, gpus=["7"], slots=3)
    assert host.run_next() is True
    assert seen_gpus(host.settings, on_cpu) == ""


def test_an_auto_ddp_job_that_would_mix_waits_or_is_refused_and_a_cpu_one_runs(
    tmp_path: Path,
    client: TestClient,
    settings: Settings,
    sessions: sessionmaker[Session],
) -> None:
    # One GPU and one CPU-only slot: two slots of one kind there are not.
    worker = gpu_worker(tmp_path, settings, sessions, gpus=["3"], slots=2)
    register(sessions, worker.worker_id, devices=["cpu", "cuda"], gpus=1, slots=2)  # as it publishes
    refused = client.post("/jobs", json={**BODY, **DDP2})
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["body", "distribution", "devices"]
    assert problem["msg"].startswith("distribution.devices must be at most 1, the most slots of one kind")
    with sessions() as session:
        auto = store.create_job(session=session, spec=spec(**DDP2)).id  # as if queued meanwhile
        cpu = store.create_job(session=session, spec=spec(**DDP2, device="cpu")).id
    waiting = client.get(f"/jobs/{auto}").json()["waiting_reason"]
    assert "needs 2 slots of one kind (GPU or CPU-only)" in waiting and "has 1" in waiting
    # A `cpu` job uses no GPU: it may take both (as before); the `auto` one is not claimed.
    claimed = worker.claim()
    assert claimed is not None and claimed[0].id == cpu and worker.claim() is None
    worker._run_claimed(*claimed)
    assert worker.claim() is None
    assert client.post("/jobs", json={**BODY, **DDP2, "device": "cpu"}).status_code == 201
