"""Keras 3 and legacy tf.keras checks that need fresh processes: `resume_exact`, `distributed`.

`resume_exact` saves a `tf.train.Checkpoint` of model and optimizer (as the trainer's
checkpoint of record does) and resumes it in a new process, where state kept in a
class attribute or module global does not follow. `distributed` needs two logical CPU
devices, which TensorFlow only accepts before it starts: a child process again.
Children run `run_child` below through `python -m jobs.checks.child`. Steps run
eagerly on purpose: whether the update also works under `tf.function` is
`graph_mode`'s question, and one fault should fail one check.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jobs.checks.child import (
    ABSOLUTE_FLOOR,
    GLOBAL_BATCH,
    RELATIVE_TOLERANCE,
    RESUME_SPLIT,
    RESUME_STEPS,
    SEED,
    ChildFailed,
    failed_in_child,
    kill,
    ready,
    spawn,
    wait_all,
)
from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.report import Outcome, failed, passed

MIRRORED_STEPS = 3
REPLICAS = 2
MODULE = "jobs.checks.keras_processes"
LAYER_SHAPES = ((6, 8), (8,), (8, 3), (3,))


# -- the tiny problem every side of a comparison runs -------------------------------------------------


def keras_module(style: str) -> Any:
    # Legacy optimizers need tf_keras models (tf.Variables); tf_keras imports in any process.
    if style == "tf_legacy":
        import tf_keras

        return tf_keras
    import keras

    return keras


def tiny_model(style: str) -> Any:
    """Dense(8, tanh) -> Dense(3) with fixed initial weights (no global seed touched).

    dtype float32 explicitly: a mixed-precision policy left behind must not change the maths.
    """
    km = keras_module(style)
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


def build(context: CheckContext, overrides: Mapping[str, Any]) -> tuple[Any, Any]:
    model = tiny_model(context.target.style)
    optimizer = context.build(**overrides)
    create_variables(optimizer, model.trainable_variables, context.target.style)
    return model, optimizer


def create_variables(optimizer: Any, variables: Sequence[Any], style: str) -> None:
    """Create the optimizer's variables now, so a checkpoint restores into them (not lazily)."""
    if style == "keras":
        optimizer.build(variables)
    else:
        optimizer._create_all_weights(variables)  # the legacy API's only way to make slots up front


def apply(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], style: str) -> None:
    if style == "keras":
        optimizer.apply(grads, variables)
    else:
        optimizer.apply_gradients(zip(grads, variables, strict=True))


def train(model: Any, optimizer: Any, steps: range, style: str) -> None:
    import tensorflow as tf

    variables = model.trainable_variables
    for step in steps:
        x, y = batch(step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        apply(optimizer, tape.gradient(loss, variables), variables, style)


def optimizer_variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # legacy: a method


def variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def snapshot(model: Any, optimizer: Any) -> dict[str, list[np.ndarray]]:
    return {
        "model": [np.array(w) for w in model.get_weights()],
        "optimizer": [np.array(v.numpy()) for v in optimizer_variables(optimizer)],
    }


# -- resume_exact --------------------------------------------------------------------------------------


def resume_exact(ctx: CheckContext) -> Outcome:
    import tensorflow as tf

    style = ctx.target.style
    overrides = ctx.stateful_overrides()
    prefix, go, final = (
        ctx.workdir / "resume-ckpt",
        ctx.workdir / "resume-go",
        ctx.workdir / "resume-final.npz",
    )
    task = _task(ctx, "resume", overrides, checkpoint=str(prefix), out=str(final), wait_for=str(go))
    # Started first: the child's TensorFlow import overlaps the runs here.
    child = spawn("resume", {**task, **_determinism()}, ctx.workdir, legacy_keras=style == "tf_legacy")
    try:
        model, optimizer = build(ctx, overrides)
        train(model, optimizer, range(RESUME_STEPS), style)
        straight = snapshot(model, optimizer)
        names = [variable_name(v) for v in optimizer_variables(optimizer)]
        model, optimizer = build(ctx, overrides)
        train(model, optimizer, range(RESUME_SPLIT), style)
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(prefix))
        ready(go)
        wait_all([child])
    except ChildFailed as exc:
        fix = (
            "create all state in build() (legacy: _create_slots) so a fresh process restores it before its "
            "first step; the error above says what went wrong"
        )
        return failed_in_child(exc, "the resumed run", where=ctx.where(), fix=fix)
    finally:
        kill(child)
    resumed = _load(final)
    rest = RESUME_STEPS - RESUME_SPLIT
    steps = (
        f"{RESUME_STEPS} steps straight vs {RESUME_SPLIT} + tf.train.Checkpoint + {rest} in a fresh process"
    )
    difference, figure = _first_difference(straight, resumed, names, exact=True)
    if not difference:
        return passed(f"{steps}: model and optimizer variables bitwise equal{overrides_note(overrides)}", 0.0)
    return failed(
        f"{steps} differ: {difference}",
        where=ctx.where(),
        fix="keep all state in variables made with add_variable / add_slot (never in a class attribute, "
        "module global or other Python attribute), so the checkpoint saves it",
        figure=figure,
    )


