"""Keras 3 and legacy tf.keras's side of the fresh-process checks: the tiny problem, the runs,
a `tf.train.Checkpoint` resumed elsewhere, MirroredStrategy over two logical CPUs.

Reached through `KerasDriver.fresh_module`; the driver (`driver_for(style)`) says how the
style builds state and applies gradients. `run_and_save` runs in the checking process,
the rest in a process forked from the fresh child (`child.py`) before TensorFlow's
runtime starts there. Steps run eagerly on purpose: whether the update also works under
`tf.function` is `graph_mode`'s question, and one fault should fail one check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext
from jobs.checks.fresh.plan import (
    DISTRIBUTED_STEPS,
    GLOBAL_BATCH,
    INITIAL,
    REPLICA_RUNS,
    REPLICAS,
    RESUME_SPLIT,
    RESUME_STEPS,
    SEED,
    SINGLE,
    Wording,
)
from jobs.checks.fresh.results import MODEL, OPTIMIZER, Arrays, Run, save_run
from jobs.checks.tools import same_draws
from jobs.frameworks import driver_for
from jobs.frameworks.base import StateDifference
from jobs.frameworks.keras_driver import KerasDriver, optimizer_variables_of

WORDING = Wording(
    checkpoint="tf.train.Checkpoint",
    state_home="all state in variables made with add_variable / add_slot",
    saver="the checkpoint",
    resume_child_fix="create all state in build() (legacy: _create_slots) so a fresh process restores it "
    "before its first step; the error above says what went wrong",
    setup=f"MirroredStrategy with {REPLICAS} replicas",
    replica="replica",
    single="one device",
    reference="one device on the full batch",
    distributed_child_fix="",
    distributed_child_fixes=(
        # A variable made in the first update, on one replica, outside the strategy's scope.
        (
            r"colocate_vars_with|(?i:variable creation|creat\w* (?:a |the )?(?:new )?(?:slot )?variable"
            r"|non-first call)",
            "create every variable in build() (add_variable_from_reference; legacy: _create_slots), never "
            "lazily in the update, which runs per replica under a strategy",
        ),
        # A Python number read from a variable in the update: int(self.iterations), a Python if on it.
        (
            r"(?:argument must be|not supported between instances of|cannot be interpreted as).*"
            r"'\w*(?:Mirrored|SyncOnRead|Distributed|PerReplica)\w*'",
            "read no Python number from a variable in the update (int(), float(), bool(), a Python if or "
            "comparison on self.iterations or a slot): under a strategy it is a MirroredVariable, one value "
            "per replica, which Python cannot read; compute with ops on it (ops.where, ops.cond, "
            "ops.cast(self.iterations, variable.dtype); legacy: tf.where, tf.cond), which tf.function needs "
            "too",
        ),
    ),
    apart_fix="update only through the variable passed to update_step and its slots, so every replica "
    "takes the same step",
    layout_fix="create every slot in build() with add_variable_from_reference (legacy: _create_slots with "
    "add_slot), so the strategy mirrors it on each replica",
    beyond_fix="compute statistics of the gradient (norms, clipping, normalisation) in update_step or after "
    "aggregation, not on each replica's local gradient in apply()/apply_gradients()",
)
LAYER_SHAPES = ((6, 8), (8,), (8, 3), (3,))


# -- the tiny problem every side of a comparison runs -------------------------------------------------


def driver(ctx: CheckContext) -> KerasDriver:
    keras_driver = driver_for(ctx.target.style)
    assert isinstance(keras_driver, KerasDriver)
    return keras_driver


def tiny_model(km: Any) -> Any:
    """Dense(8, tanh) -> Dense(3) with fixed initial weights (no global seed touched).

    dtype float32 explicitly: a mixed-precision policy left behind must not change the maths.
    """
    model = km.Sequential(
        [
            km.Input((6,)),
            km.layers.Dense(8, activation="tanh", dtype="float32"),
            km.layers.Dense(3, dtype="float32"),
        ]
    )
    rng = np.random.RandomState(SEED)
    model.set_weights([(rng.randn(*shape) * 0.4).astype("float32") for shape in LAYER_SHAPES])
    return model


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of `step`, a pure function of the step (a resumed run sees the same data)."""
    rng = np.random.RandomState(SEED + step)
    return rng.randn(GLOBAL_BATCH, 6).astype("float32"), rng.randn(GLOBAL_BATCH, 3).astype("float32")


