"""What the benchmarks share: a throwaway MLflow server, a throwaway PostgreSQL database,
one job through `python -m jobs.run`, interleaved timing, the `BENCH` line.

Every benchmark prints its figures and one line `BENCH <name> key=value ...` per case, and
asserts nothing: targets live in the issue and the README, never in a timed test.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `jobs`, `service`, `optimizers`, when run as a script
PYTHON = sys.executable
# A benchmark that is stopped still stops the servers it started and drops its database.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

from tests.postgres import throwaway_database  # noqa: E402  (after the path is set)


def machine_line() -> str:
    """CPU count and load average, printed with every figure (the machine may be shared)."""
    one, five, fifteen = os.getloadavg()
    now = time.strftime("%H:%M:%S UTC", time.gmtime())
    return f"{os.cpu_count()} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f} at {now}"


def bench_line(name: str, **fields: Any) -> str:
    def text(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    line = f"BENCH {name} " + " ".join(f"{key}={text(value)}" for key, value in fields.items())
    print(line, flush=True)
    return line


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, *, timeout_s: float = 120.0, process: subprocess.Popen[Any] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode} before answering")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def stop_group(process: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM the process's group (a server and its workers), SIGKILL what is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()


@contextlib.contextmanager
def mlflow_server(workers: int = 1) -> Iterator[str]:
    """A local MLflow tracking server on SQLite in a temporary folder; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as folder:
        port = free_port()
        command = [
            PYTHON, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
            "--artifacts-destination", f"{folder}/artifacts",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        server = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/health", process=server)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_group(server)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A throwaway PostgreSQL database (dropped afterwards); yields its SQLAlchemy URL."""
    with throwaway_database("optlab_bench") as url:
        yield url


def run_job(
    spec: dict[str, Any],
    *,
    tracking_uri: str | None,
    folder: Path,
    name: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One job through the public entry point, `python -m jobs.run SPEC`; its result.json."""
    spec_path = folder / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    workdir = folder / name
    command = [PYTHON, "-m", "jobs.run", str(spec_path), "--workdir", str(workdir)]
    if tracking_uri:
        command += ["--tracking-uri", tracking_uri]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    completed = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    result_path = workdir / "result.json"
    if not result_path.exists():
        raise RuntimeError(
            f"job {name} wrote no result (exit {completed.returncode}): {completed.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    if result["status"] != "succeeded":
        raise RuntimeError(f"job {name} {result['status']}: {json.dumps(result.get('error'))[:2000]}")
    return result


def thread_environment(threads: int | None) -> dict[str, str]:
    """Intra-op threads for a job process (and this one): on a loaded shared machine one thread
    per process is far steadier than two threads that wait for each other at every op."""
    if threads is None:
        return {}
    import torch

    torch.set_num_threads(threads)
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def interleaved(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every case once per round, each round starting at the next case (A B C, B C A, ...)."""
    labels = list(cases)
    values: dict[str, list[float]] = {label: [] for label in labels}
    for index in range(rounds):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            values[label].append(cases[label]())
    return values


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(values: list[float], base: list[float]) -> float:
    """The median over rounds of each round's value over the same round's base: a machine whose
    speed drifts between rounds (this one's spread by 10-30%) moves both alike, so the ratio is
    steadier than the ratio of the two medians."""
    return median([value / reference for value, reference in zip(values, base, strict=True)])


def paired_interval(
    values: list[float], base: list[float], confidence: float = 0.9, resamples: int = 4000
) -> tuple[float, float]:
    """A bootstrap interval for `paired_ratio`: the rounds resampled with replacement (seeded, so
    a rerun on the same figures prints the same interval). A target is judged met only when the
    interval lies above it, missed only when it lies below."""
    ratios = [value / reference for value, reference in zip(values, base, strict=True)]
    if len(ratios) < 2:
        return float("nan"), float("nan")
    chooser = random.Random(0)
    medians = sorted(statistics.median(chooser.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]
