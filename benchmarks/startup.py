"""Benchmark: how long a job takes from its POST to its first training step, cold and warm, where
that time goes, and how much memory a job process holds, for torch and Keras 3.

1. Through a real worker: an `optlab api` process and a `service.worker.Worker` (in this process,
   so each case gets a fresh one; its job processes are real ones) on SQLite with a real MLflow
   server. A one-step `digits_mlp` job is POSTed to the API; its claim is the job row's
   `started_at`, its MLflow run's creation the run's `start_time`, its first step the timestamp of
   its first `train/loss` point (taken by the job when the step ended). `cold`: the warm pool off
   (`python -m jobs.run` spawned at the claim); `warm`: the pool on, the job POSTed once the slot's
   warm process has finished importing (its CPU time stopped growing). Cases alternate (cold warm,
   warm cold, ...). Peak RSS of the job process (VmHWM, sampled), and of the idle warm process.
   The worker polls every 0.5 s (the default): POST to claim is that wait.
2. The stages, in a child process that goes through what `jobs.run` does one stage at a time and
   stamps each: interpreter start (spawn to first line), imports (cold: the framework; warm:
   everything `jobs.warm` imports before a job), the jobs modules and registry, data and session
   (`TrainingJob(...)`), model and optimizer build, MLflow run creation, the first training step.
   Its peak RSS from `wait4`.

Targets (issue 15): first step within 2 s of the claim for torch and 4 s for Keras on a warm worker.
Run: `python benchmarks/startup.py [--repeats 3] [--frameworks torch,tensorflow]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from common import (
    PYTHON,
    ROOT,
    bench_line,
    free_port,
    machine_line,
    median,
    mlflow_server,
    stop_group,
    wait_http,
)

STAGES = (
    "interpreter",
    "imports",
    "jobs + registry",
    "data + session",
    "model build",
    "mlflow run",
    "first step",
)
STYLE = {"torch": "torch", "tensorflow": "keras"}

CHILD = r"""
import json, sys, time
stamps = {"spawned": float(sys.argv[1]), "interpreter": time.time()}
framework, spec_path, workdir, uri, out, mode = sys.argv[2:8]
if mode == "warm":
    from jobs.warm import warm_up
    warm_up({"torch": "torch", "tensorflow": "keras"}[framework])
elif framework == "torch":
    import torch  # noqa: F401
else:  # as a job's registry imports them (optimizers/optional_imports.py)
    from optimizers.optional_imports import import_tensorflow
    import_tensorflow("keras")
stamps["imports"] = time.time()
from pathlib import Path
from jobs.report import Reporter
from jobs.spec import JobSpec
from jobs.tracking import MlflowRun, NullTracker
from jobs.training.loop import TrainingJob
from jobs.frameworks import style_of
from optimizers.registry import load_registry
spec = JobSpec.model_validate_json(Path(spec_path).read_text())
registry = load_registry(styles=(style_of(spec),))
stamps["jobs + registry"] = time.time()
run = None
job = TrainingJob(
    spec, registry=registry, workdir=Path(workdir), tracker=NullTracker(), reporter=Reporter(Path(workdir))
)
stamps["data + session"] = time.time()
with job.session.scope():
    objects = job.session.build()
    stamps["model build"] = time.time()
    run = MlflowRun(uri, experiment="bench-startup", run_name="startup", params={}, tags={})
    stamps["mlflow run"] = time.time()
    job.session.train_step(objects, job.session.batch(0), 0)
    stamps["first step"] = time.time()
run.end("FINISHED")
Path(out).write_text(json.dumps(stamps))
"""


def spec_for(framework: str) -> dict[str, Any]:
    return {
        "framework": framework,
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
        "steps": 1,
        "batch_size": 64,
        "seed": 0,
        "experiment": "bench-startup",
        "device": "cpu",
    }


# -- 1. through a real worker ----------------------------------------------------------------------


@dataclass
class Timeline:
    post_to_claim: float
    claim_to_run: float  # the job process reached MLflow: spawn or hand-over, imports, run creation
    run_to_first_step: float  # data, model, the first step
    peak_rss_mib: float
    idle_warm_rss_mib: float  # the warm process before it got the job (0: cold)

    @property
    def claim_to_first_step(self) -> float:
        return self.claim_to_run + self.run_to_first_step

    @property
    def post_to_first_step(self) -> float:
        return self.post_to_claim + self.claim_to_first_step


@contextlib.contextmanager
def api_server(settings: Any, folder: Path) -> Iterator[str]:
    """`optlab api` on the benchmark's store."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OPTLAB_DATA_DIR": str(settings.data_dir),
        "OPTLAB_MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri,
        "OPTLAB_API_PORT": str(port),
    }
    with open(folder / "api.log", "wb") as log:
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