def build(
    ctx: CheckContext, overrides: Mapping[str, Any], options_off: Sequence[str] = ()
) -> tuple[Any, Any]:
    """Model and optimizer, the optimizer's variables made now so a checkpoint restores into them;
    `options_off`: Keras options of the optimizer's to turn off first (`Driver.drop_options`)."""
    style = driver(ctx)
    model = tiny_model(style.km)
    optimizer = ctx.build(**overrides)
    style.drop_options(optimizer, options_off)
    style.create_state(optimizer, model.trainable_variables)
    return model, optimizer


def train(ctx: CheckContext, model: Any, optimizer: Any, steps: range) -> None:
    style = driver(ctx)
    tf = style.tf
    variables = model.trainable_variables
    for step in steps:
        x, y = batch(step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        style.apply(optimizer, tape.gradient(loss, variables), variables)


def variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def snapshot(model: Any, optimizer: Any) -> tuple[Arrays, dict[str, str]]:
    """Model weights and optimizer variables by position (names differ between builds), and
    their readable labels."""
    arrays = {f"{MODEL}/{i}": np.array(w) for i, w in enumerate(model.get_weights())}
    labels = {f"{MODEL}/{i}": f"model weight {i}" for i in range(len(arrays))}
    for index, variable in enumerate(optimizer_variables_of(optimizer)):
        key = f"{OPTIMIZER}/{index}"
        arrays[key] = np.array(variable.numpy())
        labels[key] = f"optimizer variable {variable_name(variable)!r}"
    return arrays, labels


# -- the checking process -------------------------------------------------------------------------------


def settings() -> dict[str, Any]:
    import tensorflow as tf
    from tensorflow.python.framework import config  # the query has no public name

    return {
        "op_determinism": bool(config.is_op_determinism_enabled()),
        "intra_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_threads": tf.config.threading.get_inter_op_parallelism_threads(),
    }


# The seeds of the steps before the split and of those after it, set alike in the straight run, in
# the one saved and in the resumed one: a class that draws by design (SGLD's tf.random.normal noise)
# then draws the same numbers in each. No checkpoint holds where TensorFlow's op-seeded streams stand,
# so a resumed process must start them again; a deterministic class is not changed by a seed.
FIRST_DRAWS, RESUMED_DRAWS = SEED, SEED + 1


def run_and_save(ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path) -> Run:
    with same_draws(ctx, FIRST_DRAWS):
        model, optimizer = build(ctx, overrides)
        train(ctx, model, optimizer, range(RESUME_SPLIT))
        with same_draws(ctx, RESUMED_DRAWS):
            train(ctx, model, optimizer, range(RESUME_SPLIT, RESUME_STEPS))
    straight = Run(*snapshot(model, optimizer))
    with same_draws(ctx, FIRST_DRAWS):
        model, optimizer = build(ctx, overrides)
        train(ctx, model, optimizer, range(RESUME_SPLIT))
    driver(ctx).tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(checkpoint))
    return straight


def load_difference(
    ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path
) -> StateDifference | None:
    """None: a tf.train.Checkpoint restores into variables already built, in their own dtypes."""
    return None


# -- the fresh child and its forks ---------------------------------------------------------------------


def import_framework(style: str) -> None:
    """TensorFlow and the style's Keras, through its driver (without Keras's optional imports:
    optimizers/optional_imports.py); importing creates no runtime yet."""
    driver_for(style)


