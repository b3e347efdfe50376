"""Benchmark: a torch job's train step with and without `compile` (torch.compile of the model).

Per workload, two sessions of the same spec (`jobs.frameworks.torch_driver.TorchSession`, as a
job builds them), one with `compile: true`: the compiled one's first step pays for compiling
(Dynamo's own compile callbacks time it, `compile_s`), then both run `--steps` train steps a
round, interleaved for `--rounds` rounds (A B, B A, ...); the figure is the median ms per step.
`break_even_steps` is how many steps the compile takes to pay for itself (none when compiled is
slower). The weights are not compared here: tests/jobs/test_torch_compile.py does that.

Run: `python benchmarks/model_compile.py [--workloads digits_mlp,char_lm] [--rounds 5] [--threads 1]`.
Asserts nothing. Prints one `BENCH model_compile ...` line per workload.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line

from jobs.frameworks.torch_compile import compile_clock
from jobs.frameworks.torch_driver import TorchSession, TrainObjects
from jobs.spec import JobSpec
from jobs.workloads import get_workload
from optimizers.registry import load_registry

# Steps a round: a round of each takes about a second here.
STEPS = {"digits_mlp": 300, "digits_cnn": 40, "char_lm": 20}
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def session(workload: str, compiled: bool, batch_size: int) -> TorchSession:
    spec = JobSpec.model_validate(
        {
            "workload": {"name": workload},
            "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
            "steps": 10_000,
            "batch_size": batch_size,
            "device": "cpu",
            "compile": compiled,
        }
    )
    entry = load_registry(plugin_dirs=[], styles=("torch",)).get("ema_momentum", "torch")
    return TorchSession(spec, entry, get_workload(workload))


def time_steps(run: TorchSession, objects: TrainObjects, start: int, steps: int, clock: str) -> float:
    read = CLOCKS[clock]
    started = read()
    for step in range(start, start + steps):
        run.train_step(objects, run.batch(step), step)
    return (read() - started) * 1000 / steps


def measure(workload: str, *, rounds: int, steps: int, batch_size: int, clock: str) -> dict[str, float]:
    runs = {compiled: session(workload, compiled, batch_size) for compiled in (False, True)}
    built = {compiled: run.build() for compiled, run in runs.items()}
    first_ms = {}
    cost: dict[str, float] = {}
    for compiled, run in runs.items():
        mark = compile_clock().mark()
        started = time.perf_counter()
        run.train_step(built[compiled], run.batch(0), 0)
        first_ms[compiled] = (time.perf_counter() - started) * 1000
        if compiled:
            cost = compile_clock().since(mark)
    times: dict[bool, list[float]] = {False: [], True: []}
    position = 1
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        for compiled in order:
            times[compiled].append(time_steps(runs[compiled], built[compiled], position, steps, clock))
        position += steps
        print(
            f"  round {index + 1}: eager {times[False][-1]:.3f} ms, compiled {times[True][-1]:.3f} ms "
            f"({machine_line()})",
            flush=True,
        )
    eager, compiled = statistics.median(times[False]), statistics.median(times[True])
    saved = eager - compiled
    return {
        "eager_ms": eager,
        "compiled_ms": compiled,
        "speedup": eager / compiled,
        "compile_s": cost["compile_seconds"],
        "compiles": cost["compiles"],
        "first_step_s": first_ms[True] / 1000,
        "break_even_steps": cost["compile_seconds"] * 1000 / saved if saved > 0 else math.inf,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="digits_mlp,char_lm")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--steps", type=int, help="steps a round (default: about a second's worth)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="as in optimizer_step.py")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}; {machine_line()}"
    )
    for workload in args.workloads.split(","):
        steps = args.steps or STEPS.get(workload, 50)
        print(f"\n{workload}: batch {args.batch_size}, ema_momentum, {args.rounds} rounds of {steps} steps")
        figures = measure(
            workload, rounds=args.rounds, steps=steps, batch_size=args.batch_size, clock=args.clock
        )
        print(
            f"  eager {figures['eager_ms']:.3f} ms/step, compiled {figures['compiled_ms']:.3f} ms/step "
            f"({figures['speedup']:.2f}x); compiling took {figures['compile_s']:.1f} s "
            f"({figures['compiles']:.0f} compiles), paid back after {figures['break_even_steps']:.0f} steps"
        )
        text = " ".join(
            f"{key}={value:.3f}" if key.endswith("_ms") or key == "speedup" else f"{key}={value:.1f}"
            for key, value in figures.items()
        )
        print(f"BENCH model_compile workload={workload} threads={args.threads} {text}", flush=True)
    print(f"\n{machine_line()}")


if __name__ == "__main__":
    main()
