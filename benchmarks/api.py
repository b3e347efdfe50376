"""Benchmark: job submission through the API (`optlab api`), SQLite and PostgreSQL, and MLflow's
`create_run` side by side.

For each store a real `optlab api` process (uvicorn) is started on a fresh store with a published
catalogue (as a worker publishes it: `python -m jobs.catalogue`). The load comes from
`load_generator.py`, a separate process with raw asyncio HTTP/1.1 keep-alive connections (it
shares the cores with the server; its own CPU time per request is printed beside the server's):

- open loop: `POST /jobs` at fixed offered rates (`--rates`/s for `--seconds`), each request sent
  at its scheduled time whether or not earlier ones have answered, on at most `--connections` at
  once; latency is counted from the scheduled time (so a stalled server cannot hide its queue);
- flat out: `--clients` connections, each sending its next request when the last one answered.

Reported: achieved throughput, p50/p99 latency, the answers' status codes (5xx counted as
`server_errors`, no answer within 10 s as `failed_requests`), the CPU time per request of the
server (all its processes) and of the generator, whether every accepted (201) job is in the store,
and the API's last logged traceback if it logged any. The same open loop against a real MLflow
server's `runs/create` is the peer. Target (issue 15): p99 under 50 ms at 400/s offered.
Run: `python benchmarks/api.py [--rates 100,400] [--seconds 5] [--clients 25] [--connections 64]
[--workers 1] [--stores sqlite,postgresql] [--no-mlflow]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
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
def api_server(database_url: str, folder: Path, published: dict[str, Any], workers: int) -> Iterator[Server]:
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
        [PYTHON, "-m", "service.cli", "api", *(["--workers", str(workers)] if workers > 1 else [])],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", process=server)
        yield Server(f"http://127.0.0.1:{port}", server)
    finally:
        stop_group(server)
        log.close()


def jobs_in_store(database_url: str) -> set[int]:
    from sqlalchemy import select

    from service.db import make_engine, session_factory
    from service.models import Job

    engine = make_engine(database_url)
    try:
        with session_factory(engine)() as session:
            return set(session.scalars(select(Job.id)).all())
    finally:
        engine.dispose()


TIMEOUT_S = 10.0  # an overloaded server fails fast rather than holding the benchmark for minutes
GENERATOR = Path(__file__).with_name("load_generator.py")


class Server:
    """A server under test: its URL, and its process group (for the CPU time it spends)."""

    def __init__(self, url: str, process: subprocess.Popen[Any] | None = None) -> None:
        self.url, self.process = url, process

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server's process group has spent so far (its workers too)."""
        if self.process is None:
            return float("nan")
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.process.pid:  # the process group a server's workers share
                    total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        return total / tick


