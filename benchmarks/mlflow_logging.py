"""Benchmark: what metric delivery costs a training loop: no tracker vs the in-process delivery thread
vs the delivery process (jobs.metric_delivery), and one synchronous `log_metric` per point.

A real MLflow server (SQLite) in a temporary folder; a synthetic training loop whose step is a fixed
amount of pure-Python work, `--step-us` microseconds of CPU (it holds the interpreter all the time,
as the Python side of a small model's step mostly does), and hands over six points a step with
`metrics()`.
Interleaved rounds (A B C, B C A, ...), median. For each way of delivering:

- the loop's rate, and its ratio to the loop without a tracker;
- the training thread's own time in `metrics()` per point;
- the delivery's CPU per point (the delivery process's CPU from /proc; the thread's as this
  process's CPU minus the training thread's);
- `MlflowRun(...)` creation (what a job waits for before its first step; the delivery process is
  started there and gets ready in parallel), and how long its first flush then takes;
- the wait in `end()` for the last points, and whether every point is in the server.

Then the same three ways under a real job: `TrainingJob.run` of `--workload` (digits_mlp with
ema_momentum by default, as in step_profile.py) in this process, interleaved, steps/s and the ratio
to the job without a tracker (`--job-steps 0` skips it); once against the MLflow server, once
against one that discards the metrics (the client's cost alone: the local server's own CPU per
point competes with the job on a small machine).

Run: `python benchmarks/mlflow_logging.py [--steps 3000] [--rounds 3] [--step-us 300] [--threads 1]`.
Asserts nothing; one `BENCH mlflow_logging` line per way of delivering, one `BENCH
mlflow_logging_job` line per way of delivering under the job.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import http.server
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import bench_line, interleaved, machine_line, median, mlflow_server, thread_environment

KEYS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/step_time_ms",
    "perf/optimizer_step_ms",
    "perf/samples_per_sec",
)


@dataclass
class Figures:
    rate: float  # steps/s
    caller_s: float  # training thread's time in metrics()
    delivery_cpu_s: float
    create_s: float
    first_flush_s: float
    end_s: float
    delivered: bool


def spin(iterations: int) -> None:
    """A fixed amount of pure-Python work (not a wall-clock wait: time the process loses to others,
    or to its delivery, must show in the loop's rate as it does in a real one)."""
    total = 0
    for index in range(iterations):
        total += index


def iterations_for(seconds: float) -> int:
    """How many `spin` iterations take `seconds` on this machine now (best of five tries)."""
    trial = 100_000
    best = min(_timed_spin(trial) for _ in range(5))
    return max(1, round(trial * seconds / best))


def _timed_spin(iterations: int) -> float:
    started = time.thread_time()
    spin(iterations)
    return time.thread_time() - started


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run_loop(uri: str, mode: Any, steps: int, step_iterations: int) -> Figures:
    from mlflow import MlflowClient

    from jobs.tracking import MlflowRun, NullTracker, Point

    created = time.perf_counter()
    tracker: Any = NullTracker()
    if mode is not None:
        tracker = MlflowRun(uri, experiment="bench-logging", run_name=mode, params={}, tags={}, delivery=mode)
    create_s = time.perf_counter() - created
    first_flush_s = 0.0
    if mode is not None:
        started = time.perf_counter()
        tracker.metrics([Point("setup/ready", 1.0, 0, int(time.time() * 1000))])
        tracker.delivery.flush()  # the first acknowledgement: the delivery is up
        first_flush_s = time.perf_counter() - started
    pid = getattr(tracker.delivery, "pid", None) if mode is not None else None
    cpu_before = time.process_time()
    thread_before = time.thread_time()
    child_before = process_cpu_s(pid) if pid else 0.0
    caller_s = 0.0
    started = time.perf_counter()
    for step in range(steps):
        spin(step_iterations)
        stamp = int(time.time() * 1000)
        points = [Point(key, 1.0 / (step + 1), step, stamp) for key in KEYS]
        called = time.perf_counter()
        tracker.metrics(points)
        caller_s += time.perf_counter() - called
    rate = steps / (time.perf_counter() - started)
    if mode is None:
        return Figures(rate, caller_s, 0.0, create_s, 0.0, 0.0, True)
    ending = time.perf_counter()
    tracker.delivery.flush()
    end_s = time.perf_counter() - ending
    if pid:
        delivery_cpu_s = process_cpu_s(pid) - child_before
    else:  # the thread: this process's CPU beyond the training thread's
        delivery_cpu_s = (time.process_time() - cpu_before) - (time.thread_time() - thread_before)
    tracker.end("FINISHED")
    history = MlflowClient(uri).get_metric_history(tracker.info.run_id, "train/loss")
    delivered = sorted(point.step for point in history) == list(range(steps))
    return Figures(rate, caller_s, delivery_cpu_s, create_s, first_flush_s, end_s, delivered)


class DiscardingServer:
    """In front of the MLflow server: answers `log-batch` with metrics at once without storing them
    (everything else is forwarded), so a job against it shows the client side's cost alone. The
    local SQLite server spends ~110 us of CPU a point here, more than a digits_mlp step's share
    of a 2-core machine at six points a step."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.endswith("/runs/log-batch") and b'"metrics"' in body:
                    data, status = b"{}", 200
                else:
                    connection = http.client.HTTPConnection(host, int(port), timeout=60)
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                    }
                    connection.request(self.command, self.path, body=body, headers=headers)
                    answer = connection.getresponse()
                    data, status = answer.read(), answer.status
                    connection.close()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"


def job_rate(args: argparse.Namespace, uri: str, mode: Any, folder: Path) -> float:
    """steps/s of a real TrainingJob (the loop's own metric calls) with the given delivery."""
    from step_profile import training_job
    from tracking_overhead import job_spec

    from jobs.tracking import MlflowRun, NullTracker

    job_args = argparse.Namespace(**{**vars(args), "steps": args.job_steps})
    spec = job_spec(job_args, args.workload, checkpoint_every=args.job_steps)  # at the end only
    tracker: Any = NullTracker()
    if mode is not None:
        tracker = MlflowRun(
            uri, experiment="bench-logging-job", run_name=mode, params={}, tags={}, delivery=mode
        )
    outcome = training_job(spec, folder, tracker).run()
    if mode is not None:
        tracker.end("FINISHED")
    return float(args.job_steps / outcome.train_seconds)


def caller_cpu_per_point(uri: str, mode: Any, points: int = 60_000) -> float:
    """The training thread's own CPU per point handing over `points` in a tight loop (six a call):
    CPU time, which the machine's load does not inflate the way it inflates wall time."""
    from jobs.tracking import MlflowRun, Point

    run = MlflowRun(
        uri, experiment="bench-logging", run_name=f"tight-{mode}", params={}, tags={}, delivery=mode
    )
    stamp = int(time.time() * 1000)
    batches = [[Point(key, 0.5, step, stamp) for key in KEYS] for step in range(points // len(KEYS))]
    started = time.thread_time()
    for batch in batches:
        run.metrics(batch)
    cost = (time.thread_time() - started) / points
    run.end("FINISHED")
    return cost


def synchronous_ms(uri: str, points: int) -> float:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bench-sync")).info.run_id
    started = time.perf_counter()
    for step in range(points):
        client.log_metric(run_id, "train/loss", 1.0 / (step + 1), step=step)
    return (time.perf_counter() - started) * 1000 / points


def print_synthetic(
    args: argparse.Namespace,
    rates: dict[str, list[float]],
    figures: dict[str, list[Figures]],
    tight: dict[str, list[float]],
) -> None:
    points = args.steps * len(KEYS)
    base = median(rates["no tracker"])
    print(
        f"\n{args.steps} steps of {args.step_us:.0f} us (pure Python), {len(KEYS)} points a step "
        f"through metrics(); median of {args.rounds} interleaved rounds"
    )
    print(
        f"  {'':<11} {'steps/s':>8} {'of none':>8} {'caller us/pt':>13} {'delivery CPU us/pt':>19} "
        f"{'MlflowRun()':>12} {'1st flush':>10} {'end wait':>9}  all delivered"
    )
    for label, results in figures.items():
        rate = median(rates[label])
        caller = median([r.caller_s for r in results]) * 1e6 / points
        cpu = median([r.delivery_cpu_s for r in results]) * 1e6 / points
        create_ms = median([r.create_s for r in results]) * 1000
        flush_ms = median([r.first_flush_s for r in results]) * 1000
        end_ms = median([r.end_s for r in results]) * 1000
        delivered = all(r.delivered for r in results)
        print(
            f"  {label:<11} {rate:8.0f} {rate / base:8.3f} {caller:13.2f} {cpu:19.2f} "
            f"{create_ms:10.0f}ms {flush_ms:8.0f}ms {end_ms:7.0f}ms  {delivered}"
        )
        if label != "no tracker":
            bench_line(
                "mlflow_logging",
                mode=label,
                ratio=rate / base,
                caller_us_per_point=caller,
                caller_cpu_us_per_point_tight=median(tight[label]) * 1e6,
                delivery_cpu_us_per_point=cpu,
                run_create_ms=create_ms,
                first_flush_ms=flush_ms,
                end_wait_ms=end_ms,
                points_ok=int(delivered),
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000, help="steps of the synthetic loop (0: skip it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-us", type=float, default=300.0, help="the synthetic step's CPU time")
    parser.add_argument("--sync-points", type=int, default=30)
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--optimizer", default="ema_momentum")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--job-steps", type=int, default=1000, help="steps of the job case (0: skip it)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default torch's)")
    args = parser.parse_args()
    thread_environment(args.threads)
    print(machine_line(), f"threads {args.threads or 'default'}")
    figures: dict[str, list[Figures]] = {"no tracker": [], "thread": [], "process": []}
    modes: dict[str, Any] = {"no tracker": None, "thread": "thread", "process": "process"}
    with mlflow_server() as uri:
        step_iterations = iterations_for(args.step_us / 1e6)

        def case(label: str) -> Any:
            def run() -> float:
                result = run_loop(uri, modes[label], args.steps, step_iterations)
                figures[label].append(result)
                return result.rate

            return run

        rates = interleaved({label: case(label) for label in figures}, args.rounds if args.steps else 0)
        sync_ms = synchronous_ms(uri, args.sync_points)
        tight = interleaved(
            {mode: functools.partial(caller_cpu_per_point, uri, mode) for mode in ("thread", "process")},
            args.rounds,
        )
        job_rates: dict[str, list[float]] = {}
        discarded: dict[str, list[float]] = {}
        if args.job_steps:
            with tempfile.TemporaryDirectory(prefix="bench-logging-") as tmp:
                counter = iter(range(1_000_000))

                def job_cases(server: str) -> dict[str, Any]:
                    def case(mode: Any) -> Any:
                        return lambda: job_rate(args, server, mode, Path(tmp) / f"job-{next(counter)}")

                    return {label: case(modes[label]) for label in figures}

                job_rates = interleaved(job_cases(uri), args.rounds)
                discarded = interleaved(job_cases(DiscardingServer(uri).uri), args.rounds)
    if args.steps:
        print_synthetic(args, rates, figures, tight)
    print(
        "  the training thread's CPU per point in a tight loop of metrics() calls (60,000 points): "
        + ", ".join(f"{mode} {median(values) * 1e6:.2f} us" for mode, values in tight.items())
    )
    print(f"  synchronous log_metric: {sync_ms:.1f} ms a point ({sync_ms * len(KEYS):.0f} ms a step)")
    for server, rates_of in (("MLflow", job_rates), ("discarding", discarded)):
        if not rates_of:
            continue
        job_base = median(rates_of["no tracker"])
        print(
            f"\nTrainingJob.run, {args.workload}, {args.optimizer}, {args.job_steps} steps, "
            f"{'the MLflow server' if server == 'MLflow' else 'a server that discards the metrics'}: "
            f"steps/s, median of {args.rounds} interleaved rounds"
        )
        for label, values in rates_of.items():
            shown = ", ".join(f"{v:.0f}" for v in values)
            rate = median(values)
            print(f"  {label:<11} {rate:8.0f} steps/s  {rate / job_base:5.3f} of no tracker   ({shown})")
            if label != "no tracker":
                bench_line(
                    "mlflow_logging_job",
                    workload=args.workload,
                    server=server,
                    mode=label,
                    ratio=rate / job_base,
                    steps_per_s=rate,
                )
    print(machine_line())


if __name__ == "__main__":
    main()
