"""Benchmark: what the service's tracking costs a torch training loop, next to what people use today.

On one workload, one optimizer and one schedule, interleaved round after round (every case once
per round, each round starting at the next case), in steps per second, median over rounds:

- `bare`: the job's own model, optimizer, scheduler and batches (built as a job builds them),
  stepped in a plain loop that reads nothing back;
- `bare+item`: the same, reading `loss.item()` and the gradient norm's `.item()` every step
  (what logging anything per step costs before any tracker runs);
- peers, in the bare loop logging what the job logs (loss, rate and gradient norm every step, three
  timings every 100 steps): MLflow's
  `MlflowClient.log_metric` synchronous (over `--sync-steps` steps only: each call is an HTTP
  round trip) and `synchronous=False` (over `--async-steps`: the rate in the loop; the wait for
  delivery afterwards, which takes far longer, is printed),
  TensorBoard's `SummaryWriter.add_scalar` when `torch.utils.tensorboard` imports here;
- `job null`: `python -m jobs.run SPEC` without a tracking server (the loop's own bookkeeping:
  the step's device values kept and read back in bulk every 100 steps or 1 s, and before each
  evaluation and checkpoint, the points handed over in one call, progress at that cadence);
- `job off`: the same with every metric to a real MLflow server, the checkpoint round trip at
  the end only; `job on`: the checkpoint round trip every 100 steps (the default cadence).
  A job's rate is `steps / train_seconds` from its result.json (the loop, evaluation at the
  end and checkpoints, not the process start); every `train/loss` point is read back from
  MLflow (`points_ok`).

The tracking server's own intake is measured too (`server_capacity`: points a second through the
job's delivery with nothing training beside it): a third of it bounds any job that delivers every
point (`server_bound`, over `bare`). Ratios are over `bare`: of the medians, and `paired` (the
median of each round's ratio to that round's `bare`, steadier where the machine's speed drifts),
with a 90% bootstrap interval over the rounds: a target is met when the interval lies above it.
`--no-peers` runs `bare` and the three jobs only, so that more rounds fit where a small margin is
to be judged.
Targets (issue 15): digits_mlp `ratio_off` >= 0.85 with every point delivered; a larger workload
>= 0.97 (`ratio_off`) and >= 0.93 (`ratio_on`).
Run: `python benchmarks/tracking_overhead.py [--workload digits_mlp,digits_cnn] [--steps 2000]
[--rounds 3] [--optimizer ema_momentum] [--no-peers]`; the larger workload: `--workload char_lm
--steps 500 --batch-size 16 --no-peers --rounds 12` (a step takes about 12 ms on one CPU
thread). Asserts nothing; one `BENCH tracking_overhead` line per workload.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    bench_line,
    interleaved,
    machine_line,
    median,
    mlflow_server,
    paired_interval,
    paired_ratio,
    run_job,
    thread_environment,
)

from jobs.training.loop import FLUSH_EVERY_STEPS

# What a job logs, and so what the peers log too: three values every step, its timings once a
# window (the loop's flush window by step count).
TIMINGS_EVERY = FLUSH_EVERY_STEPS


@dataclass(frozen=True)
class Ratios:
    """A case's rates over `bare`'s: of the medians, paired, and the paired ratio's 90% interval."""

    of_bare: float
    paired: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float], bare: list[float]) -> Ratios:
        return cls(median(values) / median(bare), paired_ratio(values, bare), *paired_interval(values, bare))


def job_spec(args: argparse.Namespace, workload: str, *, checkpoint_every: int) -> dict[str, Any]:
    return {
        "framework": "torch",
        "workload": {"name": workload},
        "optimizer": {"name": args.optimizer, "params": {"lr": args.lr}},
        "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": 0,
        "checkpoint_every": checkpoint_every,
        "eval_every": args.steps,
        "experiment": "bench-tracking",
        "device": "cpu",
    }


class BareLoop:
    """The job's objects, built the way `jobs.training.loop.TrainingJob` builds them, in a plain loop."""

    def __init__(self, spec: dict[str, Any], folder: Path) -> None:
        from jobs.report import Reporter
        from jobs.spec import JobSpec
        from jobs.tracking import NullTracker
        from jobs.training.loop import TrainingJob
        from optimizers.registry import load_registry

        job = TrainingJob(
            JobSpec.model_validate(spec),
            registry=load_registry(styles=("torch",)),
            workdir=folder,
            tracker=NullTracker(),
            reporter=Reporter(folder),
        )
        self.session: Any = job.session
        self.steps = int(spec["steps"])

    def run(self, on_step: Callable[[int, Any, Any], None] | None = None, steps: int | None = None) -> float:
        """Steps per second over `steps` (default: the spec's); `on_step(step, loss, model)` after each."""
        objects = self.session.build()
        model, optimizer, scheduler = objects.model, objects.optimizer, objects.scheduler
        loss_of = self.session._loss  # the job's loss (a language model's (N, T, C) flattened as it does)
        count = steps or self.steps
        started = time.perf_counter()
        for step in range(count):
            x, y = self.session.batch(step)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if on_step is not None:
                on_step(step, loss, model)
        return count / (time.perf_counter() - started)


