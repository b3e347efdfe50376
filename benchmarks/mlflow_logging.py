"""Benchmark: what metric logging costs a training loop, synchronous vs batched.

Starts a throwaway local MLflow tracking server (SQLite backend), then measures
  1. `MlflowClient.log_metric`, one HTTP call per point (what a naive loop does);
  2. `jobs.tracking.BatchedMetricLogger`: the time the training loop spends in
     `metric()` calls, and the time until every point is delivered (`close()`).
Prints figures; asserts nothing. Run: `.venv/bin/python benchmarks/mlflow_logging.py`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(folder: str, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
        "--artifacts-destination", f"{folder}/artifacts",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("MLflow server did not start")


def main() -> None:
    from mlflow import MlflowClient

    from jobs.tracking import MlflowRun

    steps, metrics_per_step, sync_points = 1000, 6, 50
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        server = start_server(folder, port)
        try:
            uri = f"http://127.0.0.1:{port}"
            client = MlflowClient(uri)
            run_id = client.create_run(client.create_experiment("bench")).info.run_id
            started = time.perf_counter()
            for step in range(sync_points):
                client.log_metric(run_id, "train/loss", 1.0 / (step + 1), step=step)
            sync_ms = (time.perf_counter() - started) * 1000 / sync_points

            run = MlflowRun(uri, experiment="bench", run_name="batched", params={}, tags={})
            points = steps * metrics_per_step
            started = time.perf_counter()
            for step in range(steps):
                for index in range(metrics_per_step):
                    run.metric(f"m{index}", float(step), step)
            in_loop_s = time.perf_counter() - started
            run.end("FINISHED")
            delivered_s = time.perf_counter() - started
            stored = len(client.get_metric_history(run.info.run_id, "m0"))
        finally:
            server.terminate()
            server.wait()

    print(
        f"synchronous log_metric: {sync_ms:.1f} ms per point "
        f"-> {sync_ms * metrics_per_step:.0f} ms added to every step with {metrics_per_step} metrics"
    )
    print(
        f"batched: {points} points ({steps} steps x {metrics_per_step}) cost the loop "
        f"{in_loop_s * 1000:.1f} ms in total ({in_loop_s * 1e6 / points:.1f} us per point)"
    )
    print(f"batched: all delivered {delivered_s:.2f} s after the first point; m0 history has {stored} points")


if __name__ == "__main__":
    main()
