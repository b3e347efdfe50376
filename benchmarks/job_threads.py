"""Benchmark: a job's training rate by its CPU thread count, alone and with a second job beside it.

Why the worker gives each job `cores // slots` threads (OPTLAB_JOB_THREADS) rather than torch's
default of one per core: two jobs that each start a thread per core wait for each other at every
parallel op. Cases, each `python -m jobs.run` (digits_mlp with `ema_momentum`, no tracking,
checkpoint at the end), the job's `samples_per_sec` from its result:

- `alone, N threads`: one job on the machine (as far as this benchmark is concerned);
- `pair, N threads`: two such jobs started together (two slots on this host), their mean rate.

Cases alternate round by round; the machine's load is printed with the figures.
Run: `python benchmarks/job_threads.py [--steps 300] [--rounds 2] [--workload digits_mlp]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import PYTHON, ROOT, bench_line, interleaved, machine_line, median

from jobs.processes import thread_environment


def spec(workload: str, steps: int, seed: int) -> dict[str, Any]:
    return {
        "framework": "torch",
        "workload": {"name": workload},
        "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
        "steps": steps,
        "batch_size": 64,
        "seed": seed,
        "checkpoint_every": steps,
        "eval_every": steps,
        "experiment": "bench-threads",
        "device": "cpu",
    }


def jobs_at_once(count: int, threads: int, args: argparse.Namespace, folder: Path) -> float:
    """Start `count` jobs together with `threads` threads each; their mean samples/s."""
    env = {**os.environ, **thread_environment(threads), "PYTHONPATH": str(ROOT)}
    processes = []
    for index in range(count):
        work = Path(tempfile.mkdtemp(dir=folder))
        (work / "spec.json").write_text(json.dumps(spec(args.workload, args.steps, index)))
        command = [PYTHON, "-m", "jobs.run", str(work / "spec.json"), "--workdir", str(work)]
        processes.append((work, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)))
    rates = []
    for work, process in processes:
        process.wait()
        result = json.loads((work / "result.json").read_text())
        if result["status"] != "succeeded":
            raise RuntimeError(f"job failed: {result.get('error')}")
        rates.append(float(result["samples_per_sec"]))
    return sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", default="digits_mlp")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        folder = Path(tmp)
        cases = {
            f"{label}, {threads} thread{'s' if threads > 1 else ''}": (
                lambda count=count, threads=threads: jobs_at_once(count, threads, args, folder)
            )
            for label, count in (("alone", 1), ("pair", 2))
            for threads in sorted({1, cores})
        }
        values = interleaved(cases, args.rounds)
    print(
        f"\n{args.workload}, {args.steps} steps, {cores} cores; samples/s per job (median of {args.rounds})"
    )
    for label, rates in values.items():
        print(f"  {label:<20} {median(rates):9.0f}   rounds: {', '.join(f'{r:.0f}' for r in rates)}")
        count, threads = label.split(", ")
        bench_line(
            "job_threads",
            workload=args.workload,
            jobs=1 if count == "alone" else 2,
            threads=int(threads.split()[0]),
            samples_per_s=median(rates),
        )
    print(machine_line())


if __name__ == "__main__":
    sys.exit(main())