def prepare_run(request: Mapping[str, Any]) -> None:
    """Devices, threads, determinism as the checking process has them: TensorFlow takes them only
    before its runtime starts, which is why this runs first in every fork."""
    import tensorflow as tf

    settings = request["settings"]
    if request["role"] == "distributed":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    if settings["intra_threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(settings["intra_threads"])
    if settings["inter_threads"]:
        tf.config.threading.set_inter_op_parallelism_threads(settings["inter_threads"])
    if settings["op_determinism"]:
        tf.config.experimental.enable_op_determinism()


def resume(request: Mapping[str, Any], ctx: CheckContext) -> None:
    model, optimizer = build(ctx, request["overrides"])
    status = driver(ctx).tf.train.Checkpoint(model=model, optimizer=optimizer).read(request["checkpoint"])
    try:
        status.assert_consumed()
    except AssertionError as exc:
        raise RuntimeError(
            "tf.train.Checkpoint: saved values found no variable in a freshly built optimizer "
            f"(state created outside build / _create_slots?): {' '.join(str(exc).split())[:200]}"
        ) from None
    with same_draws(ctx, RESUMED_DRAWS):
        train(ctx, model, optimizer, range(RESUME_SPLIT, RESUME_STEPS))
    arrays, labels = snapshot(model, optimizer)
    save_run(request["out"], arrays, labels=labels)


def distributed(request: Mapping[str, Any], ctx: CheckContext) -> None:
    outs, overrides = request["outs"], request["overrides"]
    options_off = request.get("options_off", ())
    # A first step in this process before either run, as every in-process check has: a value
    # an optimizer caches per process (resume_exact's concern) then cannot tell the runs apart.
    model, optimizer = build(ctx, overrides, options_off)
    train(ctx, model, optimizer, range(1))

    model, optimizer = build(ctx, overrides, options_off)
    save_run(outs[INITIAL], {f"{MODEL}/{i}": np.array(w) for i, w in enumerate(model.get_weights())})
    train(ctx, model, optimizer, range(DISTRIBUTED_STEPS))
    single, labels = snapshot(model, optimizer)
    save_run(outs[SINGLE], single, labels=labels)

    strategy = driver(ctx).tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        model, optimizer = build(ctx, overrides, options_off)
    _train_mirrored(ctx, strategy, model, optimizer)
    variables = optimizer_variables_of(optimizer)
    problem = _unmirrored(variables, sum(key.startswith(f"{OPTIMIZER}/") for key in single))
    if problem:
        save_run(outs[REPLICA_RUNS[0]], {}, problem=problem)
        return
    mirrored, labels = snapshot(model, optimizer)
    save_run(outs[REPLICA_RUNS[0]], mirrored, labels=labels)
    for replica, name in enumerate(REPLICA_RUNS[1:], start=1):
        arrays = {f"{MODEL}/{i}": _component(v, replica) for i, v in enumerate(model.trainable_variables)}
        arrays.update({f"{OPTIMIZER}/{i}": _component(v, replica) for i, v in enumerate(variables)})
        save_run(outs[name], arrays, labels=labels)


def _train_mirrored(ctx: CheckContext, strategy: Any, model: Any, optimizer: Any) -> None:
    style = driver(ctx)
    tf = style.tf
    variables = model.trainable_variables
    share = GLOBAL_BATCH // REPLICAS
    scale = float(GLOBAL_BATCH * 3)  # each replica's share of the full-batch mean

    def replica_step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / scale
        style.apply(optimizer, tape.gradient(loss, variables), variables)  # the optimizer sums replicas

    for step in range(DISTRIBUTED_STEPS):
        x, y = batch(step)

        def rows(context: Any, data: np.ndarray = x) -> np.ndarray:
            start = context.replica_id_in_sync_group * share
            return data[start : start + share]

        xs = strategy.experimental_distribute_values_from_function(rows)
        ys = strategy.experimental_distribute_values_from_function(lambda c, data=y: rows(c, data))
        strategy.run(replica_step, args=(xs, ys))


def _distributed_value(variable: Any) -> Any:
    """The tf.distribute value behind a variable (Keras 3 wraps it in `.value`), else None."""
    import tensorflow as tf

    for candidate in (variable, getattr(variable, "value", None)):
        if isinstance(candidate, tf.distribute.DistributedValues):
            return candidate
    return None


def _component(variable: Any, replica: int) -> np.ndarray:
    return np.array(_distributed_value(variable).values[replica].numpy())


def _unmirrored(variables: Sequence[Any], expected: int) -> str:
    """Why the optimizer's variables under the strategy are not what one device had, or ''."""
    if len(variables) != expected:
        return f"{len(variables)} optimizer variables were created, not the {expected} one device has"
    plain = [variable_name(v) for v in variables if _distributed_value(v) is None]
    if plain:
        return f"optimizer variables {plain[:3]} are not mirrored: each replica does not hold its own copy"
    return ""