def load(
    target: str,
    body: str,
    args: argparse.Namespace,
    rate: float = 0.0,
    seconds: float | None = None,
    connections: int | None = None,
) -> dict[str, Any]:
    """One run of the load generator in its own process (rate 0: flat out); its JSON answer."""
    command = [
        PYTHON, str(GENERATOR), target, "--body", body, "--rate", str(rate),
        "--seconds", str(args.seconds if seconds is None else seconds),
        "--connections", str(connections or (args.connections if rate else args.clients)),
        "--timeout", str(TIMEOUT_S),
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(completed.stdout)
    return result


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary(label: str, result: dict[str, Any], server_cpu_s: float) -> dict[str, float]:
    latencies: list[float] = result["latencies"]
    statuses = Counter({int(code): count for code, count in result["statuses"].items()})
    answered = max(1, len(latencies))
    ok = sum(count for code, count in statuses.items() if 200 <= code < 300)
    figures = {
        "accepted": float(ok),
        "throughput": ok / result["elapsed"],
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
        "server_errors": float(sum(count for code, count in statuses.items() if code >= 500)),
        "failed_requests": float(statuses.get(0, 0)),
        "server_cpu_ms": server_cpu_s * 1000 / answered,  # per request
        "generator_cpu_ms": result["cpu_s"] * 1000 / answered,
    }
    codes = ", ".join(f"{code or 'error'}: {count}" for code, count in sorted(statuses.items()))
    print(
        f"  {label:<28} {figures['throughput']:5.0f}/s accepted  p50 {figures['p50_ms']:7.1f} ms  "
        f"p99 {figures['p99_ms']:7.1f} ms  CPU/request: server {figures['server_cpu_ms']:4.2f} ms, "
        f"generator {figures['generator_cpu_ms']:4.2f} ms  ({codes})",
        flush=True,
    )
    return figures


def drive(
    target: str,
    server: Server,
    path: str,
    body: str,
    args: argparse.Namespace,
    rates: list[float] | None = None,
) -> tuple[int, set[int]]:
    """Open loop at each offered rate, then flat out; one BENCH line each. Returns the 2xx count
    and the ids the 201 answers named."""
    accepted, created = 0, set()
    runs = [(f"open loop {rate:.0f}/s offered", rate) for rate in rates or args.rates]
    runs.append((f"flat out, {args.clients} connections", 0.0))
    for label, rate in runs:
        cpu = server.cpu_s()
        result = load(server.url + path, body, args, rate=rate)
        figures = summary(label, result, server.cpu_s() - cpu)
        accepted += int(figures["accepted"])
        created.update(result["created"])
        if rate:
            bench_line(
                "api", target=target, mode="open", offered=rate, connections=args.connections, **figures
            )
        else:
            bench_line("api", target=target, mode="flat", clients=args.clients, **figures)
    return accepted, created


def bench_store(name: str, database_url: str, args: argparse.Namespace, published: dict[str, Any]) -> None:
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-api-{name}-") as folder,
        api_server(database_url, Path(folder), published, args.workers) as server,
    ):
        body = json.dumps(SPEC)
        load(server.url + "/jobs", body, args, rate=50, seconds=1, connections=8)  # warm-up
        before = jobs_in_store(database_url)
        print(f"\n{name}: POST /jobs ({args.workers} API worker process{'es' if args.workers > 1 else ''})")
        accepted, created = drive(name, server, "/jobs", body, args)
        stored = jobs_in_store(database_url) - before
        missing = len(created - stored)
        # A job stored whose 201 came after the generator's timeout is no fault (it counts no 201).
        print(
            f"  accepted (201) in all runs: {accepted}; new jobs in the store: {len(stored)}; "
            f"201s whose job is not in the store: {missing}"
        )
        log = (Path(folder) / "api.log").read_text(errors="replace")
        if "Traceback" in log:
            print(f"  the API logged {log.count('Traceback')} tracebacks; the last:")
            print("    " + log[log.rindex("Traceback") :][-1500:].replace("\n", "\n    "))
    bench_line(
        "api",
        target=name,
        mode="store",
        accepted=accepted,
        stored=len(stored),
        missing=missing,
        stored_ok=int(missing == 0 and len(created) == accepted),
    )


def bench_mlflow(args: argparse.Namespace) -> None:
    with mlflow_server(workers=2) as uri:
        from mlflow import MlflowClient

        experiment_id = MlflowClient(uri).create_experiment("bench-api")
        body = json.dumps({"experiment_id": experiment_id, "run_name": "bench", "start_time": 0})
        server = Server(uri)  # its process group is not ours to read here: no CPU figure
        load(uri + "/api/2.0/mlflow/runs/create", body, args, rate=20, seconds=1, connections=8)
        print("\nMLflow server (SQLite, 2 workers): runs/create")
        # The lowest rate only: MLflow saturates far below 400/s here, and each request past its
        # capacity waits out the client's timeout (minutes in all).
        drive("mlflow_create_run", server, "/api/2.0/mlflow/runs/create", body, args, rates=[min(args.rates)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", default="100,400", help="offered submissions per second, comma-separated (open loop)"
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=25, help="connections flat out")
    parser.add_argument(
        "--connections", type=int, default=64, help="the most requests in flight in the open loop"
    )
    parser.add_argument("--workers", type=int, default=1, help="API worker processes (optlab api --workers)")
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
