"""Benchmark `queue` (this name does not shadow the standard library's `queue`): workers on
PostgreSQL claiming no-op jobs through the store's claim path.

`--jobs` jobs are queued in a throwaway PostgreSQL database; `--workers` worker processes (each
its own engine and connection, as separate `optlab worker` daemons have) claim them with
`service.store.claim_next` (`FOR UPDATE SKIP LOCKED` plus the conditional update) and finish each
at once with `service.store.finish_job`, until none is left. A no-op job measures the queue, not
the training: spawning `python -m jobs.run` costs seconds per job (see `startup.py`).

Reported: claims per second (all claims over the time from the first to the last), per worker,
and duplicates: a job claimed twice, or a job not ending `succeeded` with attempt 1, counts.
Target (issue 15): zero duplicates. Run: `python benchmarks/queue_claims.py [--jobs 1000] [--workers 4]`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections import Counter
from typing import Any

from common import bench_line, machine_line, postgres_database

SPEC = {
    "framework": "torch",
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
    "steps": 10,
    "experiment": "bench-queue",
}


def queue_jobs(url: str, count: int) -> None:
    from jobs.spec import parse_spec
    from service import store
    from service.db import make_engine, migrate, session_factory

    engine = make_engine(url)
    migrate(engine)
    spec = parse_spec(json.dumps(SPEC))
    with session_factory(engine)() as session:
        for _ in range(count):
            store.create_job(session=session, spec=spec)
    engine.dispose()


def claim_until_empty(url: str, worker: int, start: Any, out: Any) -> None:
    from jobs.result import JobStatus
    from service import store
    from service.db import make_engine, session_factory

    engine = make_engine(url)
    sessions = session_factory(engine)
    worker_id = f"bench-worker-{worker}"
    claimed: list[tuple[int, float]] = []
    start.wait()
    while True:
        with sessions() as session:
            job = store.claim_next(session=session, worker_id=worker_id, lease_s=60)
            if job is None:
                break
            claimed.append((job.id, time.time()))
            store.finish_job(
                session=session,
                job_id=job.id,
                worker_id=worker_id,
                status=JobStatus.SUCCEEDED,
                result=None,
                error=None,
            )
    engine.dispose()
    out.put((worker, claimed))


def final_states(url: str) -> Counter[tuple[str, int]]:
    from sqlalchemy import select

    from service.db import make_engine, session_factory
    from service.models import Job

    engine = make_engine(url)
    with session_factory(engine)() as session:
        rows = session.execute(select(Job.status, Job.attempt)).all()
    engine.dispose()
    return Counter((str(getattr(status, "value", status)), int(attempt)) for status, attempt in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print(machine_line())
    context = multiprocessing.get_context("spawn")
    with postgres_database() as url:
        queue_jobs(url, args.jobs)
        start, out = context.Event(), context.Queue()
        workers = [
            context.Process(target=claim_until_empty, args=(url, index, start, out))
            for index in range(args.workers)
        ]
        for process in workers:
            process.start()
        time.sleep(3)  # every worker imported and connected before the start
        start.set()
        results = [out.get(timeout=600) for _ in workers]
        for process in workers:
            process.join()
        states = final_states(url)
    claims = [(job_id, moment) for _, claimed in results for job_id, moment in claimed]
    moments = [moment for _, moment in claims]
    span = max(moments) - min(moments) if len(moments) > 1 else float("nan")
    counts = Counter(job_id for job_id, _ in claims)
    duplicates = sum(count - 1 for count in counts.values() if count > 1)
    wrong = sum(count for state, count in states.items() if state != ("succeeded", 1))
    print(f"\n{args.workers} workers, {args.jobs} no-op jobs on PostgreSQL")
    for worker, claimed in sorted(results):
        print(f"  worker {worker}: {len(claimed)} claims")
    print(f"  {len(claims)} claims in {span:.2f} s: {len(claims) / span:.0f} claims/s")
    print(f"  duplicates: {duplicates}; jobs not succeeded at attempt 1: {wrong} ({dict(states)})")
    bench_line(
        "queue",
        workers=args.workers,
        jobs=args.jobs,
        claims=len(claims),
        claims_per_s=len(claims) / span,
        duplicates=duplicates + wrong,
    )
    print(machine_line())


if __name__ == "__main__":
    main()