def grad_norm(model: Any) -> Any:
    import torch

    return torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()


def job_scalars(step: int, loss: Any, model: Any) -> list[tuple[str, float]]:
    """The points a job logs at `step`: loss, rate and gradient norm; the window's timings at its end."""
    value = float(loss.item())
    norm = float(grad_norm(model).item())
    scalars = [("train/loss", value), ("train/lr", 0.05), ("train/grad_norm", norm)]
    if step % TIMINGS_EVERY == TIMINGS_EVERY - 1:
        scalars += [
            ("perf/step_time_ms", 1.0),
            ("perf/optimizer_step_ms", 0.1),
            ("perf/samples_per_sec", 6400.0),
        ]
    return scalars


def reads_items(step: int, loss: Any, model: Any) -> None:
    loss.item()
    grad_norm(model).item()


def mlflow_peer(uri: str, *, synchronous: bool, waits: list[float]) -> Callable[[int, Any, Any], None]:
    """A `log_metric` per scalar per step into a fresh run, as a hand-written loop does."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("bench-peers")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("bench-peers")
    run_id = client.create_run(experiment_id).info.run_id
    pending: list[Any] = []

    def on_step(step: int, loss: Any, model: Any) -> None:
        for key, value in job_scalars(step, loss, model):
            operation = client.log_metric(run_id, key, value, step=step, synchronous=synchronous)
            if operation is not None:
                pending.append(operation)

    def wait() -> None:
        started = time.perf_counter()
        for operation in pending:
            operation.wait()
        waits.append(time.perf_counter() - started)

    on_step.wait = wait  # type: ignore[attr-defined]
    return on_step


def tensorboard_peer(folder: Path) -> Callable[[int, Any, Any], None] | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        print(f"TensorBoard peer skipped: torch.utils.tensorboard does not import here ({exc})")
        return None
    writer = SummaryWriter(str(folder / "tensorboard"))

    def on_step(step: int, loss: Any, model: Any) -> None:
        for key, value in job_scalars(step, loss, model):
            writer.add_scalar(key, value, step)

    return on_step


def server_capacity(uri: str, steps: int = 4000) -> float:
    """Points per second the tracking server takes in through the job's own delivery (the delivery
    process, full batches), with nothing training beside it: the most any job can log. A job logs
    three points a step (and three a window), so no job can run faster than a third of this with
    every point delivered, however little it costs itself."""
    from jobs.tracking import MlflowRun, Point

    run = MlflowRun(uri, experiment="bench-capacity", run_name="capacity", params={}, tags={})
    time.sleep(1.0)  # the delivery process has started and is ready
    stamp = int(time.time() * 1000)
    started = time.perf_counter()
    for start in range(0, steps, TIMINGS_EVERY):
        run.metrics(
            [
                Point(key, value, step, stamp)
                for step in range(start, start + TIMINGS_EVERY)
                for key, value in (
                    ("train/loss", 1.0 / (step + 1)),
                    ("train/lr", 0.05),
                    ("train/grad_norm", 1.0),
                )
            ]
        )
    run.delivery.flush()
    seconds = time.perf_counter() - started
    run.end("FINISHED")
    return 3 * steps / seconds


def points_delivered(uri: str, result: dict[str, Any], steps: int) -> bool:
    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(result["mlflow"]["run_id"], "train/loss")
    return len({point.step for point in history}) == steps


def bench_workload(args: argparse.Namespace, workload: str, uri: str, folder: Path) -> None:
    off_spec = job_spec(args, workload, checkpoint_every=args.steps)
    on_spec = job_spec(args, workload, checkpoint_every=100)
    bare = BareLoop(off_spec, folder / f"bare-{workload}")
    delivered: list[bool] = []
    async_waits: list[float] = []
    counter = iter(range(1_000_000))

    def job(spec: dict[str, Any], tracking: str | None) -> Callable[[], float]:
        def run() -> float:
            result = run_job(
                spec, tracking_uri=tracking, folder=folder, name=f"{workload}-{next(counter)}", env=args.env
            )
            if tracking:
                delivered.append(points_delivered(uri, result, args.steps))
            return float(args.steps / result["train_seconds"])

        return run

    def sync_peer() -> float:
        return bare.run(mlflow_peer(uri, synchronous=True, waits=[]), steps=args.sync_steps)

    def async_peer() -> float:
        on_step = mlflow_peer(uri, synchronous=False, waits=async_waits)
        rate = bare.run(on_step, steps=args.async_steps)
        on_step.wait()  # type: ignore[attr-defined]
        return rate

    cases: dict[str, Callable[[], float]] = {"bare": bare.run}
    if args.peers:
        cases.update(
            {"bare+item": lambda: bare.run(reads_items), "mlflow sync": sync_peer, "mlflow async": async_peer}
        )
        board = tensorboard_peer(folder)
        if board is not None:
            cases["tensorboard"] = lambda: bare.run(board)
    cases.update(
        {"job null": job(off_spec, None), "job off": job(off_spec, uri), "job on": job(on_spec, uri)}
    )
    # Before the rounds, on the emptiest database (SQLite's intake slows as it fills): the most any
    # job of the rounds could have had; and after them, for comparison.
    capacity = median([server_capacity(uri) for _ in range(3)])
    rates = interleaved(cases, args.rounds)
    capacity_after = median([server_capacity(uri) for _ in range(3)])
    base = median(rates["bare"])
    points_per_step = 3 + 3 / TIMINGS_EVERY
    print(
        f"\n{workload}, {args.optimizer}, {args.steps} steps, batch {args.batch_size}: "
        f"steps/s, median of {args.rounds}"
    )
    ratios = {label: Ratios.of(values, rates["bare"]) for label, values in rates.items()}
    print(f"  {'':<14} {'':>8}          {'of bare':>13}  {'paired, 90% interval':>21}")
    for label, values in rates.items():
        shown = ", ".join(f"{v:.0f}" for v in values)
        r = ratios[label]
        print(
            f"  {label:<14} {median(values):8.0f} steps/s  {r.of_bare:13.3f}  {r.paired:6.3f} "
            f"[{r.low:.3f}, {r.high:.3f}]   ({shown})"
        )
    if async_waits:
        print(
            f"  mlflow async: waiting for delivery after the loop took {median(async_waits):.1f} s (median)"
        )
    print(f"  every train/loss point in MLflow: {sum(delivered)} of {len(delivered)} tracked jobs")
    print(
        f"  the tracking server takes in {capacity:.0f} points/s before the rounds ({capacity_after:.0f} "
        f"after them; median of 3, nothing else running): {points_per_step:.2f} points a step bound "
        f"any job with every point delivered to {capacity / points_per_step:.0f} steps/s, "
        f"{capacity / points_per_step / base:.3f} of bare"
    )

    def of_bare(label: str) -> float | str:
        return ratios[label].of_bare if label in ratios else "n/a"

    off, on = ratios["job off"], ratios["job on"]
    bench_line(
        "tracking_overhead",
        workload=workload,
        ratio_off=off.of_bare,
        ratio_on=on.of_bare,
        points_ok=int(bool(delivered) and all(delivered)),
        ratio_null=of_bare("job null"),
        ratio_item=of_bare("bare+item"),
        ratio_mlflow_sync=of_bare("mlflow sync"),
        ratio_mlflow_async=of_bare("mlflow async"),
        ratio_tensorboard=of_bare("tensorboard"),
        bare_steps_per_s=base,
        rounds=args.rounds,
        paired_off=off.paired,
        paired_off_low=off.low,
        paired_off_high=off.high,
        paired_on=on.paired,
        paired_on_low=on.low,
        paired_on_high=on.high,
        server_points_per_s=capacity,
        server_points_per_s_after=capacity_after,
        server_bound=capacity / points_per_step / base,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="digits_mlp,digits_cnn", help="comma-separated workload names")
    parser.add_argument("--optimizer", default="ema_momentum")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sync-steps", type=int, default=20, help="steps of the synchronous MLflow peer")
    parser.add_argument(
        "--async-steps",
        type=int,
        default=300,
        help="steps of the asynchronous MLflow peer (its delivery is slow)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="bare and the jobs only (no item reads, MLflow or TensorBoard peers): more rounds fit",
    )
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads here and in the jobs (default torch's)"
    )
    args = parser.parse_args()
    args.env = thread_environment(args.threads)
    print(machine_line(), f"threads {args.threads or 'default'}")
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp, mlflow_server() as uri:
        for workload in args.workload.split(","):
            bench_workload(args, workload, uri, Path(tmp))
    print(machine_line())


if __name__ == "__main__":
    main()
