"""Benchmark: the wall time of N short real jobs on PostgreSQL with 1 worker and with 3 workers.

Each job is the cheapest real training job (`python -m jobs.run`: digits_mlp, 1 step, its
checkpoint verified, an MLflow run); workers run 2 slots each. Prints the wall time per
configuration, the attempts and the MLflow runs per job (each must be 1). Asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/many_jobs.py [JOBS]
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mlflow.tracking import MlflowClient

from jobs.spec import JobSpec
from service import store
from service.db import make_engine, migrate, session_factory
from tests.service.durable_helpers import mlflow_server, postgres_database, start_worker

SLOTS = 2


def run(jobs: int, workers: int, mlflow_url: str, folder: Path) -> None:
    experiment = f"many-{workers}w-{int(time.time())}"
    with postgres_database("optlab_bench") as (url, _):
        engine = make_engine(url)
        migrate(engine)
        sessions = session_factory(engine)
        with sessions() as session:
            ids = [
                store.create_job(
                    session=session,
                    spec=JobSpec.model_validate(
                        {
                            "workload": {"name": "digits_mlp"},
                            "optimizer": {"name": "sgd", "params": {"lr": 0.1}},
                            "steps": 1,
                            "batch_size": 16,
                            "checkpoint_every": 1,
                            "eval_every": 1,
                            "device": "cpu",
                            "seed": seed,
                            "experiment": experiment,
                        }
                    ),
                ).id
                for seed in range(jobs)
            ]
        env = {
            "OPTLAB_DATABASE_URL": url,
            "OPTLAB_DATA_DIR": str(folder / f"data-{workers}"),
            "OPTLAB_MLFLOW_TRACKING_URI": mlflow_url,
            "OPTLAB_POLL_INTERVAL_S": "0.2",
        }
        started = time.monotonic()
        processes = [
            start_worker(f"w{i}", SLOTS, env, folder / f"w{workers}-{i}.log") for i in range(workers)
        ]
        while True:
            with sessions() as session:
                rows = [store.get_job(session=session, job_id=i) for i in ids]
            if all(r is not None and r.status.terminal for r in rows):
                break
            time.sleep(0.5)
        wall = time.monotonic() - started
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=60)
        engine.dispose()
    statuses = Counter(str(r.status) for r in rows if r is not None)
    attempts = Counter(r.attempt for r in rows if r is not None)
    client = MlflowClient(tracking_uri=mlflow_url)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], max_results=1000) if found else []
    per_job = Counter(Counter(r.data.tags.get("job_id") for r in runs).values())
    print(
        f"{jobs} jobs, {workers} worker(s) x {SLOTS} slots: {wall:.1f} s wall "
        f"({wall / jobs:.2f} s per job); statuses {dict(statuses)}; attempts {dict(attempts)}; "
        f"MLflow runs per job {dict(per_job)}",
        flush=True,
    )


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        with mlflow_server(folder) as mlflow_url:
            for workers in (1, 3):
                run(jobs, workers, mlflow_url, folder)


if __name__ == "__main__":
    main()
