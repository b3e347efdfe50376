"""Benchmark: the Keras 3 side of `tracking_overhead.py` (a process of its own: TensorFlow only).

Same workload, optimizer and schedule, interleaved rounds, steps per second, median:

- `bare fused`: the job's model and optimizer (built by the job's own session), one `tf.function`
  step doing the gradients and the update together, reading nothing back;
- `bare 2 graphs`: the job's two compiled halves per step (gradients, then the update, the
  gradients crossing back through Python between them: what a job step was before phase 2),
  reading nothing back;
- `driver step`: the session's own `train_step` per step (today: one compiled step), its records
  kept and converted once at the end through `to_floats`, as the loop does at its flush cadence;
- `fit` and `fit + autolog`: Keras `model.fit` on the same data and batch size, bare and with
  `mlflow.keras.autolog(log_every_n_steps=1)` into a real MLflow server (the peer; the issue's
  `mlflow.tensorflow.autolog` needs TensorBoard, which is not installed here);
- `job off` / `job on`: `python -m jobs.run SPEC` (framework tensorflow) with every metric to MLflow,
  the checkpoint round trip at the end only / every 100 steps; rate = steps / train_seconds.

Besides the rates: what one checkpoint costs the session in-process (`session.checkpoint` and the
step after it, where a retrace would land), the first one and the median of the next ones.

Ratios: jobs over `bare fused`, autolog over bare `fit`. Run: `python benchmarks/tracking_overhead_keras.py
[--workload digits_mlp] [--steps 1000] [--rounds 3] [--threads 1]`. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import bench_line, interleaved, machine_line, median, mlflow_server, run_job
from tracking_overhead import job_spec


def keras_session(spec: dict[str, Any], folder: Path) -> Any:
    from jobs.report import Reporter
    from jobs.spec import JobSpec
    from jobs.tracking import NullTracker
    from jobs.training.loop import TrainingJob
    from optimizers.registry import load_registry

    folder.mkdir(parents=True, exist_ok=True)
    job = TrainingJob(
        JobSpec.model_validate(spec),
        registry=load_registry(styles=("keras",)),
        workdir=folder,
        tracker=NullTracker(),
        reporter=Reporter(folder),
    )
    return job.session


def bare_fused(session: Any, steps: int) -> float:
    import tensorflow as tf

    objects = session.build()
    model, optimizer = objects.model, objects.optimizer
    variables = model.trainable_variables

    @tf.function
    def step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

    step(*session.batch(0))
    started = time.perf_counter()
    for index in range(steps):
        step(*session.batch(index))
    variables[0].numpy()
    return steps / (time.perf_counter() - started)


def driver_steps(session: Any, steps: int) -> float:
    objects = session.build()
    session.train_step(objects, session.batch(0), 0)  # traced outside the timing
    started = time.perf_counter()
    records = [session.train_step(objects, session.batch(index), index) for index in range(steps)]
    session.to_floats([value for record in records for value in (record.loss, record.grad_norm)])
    return steps / (time.perf_counter() - started)


def checkpoint_costs(session: Any, folder: Path, checkpoints: int = 6, between: int = 10) -> list[float]:
    """Milliseconds of each `session.checkpoint` plus the step after it, `between` steps apart."""
    folder.mkdir(parents=True, exist_ok=True)
    objects, step, costs = session.build(), 0, []
    with session.scope():
        for _ in range(checkpoints):
            for _ in range(between):
                session.train_step(objects, session.batch(step), step)
                step += 1
            started = time.perf_counter()
            objects = session.checkpoint(objects, step, folder).objects
            session.train_step(objects, session.batch(step), step)
            step += 1
            costs.append((time.perf_counter() - started) * 1000)
    return costs


def bare_two_graphs(session: Any, steps: int) -> float:
    objects = session.build()
    objects.apply.compiled(objects.gradients(*session.batch(0))[1])
    started = time.perf_counter()
    for index in range(steps):
        _, grads, _ = objects.gradients(*session.batch(index))
        objects.apply.compiled(grads)
    objects.model.trainable_variables[0].numpy()
    return steps / (time.perf_counter() - started)


def fit(session: Any, steps: int, batch_size: int, uri: str | None) -> float:
    import keras
    import mlflow
    import mlflow.keras

    objects = session.build()
    model = objects.model
    model.compile(
        optimizer=objects.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x, y = session.dataset.x_train, session.dataset.y_train
    per_epoch = -(-len(x) // batch_size)  # the last batch is a partial one
    epochs = max(1, steps // per_epoch)
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # traced outside the timing
    if uri:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("bench-keras-autolog")
        # mlflow.keras: Keras 3's own autolog (mlflow.tensorflow.autolog needs TensorBoard's
        # tf.summary, which is not installed here).
        mlflow.keras.autolog(log_every_n_steps=1, log_models=False, log_datasets=False, silent=True)
        run = mlflow.start_run()
    try:
        started = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
        elapsed = time.perf_counter() - started
    finally:
        if uri:
            mlflow.end_run()
            mlflow.keras.autolog(disable=True)
            del run
    return epochs * per_epoch / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--optimizer", default="ema_momentum")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, help="TensorFlow intra- and inter-op threads, here and in jobs"
    )
    args = parser.parse_args()
    print(machine_line())
    threads = {}
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
        threads = {"TF_NUM_INTRAOP_THREADS": str(args.threads), "TF_NUM_INTEROP_THREADS": str(args.threads)}
    off = {**job_spec(args, args.workload, checkpoint_every=args.steps), "framework": "tensorflow"}
    on = {**job_spec(args, args.workload, checkpoint_every=100), "framework": "tensorflow"}
    with tempfile.TemporaryDirectory(prefix="bench-keras-") as tmp, mlflow_server() as uri:
        folder = Path(tmp)
        session = keras_session(off, folder / "session")
        counter = iter(range(1_000_000))

        def job(spec: dict[str, Any]) -> float:
            name = f"keras-{next(counter)}"
            result = run_job(spec, tracking_uri=uri, folder=folder, name=name, env=threads)
            return float(args.steps / result["train_seconds"])

        cases = {
            "bare fused": lambda: bare_fused(session, args.steps),
            "bare 2 graphs": lambda: bare_two_graphs(session, args.steps),
            "driver step": lambda: driver_steps(session, args.steps),
            "fit": lambda: fit(session, args.steps, args.batch_size, None),
            "fit + autolog": lambda: fit(session, args.steps, args.batch_size, uri),
            "job off": lambda: job(off),
            "job on": lambda: job(on),
        }
        rates = interleaved(cases, args.rounds)
        costs = checkpoint_costs(session, folder / "checkpoints")
    base, fit_base = median(rates["bare fused"]), median(rates["fit"])
    print(
        f"\n{args.workload} (Keras 3), {args.optimizer}, {args.steps} steps: steps/s, median of {args.rounds}"
    )
    for label, values in rates.items():
        shown = ", ".join(f"{v:.0f}" for v in values)
        print(
            f"  {label:<14} {median(values):8.0f} steps/s  {median(values) / base:5.3f} of bare fused  "
            f"({shown})"
        )
    steady = median(costs[1:])
    print(f"  checkpoint + next step: first {costs[0]:.1f} ms, then {steady:.1f} ms (median of the rest)")
    bench_line(
        "tracking_overhead",
        framework="keras",
        workload=args.workload,
        ratio_off=median(rates["job off"]) / base,
        ratio_on=median(rates["job on"]) / base,
        ratio_two_graphs=median(rates["bare 2 graphs"]) / base,
        ratio_driver_step=median(rates["driver step"]) / base,
        ratio_autolog_over_fit=median(rates["fit + autolog"]) / fit_base,
        ratio_fit=fit_base / base,
        bare_steps_per_s=base,
        checkpoint_ms=steady,
        first_checkpoint_ms=costs[0],
    )
    print(machine_line())


if __name__ == "__main__":
    main()
