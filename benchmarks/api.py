"""Benchmark: job submission through the API (`optlab api`), SQLite and PostgreSQL, and MLflow's
`create_run` side by side.

For each store a real `optlab api` process (uvicorn) is started on a fresh store with a published
catalogue (as a worker publishes it: `python -m jobs.catalogue`). Then:

- open loop: `POST /jobs` at fixed offered rates (`--rates`/s for `--seconds`), each request sent
  at its scheduled time whether or not earlier ones have answered; latency is counted from the
  scheduled time (so a stalled server cannot hide its queue);
- flat out: `--clients` clients, each sending its next request when the last one answered.

Reported: achieved throughput, p50/p99 latency, the answers' status codes (5xx counted as
`server_errors`, no answer within 10 s as `failed_requests`), whether every accepted (201) job is
in the store, and the API's last logged traceback if it logged any. The same open loop against a
real MLflow server's `runs/create` is the peer. Target (issue 15): p99 under 50 ms at 400/s offered.
Run: `python benchmarks/api.py [--rates 100,400] [--seconds 5] [--clients 25] [--stores sqlite,postgresql]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import (
    PYTHON,
    ROOT,
    bench_line,
    free_port,
    machine_line,
    mlflow_server,
    postgres_database,
    stop_group,
    wait_http,
)

SPEC = {
    "framework": "torch",
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
    "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
    "steps": 300,
    "batch_size": 64,
    "seed": 0,
    "experiment": "bench-api",
}


def catalogue() -> dict[str, Any]:
    completed = subprocess.run(
        [PYTHON, "-m", "jobs.catalogue"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    data: dict[str, Any] = json.loads(completed.stdout)
    return data


@contextlib.contextmanager
def api_server(database_url: str, folder: Path, published: dict[str, Any]) -> Iterator[str]:
    from service import store
    from service.db import make_engine, migrate, session_factory

    engine = make_engine(database_url)
    migrate(engine)
    with session_factory(engine)() as session:
        store.publish_catalogue(session=session, worker_id="bench", catalogue=published)
    engine.dispose()
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OPTLAB_DATABASE_URL": database_url,
        "OPTLAB_DATA_DIR": str(folder),
        "OPTLAB_API_PORT": str(port),
        "OPTLAB_MAX_QUEUED": "10000000",
        "OPTLAB_MAX_QUEUED_PER_TOKEN": "10000000",
    }
    log = open(folder / "api.log", "wb")
    server = subprocess.Popen(
        [PYTHON, "-m", "service.cli", "api"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", process=server)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(server)
        log.close()


def jobs_in_store(database_url: str) -> int:
    from sqlalchemy import func, select

    from service.db import make_engine, session_factory
    from service.models import Job

    engine = make_engine(database_url)
    try:
        with session_factory(engine)() as session:
            return int(session.scalar(select(func.count()).select_from(Job)) or 0)
    finally:
        engine.dispose()


Request = Callable[[Any], Any]
TIMEOUT_S = 10.0  # an overloaded server fails fast rather than holding the benchmark for minutes
MAX_IN_FLIGHT = 64


async def open_loop(send: Request, rate: float, seconds: float) -> tuple[list[float], Counter[int], float]:
    import httpx

    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    # At most MAX_IN_FLIGHT requests at once: thousands of tasks queued on httpx's connection pool
    # make the client, not the server, the bottleneck. A request that must wait for a free slot
    # still counts its latency from its scheduled time, so a slow server cannot hide its queue.
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter() + 0.05
        total = int(rate * seconds)

        async def one(index: int) -> None:
            scheduled = start + index / rate
            async with slots:
                try:
                    response = await send(client)
                    statuses[response.status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1
            latencies.append(time.perf_counter() - scheduled)

        tasks = []
        for index in range(total):
            await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(index)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return latencies, statuses, elapsed


async def flat_out(send: Request, clients: int, seconds: float) -> tuple[list[float], Counter[int], float]:
    import httpx

    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=clients)) as client:
        start = time.perf_counter()
        deadline = start + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                try:
                    response = await send(client)
                    statuses[response.status_code] += 1
                except httpx.HTTPError:
                    statuses[0] += 1
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return latencies, statuses, elapsed


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary(label: str, latencies: list[float], statuses: Counter[int], elapsed: float) -> dict[str, float]:
    ok = sum(count for code, count in statuses.items() if 200 <= code < 300)
    figures = {
        "accepted": float(ok),
        "throughput": ok / elapsed,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
        "server_errors": float(sum(count for code, count in statuses.items() if code >= 500)),
        "failed_requests": float(statuses.get(0, 0)),
    }
    codes = ", ".join(f"{code or 'error'}: {count}" for code, count in sorted(statuses.items()))
    print(
        f"  {label:<28} {figures['throughput']:7.0f}/s accepted  p50 {figures['p50_ms']:7.1f} ms  "
        f"p99 {figures['p99_ms']:7.1f} ms  ({codes})"
    )
    return figures


def drive(target: str, send: Request, args: argparse.Namespace, rates: list[float] | None = None) -> int:
    """Open loop at each offered rate, then flat out; one BENCH line each. Returns the 2xx count."""
    accepted = 0
    for rate in rates or args.rates:
        figures = summary(
            f"open loop {rate:.0f}/s offered", *asyncio.run(open_loop(send, rate, args.seconds))
        )
        accepted += int(figures["accepted"])
        bench_line("api", target=target, mode="open", offered=rate, **figures)
    figures = summary(
        f"flat out, {args.clients} clients", *asyncio.run(flat_out(send, args.clients, args.seconds))
    )
    accepted += int(figures["accepted"])
    bench_line("api", target=target, mode="flat", clients=args.clients, **figures)
    return accepted


def bench_store(name: str, database_url: str, args: argparse.Namespace, published: dict[str, Any]) -> None:
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-api-{name}-") as folder,
        api_server(database_url, Path(folder), published) as url,
    ):
        body = json.dumps(SPEC)

        def submit(client: Any) -> Any:
            return client.post(f"{url}/jobs", content=body, headers={"content-type": "application/json"})

        asyncio.run(open_loop(submit, 50, 1))  # warm-up: connections, the catalogue cache
        before = jobs_in_store(database_url)
        print(f"\n{name}: POST /jobs")
        accepted = drive(name, submit, args)
        stored = jobs_in_store(database_url) - before
        print(f"  accepted (201) in all runs: {accepted}; new jobs in the store: {stored}")
        server_errors = (Path(folder) / "api.log").read_text(errors="replace").count("Traceback")
        if server_errors:
            print(f"  the API logged {server_errors} tracebacks; the last:")
            log = (Path(folder) / "api.log").read_text(errors="replace")
            print("    " + log[log.rindex("Traceback") :][-1500:].replace("\n", "\n    "))
    bench_line(
        "api", target=name, mode="store", accepted=accepted, stored=stored, stored_ok=int(stored == accepted)
    )


def bench_mlflow(args: argparse.Namespace) -> None:
    with mlflow_server(workers=2) as uri:
        from mlflow import MlflowClient

        experiment_id = MlflowClient(uri).create_experiment("bench-api")
        body = json.dumps({"experiment_id": experiment_id, "run_name": "bench", "start_time": 0})

        def create_run(client: Any) -> Any:
            return client.post(
                f"{uri}/api/2.0/mlflow/runs/create",
                content=body,
                headers={"content-type": "application/json"},
            )

        asyncio.run(open_loop(create_run, 20, 1))
        print("\nMLflow server (SQLite, 2 workers): runs/create")
        # The lowest rate only: MLflow saturates far below 400/s here, and each request past its
        # capacity waits out the client's timeout (minutes in all).
        drive("mlflow_create_run", create_run, args, rates=[min(args.rates)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", default="100,400", help="offered submissions per second, comma-separated (open loop)"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=25)
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("--no-mlflow", action="store_true", help="skip the MLflow create_run peer")
    args = parser.parse_args()
    args.rates = [float(rate) for rate in args.rates.split(",")]
    print(machine_line())
    published = catalogue()
    for name in args.stores.split(","):
        if name == "sqlite":
            with tempfile.TemporaryDirectory(prefix="bench-api-db-") as folder:
                bench_store(name, f"sqlite:///{folder}/optlab.db", args, published)
        else:
            with postgres_database() as url:
                bench_store(name, url, args, published)
    if not args.no_mlflow:
        bench_mlflow(args)
    print(machine_line())


if __name__ == "__main__":
    main()