def _determinism() -> dict[str, Any]:
    """This process's settings that decide how sums are ordered; the child copies them."""
    import tensorflow as tf
    from tensorflow.python.framework import config  # the query has no public name

    return {
        "op_determinism": bool(config.is_op_determinism_enabled()),
        "intra_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_threads": tf.config.threading.get_inter_op_parallelism_threads(),
    }


def _resume_in_child(task: Mapping[str, Any], context: CheckContext) -> None:
    import tensorflow as tf

    style = context.target.style
    model, optimizer = build(context, task["overrides"])
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(task["checkpoint"])
    try:
        status.assert_consumed()
    except AssertionError as exc:
        raise RuntimeError(
            "tf.train.Checkpoint: saved values found no variable in a freshly built optimizer "
            f"(state created outside build / _create_slots?): {' '.join(str(exc).split())[:200]}"
        ) from None
    train(model, optimizer, range(RESUME_SPLIT, RESUME_STEPS), style)
    _save(task["out"], snapshot(model, optimizer))


# -- distributed ---------------------------------------------------------------------------------------


def distributed(ctx: CheckContext) -> Outcome:
    overrides = ctx.stateful_overrides()
    out = ctx.workdir / "mirrored.npz"
    task = _task(ctx, "mirrored", overrides, out=str(out), **_determinism())
    try:
        wait_all([spawn("mirrored", task, ctx.workdir, legacy_keras=ctx.target.style == "tf_legacy")])
    except ChildFailed as exc:
        fix = (
            "create every variable in build() (add_variable_from_reference; legacy: _create_slots), never "
            "lazily in the update, which runs per replica under a strategy"
        )
        return failed_in_child(exc, f"MirroredStrategy with {REPLICAS} replicas", where=ctx.where(), fix=fix)
    runs = _load(out)
    report = json.loads(Path(f"{out}.json").read_text())
    if report["problem"]:
        return failed(
            f"under MirroredStrategy ({REPLICAS} replicas): {report['problem']}",
            where=ctx.where(),
            fix="create every slot in build() with add_variable_from_reference (legacy: _create_slots with "
            "add_slot), so the strategy mirrors it on each replica",
        )
    mirrored = {"model": runs["model"], "optimizer": runs["optimizer"]}
    for replica in range(1, REPLICAS):
        copy = {"model": runs[f"replica{replica}_model"], "optimizer": runs[f"replica{replica}_optimizer"]}
        apart, spread = _first_difference(mirrored, copy, report["names"], exact=True)
        if apart:
            return failed(
                f"under MirroredStrategy replica {replica} holds other values than replica 0 ({apart})",
                where=ctx.where(),
                fix="update only through the variable passed to update_step and its slots, so every replica "
                "takes the same step",
                figure=spread,
            )
    reference = {"model": runs["single_model"], "optimizer": runs["single_optimizer"]}
    far, figure = _first_difference(
        reference, mirrored, report["names"], exact=False, initial=runs["initial_model"]
    )
    if far:
        return failed(
            f"MirroredStrategy ({REPLICAS} replicas, half the batch each) differs from one device on the "
            f"full batch beyond rounding: {far}",
            where=ctx.where(),
            fix="compute statistics of the gradient (norms, clipping, normalisation) in update_step or after "
            "aggregation, not on each replica's local gradient in apply()/apply_gradients()",
            figure=figure,
        )
    return passed(
        f"MirroredStrategy with {REPLICAS} replicas equals one device on the full batch after "
        f"{MIRRORED_STEPS} steps: {len(report['names'])} optimizer variable(s), all mirrored, replicas "
        f"bitwise equal, max abs difference to one device {figure:.2g} (rounding){overrides_note(overrides)}",
        figure,
    )


def _mirrored_in_child(task: Mapping[str, Any], context: CheckContext) -> None:
    import tensorflow as tf

    style = context.target.style
    # A first step in this process before either run, as every in-process check has: a value
    # an optimizer caches per process (resume_exact's concern) then cannot tell the runs apart.
    model, optimizer = build(context, task["overrides"])
    train(model, optimizer, range(1), style)

    model, optimizer = build(context, task["overrides"])
    initial = [np.array(w) for w in model.get_weights()]
    train(model, optimizer, range(MIRRORED_STEPS), style)
    single = snapshot(model, optimizer)

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        model, optimizer = build(context, task["overrides"])
    _train_mirrored(strategy, model, optimizer, style)
    variables = optimizer_variables(optimizer)
    problem = _unmirrored(variables, len(single["optimizer"]))
    mirrored = snapshot(model, optimizer) if not problem else {"model": [], "optimizer": []}
    arrays: dict[str, list[np.ndarray]] = {
        **mirrored,
        "single_model": single["model"],
        "single_optimizer": single["optimizer"],
        "initial_model": initial,
    }
    if not problem:
        for replica in range(1, REPLICAS):
            arrays[f"replica{replica}_model"] = [_component(v, replica) for v in model.trainable_variables]
            arrays[f"replica{replica}_optimizer"] = [_component(v, replica) for v in variables]
    _save(task["out"], arrays)
    Path(f"{task['out']}.json").write_text(
        json.dumps({"problem": problem, "names": [variable_name(v) for v in variables]})
    )


