"""Where a checkpoint's time goes in a tracked torch job: each part timed in place.

`TrainingJob.run` in this process with a real MLflow run and the MLflow checkpoint store (as
`python -m jobs.run` with a tracking server has them), the parts wrapped by timers: the proof
(`TrainingJob._checkpoint`: save, read back, restore, compare, the probe step; with steps after
it, the rest at the next step, `_confirm_checkpoint`), and in the background the publication
(`MlflowCheckpoints.publish`: the delivery flush, `DeliveryProcess.flush`, then the upload,
`MlflowRun.log_artifact`); the final evaluation too. Totals and the largest single call, per run.

Run: `python benchmarks/checkpoint_parts.py [--workload char_lm] [--steps 500] [--batch-size 16]
[--checkpoint-every 100] [--runs 3]`. Asserts nothing; one `BENCH checkpoint_parts` line per run.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import bench_line, machine_line, mlflow_server

PARTS = {
    "proof": ("jobs.training.loop", "TrainingJob", "_checkpoint"),
    "proof, after the next step": ("jobs.training.loop", "TrainingJob", "_confirm_checkpoint"),
    "publication": ("jobs.resume", "MlflowCheckpoints", "publish"),
    "  delivery flush": ("jobs.metric_delivery", "DeliveryProcess", "flush"),
    "  upload": ("jobs.tracking", "MlflowRun", "log_artifact"),
    "evaluation": ("jobs.training.loop", "TrainingJob", "_evaluate"),
}


def timed(times: dict[str, list[float]], label: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - started)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="char_lm")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import importlib

    import torch

    from jobs.report import Reporter
    from jobs.resume import MlflowCheckpoints
    from jobs.spec import JobSpec
    from jobs.tracking import MlflowRun
    from jobs.training.loop import TrainingJob
    from optimizers.registry import load_registry

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {}
    for label, (module, cls, method) in PARTS.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, method, timed(times, label, getattr(owner, method)))
    spec = JobSpec.model_validate(
        {
            "workload": {"name": args.workload},
            "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
            "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
            "steps": args.steps,
            "batch_size": args.batch_size,
            "checkpoint_every": args.checkpoint_every,
            "eval_every": args.steps,
            "device": "cpu",
        }
    )
    registry = load_registry(styles=("torch",))
    print(machine_line())
    with mlflow_server() as uri, tempfile.TemporaryDirectory(prefix="bench-checkpoint-parts-") as tmp:
        for index in range(args.runs):
            times.clear()
            folder = Path(tmp) / f"run-{index}"
            folder.mkdir()
            run = MlflowRun(
                uri, experiment="bench-checkpoint-parts", run_name=f"run-{index}", params={}, tags={}
            )
            job = TrainingJob(
                spec,
                registry=registry,
                workdir=folder,
                tracker=run,
                reporter=Reporter(folder),
                checkpoints=MlflowCheckpoints(run),
            )
            outcome = job.run()
            run.end("FINISHED")
            steps_s = (
                args.steps * args.batch_size / outcome.samples_per_sec if outcome.samples_per_sec else 0.0
            )
            print(
                f"\n{args.workload}, {args.steps} steps, a checkpoint every {args.checkpoint_every}: "
                f"train_seconds {outcome.train_seconds:.3f}, of which the steps {steps_s:.3f}"
            )
            for label in PARTS:
                values = times.get(label, [])
                if values:
                    print(
                        f"  {label:<28} {len(values):4d} calls  {sum(values) * 1000:8.1f} ms  "
                        f"largest {max(values) * 1000:6.1f} ms"
                    )
            bench_line(
                "checkpoint_parts",
                workload=args.workload,
                run=index,
                train_seconds=outcome.train_seconds,
                steps_seconds=steps_s,
                **{
                    label.strip().replace(", ", "_").replace(" ", "_") + "_ms": sum(times.get(label, []))
                    * 1000
                    for label in PARTS
                },
            )
    print(machine_line())


if __name__ == "__main__":
    main()
