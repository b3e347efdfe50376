"""Benchmark: how long a job takes to reach its first training step, where that time goes, and how
much memory a job process holds, for torch and Keras 3.

1. End to end, through the public entry point: `python -m jobs.run SPEC` with `steps: 1` and a
   real MLflow server, as the worker starts it. Wall time from spawn to exit and the process's
   peak RSS (`wait4`). The first run of a framework is `cold` (first import since the benchmark
   started; the OS page cache may still hold the files from earlier use of this machine), the
   median of the later ones `repeat`.
2. The breakdown: a child process that goes through the same stages as `jobs.run` one at a time
   and stamps each: interpreter start (spawn to first line), framework import, the jobs modules
   and registry, data and session (`TrainingJob(...)`), model and optimizer build, MLflow run
   creation, the first training step. `warm` is what a pre-started process that has the
   interpreter and framework already imported would still pay (the issue's warm pool): the sum
   of the stages after the framework import.

Not included: the worker's poll delay (`OPTLAB_POLL_INTERVAL_S`, 0.5 s by default) and the claim.
Targets (issue 15): first step within 2 s of the claim for torch and 4 s for Keras on a warm worker.
Run: `python benchmarks/startup.py [--repeats 3] [--frameworks torch,tensorflow]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import PYTHON, ROOT, bench_line, machine_line, median, mlflow_server

STAGES = (
    "interpreter",
    "framework import",
    "jobs + registry",
    "data + session",
    "model build",
    "mlflow run",
    "first step",
)

CHILD = r"""
import json, sys, time
stamps = {"spawned": float(sys.argv[1]), "interpreter": time.time()}
framework, spec_path, workdir, uri, out = sys.argv[2:7]
if framework == "torch":
    import torch  # noqa: F401
else:
    import tensorflow, keras  # noqa: F401
stamps["framework import"] = time.time()
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


def end_to_end(framework: str, uri: str, folder: Path, index: int) -> tuple[float, float]:
    spec_path = folder / f"{framework}-{index}.json"
    spec_path.write_text(json.dumps(spec_for(framework)))
    workdir = folder / f"{framework}-{index}"
    wall, peak, code = spawn(
        [PYTHON, "-m", "jobs.run", str(spec_path), "--workdir", str(workdir), "--tracking-uri", uri]
    )
    result = json.loads((workdir / "result.json").read_text())
    if code != 0 or result["status"] != "succeeded":
        raise RuntimeError(f"{framework} job: exit {code}, {result['status']}: {result.get('error')}")
    return wall, peak


def breakdown(framework: str, uri: str, folder: Path, index: int) -> dict[str, float]:
    spec_path = folder / f"parts-{framework}-{index}.json"
    spec_path.write_text(json.dumps(spec_for(framework)))
    workdir = folder / f"parts-{framework}-{index}"
    workdir.mkdir()
    out = folder / f"parts-{framework}-{index}-stamps.json"
    command = [PYTHON, "-c", CHILD, str(time.time()), framework, str(spec_path), str(workdir), uri, str(out)]
    _, _, code = spawn(command)
    if code != 0:
        raise RuntimeError(f"{framework} breakdown child exited with {code}")
    stamps = json.loads(out.read_text())
    moments = [stamps["spawned"], *(stamps[stage] for stage in STAGES)]
    return {stage: moments[i + 1] - moments[i] for i, stage in enumerate(STAGES)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frameworks", default="torch,tensorflow")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp, mlflow_server() as uri:
        folder = Path(tmp)
        for framework in args.frameworks.split(","):
            runs = [end_to_end(framework, uri, folder, index) for index in range(args.repeats)]
            parts = [breakdown(framework, uri, folder, index) for index in range(args.repeats)]
            cold_wall = runs[0][0]
            peak = max(p for _, p in runs)
            repeat_wall = median([wall for wall, _ in runs[1:]]) if len(runs) > 1 else float("nan")
            stage = {name: median([p[name] for p in parts]) for name in STAGES}
            to_first_step = sum(stage.values())
            warm = sum(stage[name] for name in STAGES[2:])
            print(f"\n{framework}: one-step job through `python -m jobs.run` (with MLflow)")
            print(f"  cold {cold_wall:.2f} s, repeat {repeat_wall:.2f} s (median), peak RSS {peak:.0f} MiB")
            print(f"  spawn to first step, by stage (median of {args.repeats}): {to_first_step:.2f} s")
            for name in STAGES:
                print(f"    {name:<18} {stage[name]:6.2f} s")
            print(f"  a warm process (interpreter and framework imported) would need {warm:.2f} s")
            bench_line(
                "startup",
                framework=framework,
                cold_s=cold_wall,
                repeat_s=repeat_wall,
                first_step_s=to_first_step,
                warm_first_step_s=warm,
                peak_rss_mib=peak,
                **{
                    "stage_" + name.replace(" + ", "_").replace(" ", "_"): value
                    for name, value in stage.items()
                },
            )
    print(machine_line())


if __name__ == "__main__":
    sys.exit(main())
