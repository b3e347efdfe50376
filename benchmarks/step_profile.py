"""Where a torch job's time goes per step: the measurements behind the phase-2 plan in README.md.

In one process, on one workload (default digits_mlp with ema_momentum, the harshest case), in
steps per second, interleaved rounds, median:

- a ladder from the bare loop to the whole job loop: `bare`; `+ loss.item()`; `+ grad norm`
  (per-parameter norms over a `model.parameters()` walk, stacked, `.item()`: the driver before
  phase 2); the same norm by `torch._foreach_norm`; the driver's `train_step` (loss and
  `_foreach_norm` gradient norm left on the device, no read; its timers); `TrainingJob.run` with
  no tracker (the loop's bookkeeping: the step's values kept and read back every 100 steps or 1 s
  by `to_floats`, one `metrics()` call and one progress update per flush); `TrainingJob.run` with
  a real MLflow run (the delivery competing for the interpreter); `TrainingJob.run` with the
  checkpoint round trip every 100 steps;
- the delivery thread's own cost: CPU seconds per point to build MLflow entities and send them
  (`MlflowRun._send_metrics` on 1000-point batches);
- the checkpoint round trip (save, one read of the file and a deep copy for the twin, two builds,
  compare, two probe steps) per parameter byte, on this workload;
- a cProfile of `TrainingJob.run` without a tracker: the top functions by own time.

Run: `python benchmarks/step_profile.py [--workload digits_mlp] [--steps 1000] [--rounds 5]`.
Asserts nothing; one `BENCH step_profile` line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from common import bench_line, interleaved, machine_line, median, mlflow_server, thread_environment
from tracking_overhead import BareLoop, job_spec


def per_parameter_norm(model: Any) -> float:
    import torch

    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm().item())


def foreach_norm(model: Any) -> float:
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item())


def training_job(spec: dict[str, Any], folder: Path, tracker: Any) -> Any:
    from jobs.report import Reporter
    from jobs.spec import JobSpec
    from jobs.training.loop import TrainingJob
    from optimizers.registry import load_registry

    folder.mkdir(parents=True, exist_ok=True)
    return TrainingJob(
        JobSpec.model_validate(spec),
        registry=load_registry(styles=("torch",)),
        workdir=folder,
        tracker=tracker,
        reporter=Reporter(folder),
    )


def job_rate(spec: dict[str, Any], folder: Path, uri: str | None) -> float:
    from jobs.tracking import MlflowRun, NullTracker

    tracker: Any = NullTracker()
    if uri:
        tracker = MlflowRun(uri, experiment="bench-profile", run_name="profile", params={}, tags={})
    job = training_job(spec, folder, tracker)
    outcome = job.run()
    if uri:
        tracker.end("FINISHED")
    return float(spec["steps"] / outcome.train_seconds)


def delivery_cost(uri: str, points: int = 6000) -> float:
    """CPU seconds per point that the delivery thread spends building entities and sending them."""
    from jobs.tracking import MlflowRun, Point

    run = MlflowRun(uri, experiment="bench-profile", run_name="delivery", params={}, tags={})
    batch = [Point(f"m{i % 6}", float(i), i // 6, int(time.time() * 1000)) for i in range(points)]
    started = time.thread_time()
    for start in range(0, points, 1000):
        run._send_metrics(batch[start : start + 1000])
    cost = (time.thread_time() - started) / points
    run.end("FINISHED")
    return cost


def checkpoint_cost(spec: dict[str, Any], folder: Path, repeats: int = 5) -> tuple[float, int]:
    """Median seconds of one checkpoint round trip, and the model's parameter bytes."""
    from jobs.tracking import NullTracker

    job = training_job(spec, folder, NullTracker())
    session = job.session
    objects = session.build()
    for step in range(3):
        session.train_step(objects, session.batch(step), step)
    params = sum(p.numel() * p.element_size() for p in objects.model.parameters())
    times = []
    for index in range(repeats):
        started = time.perf_counter()
        objects = session.checkpoint(objects, 3 + index, folder).objects
        times.append(time.perf_counter() - started)
    return median(times), params


