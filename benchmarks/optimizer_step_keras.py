"""Benchmark: one `apply_gradients` inside a compiled step (`tf.function`, XLA off and on) for each
built-in custom Keras 3 optimizer against Keras's own of comparable math, on the shapes of
`optimizer_step.py` (115 variables of a small transformer; `--shapes small|large` too).

`ema_momentum` vs `keras.optimizers.SGD(momentum=0.9)` (one slot per variable; both with weight
decay, which Keras decouples and scales by the rate as ema_momentum does, and both without, as a
pair of their own), `adamw_ref` vs `keras.optimizers.AdamW`, `lion` vs `keras.optimizers.Lion`.
TensorFlow runs with one intra-op and one inter-op thread and the clock is the process's CPU time
(steady on a loaded machine); variants are interleaved round after round and the median is
reported, each against the best built-in compiled the same way (graph, XLA). Measure only: the
Keras optimizers are left as they are.
Run: `python benchmarks/optimizer_step_keras.py [--steps 20] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import machine_line
from optimizer_step import model_shapes

LR, WEIGHT_DECAY = 1e-3, 1e-2
NO_DECAY = "weight_decay=0"  # a pair of variants compared with each other only


def variants() -> dict[str, dict[str, Callable[[], Any]]]:
    import keras

    from optimizers.keras.adamw_ref import AdamWRef
    from optimizers.keras.ema_momentum import EmaMomentum
    from optimizers.keras.lion import Lion

    return {
        "ema_momentum": {
            "custom": lambda: EmaMomentum(learning_rate=LR, beta=0.9, weight_decay=WEIGHT_DECAY),
            "builtin SGD(momentum=0.9)": lambda: keras.optimizers.SGD(
                learning_rate=LR, momentum=0.9, weight_decay=WEIGHT_DECAY
            ),
            f"custom {NO_DECAY}": lambda: EmaMomentum(learning_rate=LR, beta=0.9),
            f"builtin SGD(momentum=0.9) {NO_DECAY}": lambda: keras.optimizers.SGD(
                learning_rate=LR, momentum=0.9
            ),
        },
        "adamw_ref": {
            "custom": lambda: AdamWRef(learning_rate=LR, weight_decay=WEIGHT_DECAY),
            "builtin AdamW": lambda: keras.optimizers.AdamW(learning_rate=LR, weight_decay=WEIGHT_DECAY),
        },
        "lion": {
            "custom": lambda: Lion(learning_rate=LR, weight_decay=WEIGHT_DECAY),
            "builtin Lion": lambda: keras.optimizers.Lion(learning_rate=LR, weight_decay=WEIGHT_DECAY),
        },
    }


def compiled_step(make: Callable[[], Any], shapes: list[tuple[int, ...]], jit: bool) -> Callable[[int], None]:
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.standard_normal(shape).astype("float32") * 0.02) for shape in shapes]
    grads = [tf.constant(rng.standard_normal(shape).astype("float32")) for shape in shapes]
    optimizer = make()
    optimizer.build(variables)

    @tf.function(jit_compile=jit)
    def step() -> None:
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    step()  # traced and compiled outside the timing

    def run(steps: int) -> None:
        for _ in range(steps):
            step()
        variables[0].numpy()  # wait for the last update

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", choices=("model", "large", "small"), default="model")
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    shapes = model_shapes(args.shapes)
    numel = sum(math.prod(shape) for shape in shapes)
    print(
        f"tensorflow {tf.__version__}, 1 thread, {len(shapes)} variables, {numel / 1e6:.2f}M parameters, "
        f"clock: process CPU time; {machine_line()}"
    )
    for name, makers in variants().items():
        runs = {
            f"{label} {'XLA' if jit else 'graph'}": compiled_step(make, shapes, jit)
            for label, make in makers.items()
            for jit in (False, True)
        }
        times: dict[str, list[float]] = {label: [] for label in runs}
        labels = list(runs)
        for index in range(args.rounds):
            shift = index % len(labels)
            for label in labels[shift:] + labels[:shift]:
                started = time.process_time()
                runs[label](args.steps)
                times[label].append((time.process_time() - started) * 1000 / args.steps)
        medians = {label: statistics.median(values) for label, values in times.items()}
        print(f"\n{name}: ms per compiled step (median of {args.rounds} rounds of {args.steps})")
        for mode in ("graph", "XLA"):
            for label, ms in medians.items():
                if label.endswith(f" {mode}"):
                    # The no-decay pair against its own built-in, the rest against theirs.
                    builtin = _best(medians, "builtin", mode, NO_DECAY if NO_DECAY in label else "")
                    print(f"  {label:<46} {ms:8.3f} ms  {ms / builtin:5.2f}x the best built-in ({mode})")
        custom = {mode: _best(medians, "custom", mode) for mode in ("graph", "XLA")}
        builtin_best = min(_best(medians, "builtin", mode) for mode in ("graph", "XLA"))
        ratios = {mode: custom[mode] / _best(medians, "builtin", mode) for mode in custom}
        extra = ""
        if any(NO_DECAY in label for label in medians):
            no_decay = {
                mode: _best(medians, "custom", mode, NO_DECAY) / _best(medians, "builtin", mode, NO_DECAY)
                for mode in custom
            }
            extra = f" graph_no_decay_ratio={no_decay['graph']:.2f} xla_no_decay_ratio={no_decay['XLA']:.2f}"
        print(
            f"BENCH optimizer_step framework=keras optimizer={name} shapes={args.shapes} "
            f"graph_ms={custom['graph']:.3f} xla_ms={custom['XLA']:.3f} best_builtin_ms={builtin_best:.3f} "
            f"graph_ratio={ratios['graph']:.2f} xla_ratio={ratios['XLA']:.2f} "
            f"ratio={min(custom.values()) / builtin_best:.2f}{extra}",
            flush=True,
        )


def _best(medians: dict[str, float], kind: str, mode: str, pair: str = "") -> float:
    """The fastest `kind` ("custom", "builtin") variant's ms in `mode`; within the `pair` (NO_DECAY)
    when given, else outside it."""
    return min(
        ms
        for label, ms in medians.items()
        if label.startswith(kind)
        and label.endswith(f" {mode}")
        and ((pair in label) if pair else NO_DECAY not in label)
    )


if __name__ == "__main__":
    main()