def status_field(pid: int, field: str) -> float:
    """A `kB` field of /proc/PID/status in MiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_until_idle(pid: int, timeout_s: float = 120) -> None:
    """Until the warm process has done its imports: its CPU time stops growing for 0.5 s."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        ticks = cpu_ticks(pid)
        if ticks == last and ticks > 0:
            return
        last = ticks
        time.sleep(0.5)
    raise RuntimeError(f"warm process {pid} still busy after {timeout_s:.0f} s")


def job_pid(parent: int, marker: bytes) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and marker in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


class PeakSampler(threading.Thread):
    """The job process's peak RSS (VmHWM), sampled every 20 ms until it ends."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            if self.pid is None:
                self.pid = job_pid(os.getpid(), b"jobs.run")
            if self.pid is not None:
                self.peak = max(self.peak, status_field(self.pid, "VmHWM"))


def through_worker(
    framework: str, warm: bool, *, settings: Any, sessions: Any, api: str, index: int
) -> Timeline:
    from mlflow.tracking import MlflowClient

    from service import store
    from service.worker import Worker

    worker = Worker(
        settings.model_copy(update={"warm_pool": warm}),
        sessions,
        worker_id=f"bench-{framework}-{index}-{warm}",
    )
    worker.frameworks = (framework,)  # a worker of this framework: its slot keeps that style warm
    with sessions() as session:
        store.register_worker(
            session=session, worker_id=worker.worker_id, frameworks=[framework], devices=["cpu"], gpus=0,
            slots=1, catalogue_sha256="0" * 64,
        )  # fmt: skip
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        idle_rss, pid = 0.0, None
        if warm:
            deadline = time.monotonic() + 60
            while worker.pool is not None and not worker.pool.idle and time.monotonic() < deadline:
                time.sleep(0.05)
            assert worker.pool is not None and 0 in worker.pool.idle, "no warm process"
            pid = worker.pool.idle[0].process.pid
            wait_until_idle(pid)
            idle_rss = status_field(pid, "VmRSS")
        else:
            time.sleep(1.0)  # the worker is polling
        sampler = PeakSampler(pid)
        sampler.start()
        posted = time.time()
        answer = httpx.post(f"{api}/jobs", json=spec_for(framework), timeout=30)
        answer.raise_for_status()
        job_id = answer.json()["id"]
        deadline = time.monotonic() + 300
        while True:
            with sessions() as session:
                job = store.get_job(session=session, job_id=job_id)
            assert job is not None
            if job.status.terminal:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end in 300 s")
            time.sleep(0.05)
        sampler.done.set()
        sampler.join()
    finally:
        worker.stopping.set()
        thread.join(timeout=120)
    if job.status != "succeeded" or job.mlflow is None or job.started_at is None:
        raise RuntimeError(f"{framework} job {job_id}: {job.status}: {job.error}")
    client = MlflowClient(settings.mlflow_tracking_uri)
    run_id = job.mlflow["run_id"]
    created = client.get_run(run_id).info.start_time / 1000
    first_step = min(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step).timestamp / 1000
    claimed = job.started_at.timestamp()
    return Timeline(
        post_to_claim=claimed - posted,
        claim_to_run=created - claimed,
        run_to_first_step=first_step - created,
        peak_rss_mib=sampler.peak,
        idle_warm_rss_mib=idle_rss,
    )


# -- 2. the stages ---------------------------------------------------------------------------------


def spawn(command: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS in MiB and exit status of one child process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0 and process.stderr is not None:
        print(process.stderr.read().decode()[-2000:])
    return wall, usage.ru_maxrss / 1024, process.returncode


def breakdown(
    framework: str, mode: str, uri: str, folder: Path, index: int
) -> tuple[dict[str, float], float]:
    """The stages (seconds each) and the child's peak RSS in MiB."""
    name = f"parts-{framework}-{mode}-{index}"
    spec_path = folder / f"{name}.json"
    spec_path.write_text(json.dumps(spec_for(framework)))
    workdir = folder / name
    workdir.mkdir()
    out = folder / f"{name}-stamps.json"
    command = [
        PYTHON,
        "-c",
        CHILD,
        str(time.time()),
        framework,
        str(spec_path),
        str(workdir),
        uri,
        str(out),
        mode,
    ]
    _, peak, code = spawn(command)
    if code != 0:
        raise RuntimeError(f"{framework} {mode} breakdown child exited with {code}")
    stamps = json.loads(out.read_text())
    moments = [stamps["spawned"], *(stamps[stage] for stage in STAGES)]
    return {stage: moments[i + 1] - moments[i] for i, stage in enumerate(STAGES)}, peak


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frameworks", default="torch,tensorflow")
    args = parser.parse_args()
    print(machine_line())
    from service import store
    from service.db import make_engine, migrate, session_factory
    from service.settings import Settings

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp, mlflow_server() as uri:
        folder = Path(tmp)
        settings = Settings(data_dir=folder / "data", mlflow_tracking_uri=uri)
        engine = make_engine(settings.resolved_database_url)
        migrate(engine)
        sessions = session_factory(engine)
        catalogue = subprocess.run(
            [PYTHON, "-m", "jobs.catalogue"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        with sessions() as session:
            store.publish_catalogue(session=session, worker_id="bench", catalogue=json.loads(catalogue))
        with api_server(settings, folder) as api:
            for framework in args.frameworks.split(","):
                cases: dict[str, list[Timeline]] = {"cold": [], "warm": []}
                for index in range(args.repeats):
                    order = ("cold", "warm") if index % 2 == 0 else ("warm", "cold")
                    for mode in order:
                        timeline = through_worker(
                            framework,
                            mode == "warm",
                            settings=settings,
                            sessions=sessions,
                            api=api,
                            index=index,
                        )
                        cases[mode].append(timeline)
                stages = {
                    mode: [breakdown(framework, mode, uri, folder, index) for index in range(args.repeats)]
                    for mode in ("cold", "warm")
                }
                report(framework, cases, stages, args.repeats)
        engine.dispose()
    print(machine_line())


def report(
    framework: str,
    cases: dict[str, list[Timeline]],
    stages: dict[str, list[tuple[dict[str, float], float]]],
    repeats: int,
) -> None:
    print(
        f"\n{framework}: one-step digits_mlp job, POST to first step through a worker (median of {repeats})"
    )
    print(f"  {'':24}{'cold':>9}{'warm':>9}")
    rows = (
        ("POST to claim (poll)", "post_to_claim"),
        ("claim to MLflow run", "claim_to_run"),
        ("MLflow run to 1st step", "run_to_first_step"),
        ("claim to first step", "claim_to_first_step"),
        ("POST to first step", "post_to_first_step"),
    )
    figures: dict[str, dict[str, float]] = {}
    for mode, timelines in cases.items():
        figures[mode] = {key: median([getattr(t, key) for t in timelines]) for _, key in rows}
        figures[mode]["peak_rss_mib"] = max(t.peak_rss_mib for t in timelines)
        figures[mode]["idle_rss_mib"] = median([t.idle_warm_rss_mib for t in timelines])
    for label, key in rows:
        print(f"  {label:<24}{figures['cold'][key]:8.2f}s{figures['warm'][key]:8.2f}s")
    cold_peak, warm_peak = figures["cold"]["peak_rss_mib"], figures["warm"]["peak_rss_mib"]
    print(f"  {'peak RSS of the job':<24}{cold_peak:6.0f}MiB{warm_peak:6.0f}MiB")
    print(f"  {'idle warm process RSS':<24}{'':9}{figures['warm']['idle_rss_mib']:6.0f}MiB")
    each = {mode: [round(t.claim_to_first_step, 2) for t in timelines] for mode, timelines in cases.items()}
    print(f"  claim to first step, each run: cold {each['cold']}, warm {each['warm']}")
    print(f"  stages in a child process (median of {repeats}):")
    print(f"  {'':24}{'cold':>9}{'warm':>9}")
    medians = {
        mode: {s: median([parts[s] for parts, _ in runs]) for s in STAGES} for mode, runs in stages.items()
    }
    for stage in STAGES:
        print(f"    {stage:<22}{medians['cold'][stage]:8.2f}s{medians['warm'][stage]:8.2f}s")
    after_imports = {mode: sum(medians[mode][s] for s in STAGES[2:]) for mode in medians}
    print(f"    {'after the imports':<22}{after_imports['cold']:8.2f}s{after_imports['warm']:8.2f}s")
    peaks = {mode: max(peak for _, peak in runs) for mode, runs in stages.items()}
    print(f"    {'peak RSS':<22}{peaks['cold']:6.0f}MiB{peaks['warm']:6.0f}MiB")
    for mode in ("cold", "warm"):
        bench_line(
            "startup",
            framework=framework,
            mode=mode,
            post_to_first_step_s=figures[mode]["post_to_first_step"],
            claim_to_first_step_s=figures[mode]["claim_to_first_step"],
            post_to_claim_s=figures[mode]["post_to_claim"],
            claim_to_run_s=figures[mode]["claim_to_run"],
            run_to_first_step_s=figures[mode]["run_to_first_step"],
            peak_rss_mib=figures[mode]["peak_rss_mib"],
            idle_warm_rss_mib=figures[mode]["idle_rss_mib"],
            child_peak_rss_mib=peaks[mode],
            **{
                "stage_" + name.replace(" + ", "_").replace(" ", "_"): value
                for name, value in medians[mode].items()
            },
        )


if __name__ == "__main__":
    sys.exit(main())