def _train_mirrored(strategy: Any, model: Any, optimizer: Any, style: str) -> None:
    import tensorflow as tf

    variables = model.trainable_variables
    share = GLOBAL_BATCH // REPLICAS
    scale = float(GLOBAL_BATCH * 3)  # each replica's share of the full-batch mean

    def replica_step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / scale
        apply(optimizer, tape.gradient(loss, variables), variables, style)  # the optimizer sums replicas

    for step in range(MIRRORED_STEPS):
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
    value = _distributed_value(variable)
    return np.array(value.values[replica].numpy())


def _unmirrored(variables: Sequence[Any], expected: int) -> str:
    """Why the optimizer's variables under the strategy are not what one device had, or ''."""
    if len(variables) != expected:
        return f"{len(variables)} optimizer variables were created, not the {expected} one device has"
    plain = [variable_name(v) for v in variables if _distributed_value(v) is None]
    if plain:
        return f"optimizer variables {plain[:3]} are not mirrored: each replica does not hold its own copy"
    return ""


# -- children and comparisons --------------------------------------------------------------------------


def _task(ctx: CheckContext, role: str, overrides: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "module": MODULE,
        "role": role,
        "target": ctx.target.text,
        "style": ctx.target.style,
        "params": ctx.params,
        "workdir": str(ctx.workdir),
        "overrides": dict(overrides),
        **extra,
    }


def prepare_child(task: Mapping[str, Any]) -> None:
    """Before anything starts TensorFlow's runtime: devices, threads, determinism as the parent's."""
    _import_without_sklearn("tensorflow", "keras" if task["style"] == "keras" else "tf_keras")
    import tensorflow as tf

    if task["role"] == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    if task["intra_threads"]:
        tf.config.threading.set_intra_op_parallelism_threads(task["intra_threads"])
    if task["inter_threads"]:
        tf.config.threading.set_inter_op_parallelism_threads(task["inter_threads"])
    if task["op_determinism"]:
        tf.config.experimental.enable_op_determinism()


def _import_without_sklearn(*modules: str) -> None:
    """Importing TensorFlow and Keras spends over a second importing scikit-learn for Keras's
    SKLearn wrappers, which no check uses: hide it during these imports only (Keras then
    leaves the wrappers out), so a user's module can still import it afterwards."""
    hidden = "sklearn" not in sys.modules
    if hidden:
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # makes `import sklearn` fail
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        if hidden:
            del sys.modules["sklearn"]


def run_child(task: Mapping[str, Any], context: CheckContext) -> None:
    roles = {"resume": _resume_in_child, "mirrored": _mirrored_in_child}
    roles[task["role"]](task, context)


def _save(path: str, arrays: Mapping[str, list[np.ndarray]]) -> None:
    flat: dict[str, Any] = {
        f"{key}__{index}": value for key, values in arrays.items() for index, value in enumerate(values)
    }
    flat["__counts__"] = np.array(json.dumps({key: len(values) for key, values in arrays.items()}))
    np.savez(path, **flat)


def _load(path: Path) -> dict[str, list[np.ndarray]]:
    with np.load(path) as data:
        counts = json.loads(str(data["__counts__"]))
        return {key: [data[f"{key}__{i}"] for i in range(n)] for key, n in counts.items()}


def _first_difference(
    expected: Mapping[str, list[np.ndarray]],
    actual: Mapping[str, list[np.ndarray]],
    names: Sequence[str],
    *,
    exact: bool,
    initial: Sequence[np.ndarray] | None = None,
) -> tuple[str, float]:
    """The first difference ('' if none: bitwise, or within rounding) and the max abs difference."""
    found, largest = "", 0.0
    for part in ("model", "optimizer"):
        want, got = expected[part], actual[part]
        if len(want) != len(got):
            return f"{len(got)} {part} variables instead of {len(want)}", float("inf")
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            label = f"model weight {index}" if part == "model" else f"optimizer variable {names[index]!r}"
            if a.shape != b.shape:
                return f"{label} has shape {list(b.shape)} instead of {list(a.shape)}", float("inf")
            diff = float(np.max(np.abs(a.astype("float64") - b.astype("float64")), initial=0.0))
            largest = max(largest, diff)
            if found:
                continue
            if exact and not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                found = f"{label}: max abs difference {diff:.3g}"
            elif not exact and not diff <= _allowed(
                a, initial[index] if initial and part == "model" else None
            ):
                found = f"{label}: max abs difference {diff:.3g}"
    return found, largest


def _allowed(reference: np.ndarray, start: np.ndarray | None) -> float:
    scale = float(np.max(np.abs(reference), initial=0.0))
    if start is None:  # optimizer state: relative to its own magnitude
        return RELATIVE_TOLERANCE * scale + ABSOLUTE_FLOOR
    movement = float(np.max(np.abs(reference - start), initial=0.0))
    return RELATIVE_TOLERANCE * movement + ABSOLUTE_FLOOR * (1 + scale)