def profile(spec: dict[str, Any], folder: Path, top: int = 15) -> str:
    from jobs.tracking import NullTracker

    job = training_job(spec, folder, NullTracker())
    profiler = cProfile.Profile()
    profiler.enable()
    job.run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--optimizer", default="ema_momentum")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default torch's)")
    args = parser.parse_args()
    thread_environment(args.threads)
    print(machine_line(), f"threads {args.threads or 'default'}")
    off = job_spec(args, args.workload, checkpoint_every=args.steps)
    on = job_spec(args, args.workload, checkpoint_every=100)
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp, mlflow_server() as uri:
        folder = Path(tmp)
        bare = BareLoop(off, folder / "bare")
        from jobs.tracking import NullTracker

        step_job = training_job(off, folder / "steps", NullTracker())
        session = step_job.session

        def driver_steps() -> float:
            objects = session.build()
            started = time.perf_counter()
            for step in range(args.steps):
                session.train_step(objects, session.batch(step), step)
            return args.steps / (time.perf_counter() - started)

        counter = iter(range(1_000_000))
        cases = {
            "bare": bare.run,
            "+ loss.item()": lambda: bare.run(lambda s, loss, m: loss.item()),
            "+ item + grad norm": lambda: bare.run(lambda s, loss, m: (loss.item(), per_parameter_norm(m))),
            "+ item + foreach norm": lambda: bare.run(lambda s, loss, m: (loss.item(), foreach_norm(m))),
            "driver train_step": driver_steps,
            "TrainingJob, no tracker": lambda: job_rate(off, folder / f"j{next(counter)}", None),
            "TrainingJob, MLflow": lambda: job_rate(off, folder / f"j{next(counter)}", uri),
            "TrainingJob, MLflow, ckpt/100": lambda: job_rate(on, folder / f"j{next(counter)}", uri),
        }
        rates = interleaved(cases, args.rounds)
        per_point = delivery_cost(uri)
        checkpoint_s, param_bytes = checkpoint_cost(off, folder / "checkpoint")
        profiled = profile(off, folder / "profile")
    base = median(rates["bare"])
    print(
        f"\n{args.workload}, {args.optimizer}, {args.steps} steps: "
        f"steps/s (median of {args.rounds}), us per step"
    )
    for label, values in rates.items():
        rate = median(values)
        print(f"  {label:<32} {rate:8.0f} steps/s  {rate / base:5.3f} of bare  {1e6 / rate:8.0f} us/step")
    print(
        f"\ndelivery thread: {per_point * 1e6:.1f} us of CPU per point (entities + HTTP); "
        "a job logs 3 points a step and 3 a flush"
    )
    print(
        f"checkpoint round trip: {checkpoint_s * 1000:.1f} ms for {param_bytes / 1e6:.2f} MB of parameters "
        f"({checkpoint_s * 1e9 / param_bytes:.1f} ns per parameter byte)"
    )
    print("\ncProfile of TrainingJob.run (no tracker), top functions by own time:")
    print(profiled)
    bench_line(
        "step_profile",
        workload=args.workload,
        bare_steps_per_s=base,
        ratio_item=median(rates["+ loss.item()"]) / base,
        ratio_item_norm=median(rates["+ item + grad norm"]) / base,
        ratio_item_foreach_norm=median(rates["+ item + foreach norm"]) / base,
        ratio_driver=median(rates["driver train_step"]) / base,
        ratio_job_null=median(rates["TrainingJob, no tracker"]) / base,
        ratio_job_mlflow=median(rates["TrainingJob, MLflow"]) / base,
        ratio_job_mlflow_ckpt100=median(rates["TrainingJob, MLflow, ckpt/100"]) / base,
        delivery_us_per_point=per_point * 1e6,
        checkpoint_ms=checkpoint_s * 1000,
        checkpoint_ns_per_byte=checkpoint_s * 1e9 / param_bytes,
    )
    print(machine_line())


if __name__ == "__main__":
    main()
