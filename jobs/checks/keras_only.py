"""The checks only Keras has, for Keras 3 (`keras`) and legacy tf.keras (`tf_legacy`):
save_load_model, graph_mode (tf.function, XLA), mixed_precision.

Every check that means the same in all frameworks is in the tables of `jobs.checks.common`, written
once over the drivers; what the two Keras styles do differently here (whole-model
formats, loss scaling, registration) the Keras drivers say. The steps run eagerly unless
the check is about compilation, so a graph-only fault fails only `graph_mode`.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.rate_checks import POSITIVE_SCHEDULE_FACTORS, TABLE_SHAPE
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.tools import (
    SHAPES,
    arrays,
    draws_randomly,
    fresh,
    inconclusive_random,
    isolated,
    made_non_finite,
    max_diff,
    method_location,
    non_finite,
    non_finite_update,
    own_code,
    raised_in,
    same_draws,
    same_value,
    shape_text,
    updates_nothing,
    user_line,
)
from jobs.frameworks.base import SparseRows, known_fix
from jobs.frameworks.keras_driver import (
    OP_SEEDED_RANDOM_OPS,
    XLA_FIX,
    XLA_ONLY_FAILURE,
    KerasDriver,
    applies_per_update,
    config_fix,
    names_an_unknown_class,
    optimizer_variables_of,
    plain_config,
    tracked_outside,
    xla_cannot_compile,
)

# Closeness of two computations that should agree up to float32 rounding (graph rewrites);
# XLA fuses and reorders more, so it gets a looser bound.
RTOL, ATOL = 1e-5, 1e-6
XLA_RTOL, XLA_ATOL = 1e-4, 1e-5


def _kit(ctx: CheckContext) -> KerasDriver:
    driver = ctx.driver
    assert isinstance(driver, KerasDriver), "the Keras checks run only with a Keras driver"
    return driver


def _made_non_finite(
    ctx: CheckContext, shapes: Sequence[tuple[int, ...]], *sides: list[np.ndarray]
) -> list[str]:
    """`made_non_finite` over runs of `_run_steps` or `_run_sparse_steps` on variables of `shapes`
    (their values, then the optimizer state, in the same order each run), against the same build
    before any step; said as 'variable (4, 3)' or the state's name."""
    if not all(any(non_finite(value) for value in side) for side in sides):
        return []  # nothing to judge: no second build
    kit = _kit(ctx)
    with same_draws(ctx, seed=GRAPH_DRAWS), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as the runs judged are built
        optimizer, variables = fresh(ctx, shapes, **ctx.stateful_overrides())
        names = [f"variable {shape_text(tuple(shape))}" for shape in shapes] + [
            n for n, _ in kit.state(optimizer)
        ]
        start = kit.values(variables) + [value for _, value in kit.state(optimizer)]
    found = made_non_finite(dict(enumerate(start)), *(dict(enumerate(side)) for side in sides))
    return [names[i] for i in found]


def _all_close(a: Sequence[np.ndarray], b: Sequence[np.ndarray], rtol: float, atol: float) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        for x, y in zip(a, b, strict=True)
    )


# A terminal's colour and weight codes (`\x1b[1m`), which Keras writes into some error messages.
_TERMINAL_STYLE = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(error: BaseException, ctx: CheckContext) -> str:
    """The error in one line; for an autograph error (which quotes the traced code first, the
    user's line included) its last line, where the actual complaint is."""
    text = _TERMINAL_STYLE.sub("", str(error))  # Keras sets "in user code:" in bold
    if "in user code:" in text:
        # Keras ends an error raised inside a layer or op of its own (LossScaleOptimizer's Cond) with the
        # arguments that received it ("Arguments received by Cond.call(): • kwargs=..."): not the error.
        text = text.split("\nArguments received by ", 1)[0]
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        last = lines[-1][:300]
        return last if last.startswith(type(error).__name__) else f"{type(error).__name__}: {last}"
    return ctx.describe_error(error)


@contextmanager
def _quiet() -> Iterator[None]:
    """Framework chatter that is expected in a check (h5 is legacy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- save_load_model -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reload:
    """What a whole-model save and load brought back of an optimizer."""

    error: BaseException | None = None
    cls: type | None = None
    config_keys: tuple[str, ...] = ()  # keys whose values differ after the reload
    iterations: tuple[int, int] = (0, 0)  # saved, reloaded
    variables: tuple[int, int] = (0, 0)  # saved, reloaded count
    variable_diff: float = 0.0

    @property
    def lost_state(self) -> bool:
        return (
            self.iterations[1] != self.iterations[0]
            or self.variables[1] != self.variables[0]
            or self.variable_diff > 0
        )

    def state_text(self) -> str:
        return (
            f"iterations {self.iterations[1]} (saved {self.iterations[0]}), {self.variables[1]} of "
            f"{self.variables[0]} optimizer variables"
            + (f", values off by up to {self.variable_diff:.3g}" if self.variable_diff > 0 else "")
        )


def check_save_load_model(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    formats = kit.whole_model_formats
    untracked = _state_outside_variables(ctx)
    if untracked:
        return failed(
            f"{untracked} tf.Variable(s) the optimizer tracks are not among optimizer.variables, so a "
            "whole-model save (which writes optimizer.variables) drops them",
            where=ctx.target.class_location(),
            fix="create state with self.add_variable / add_optimizer_variables, not tf.Variable",
            figure=float(untracked),
        )
    stateful = ctx.stateful_overrides()
    format_warnings: list[str] = []
    for suffix in formats:
        user = _whole_model_reload(kit, lambda: ctx.build(**stateful), ctx.workdir / f"user{suffix}")
        judged = _judge_reload(ctx, kit, suffix, user)
        if isinstance(judged, Outcome):
            return judged
        if judged is not None:
            format_warnings.append(judged)
    names = " and ".join(formats)
    if format_warnings:
        return warned(
            " ".join(format_warnings),
            where=ctx.target.class_location(),
            fix="save the whole model as h5, or resume from a tf.train.Checkpoint(model=..., optimizer=...) "
            "which keeps every optimizer variable",
        )
    return passed(
        f"model.save({names}) and load_model without custom_objects brought back the same class, config, "
        "iterations and optimizer variables" + overrides_note(stateful)
    )


def _judge_reload(ctx: CheckContext, kit: KerasDriver, suffix: str, user: _Reload) -> Outcome | str | None:
    """None when the reload is complete; a `fail` for the class's faults; what the format loses
    when the framework's SGD loses the same through it (for a `warn`)."""
    cls = ctx.target.cls
    if user.error is not None:
        message = str(user.error)
        not_found = names_an_unknown_class(message)
        return failed(
            f"load_model of a {suffix} model compiled with it raised {_first_line(user.error, ctx)}",
            where=ctx.target.class_location() if not_found else user_line(ctx, user.error),
            fix=(
                f"decorate the class with @{kit.serializable_decorator}(package=...) so load_model finds it "
                "by name"
                if not_found
                else config_fix(user.error, "get_config must return exactly what the constructor accepts")
            ),
        )
    if user.cls is not cls:
        return failed(
            f"the {suffix} model's optimizer came back as {getattr(user.cls, '__name__', user.cls)}, "
            f"not {cls.__name__}",
            where=ctx.target.class_location(),
            fix="register the class under its own name with register_keras_serializable",
        )
    if user.config_keys:
        return failed(
            f"after a {suffix} save and load the optimizer config differs in {list(user.config_keys)}",
            where=ctx.target.class_location(),
            fix="get_config must return every constructor argument and from_config must restore it",
        )
    if not user.lost_state:
        return None
    reference = _whole_model_reload(kit, kit.plain_reference_sgd, ctx.workdir / f"reference{suffix}")
    if reference.error is None and reference.lost_state:
        return (
            f"{suffix}: the format itself reloads the optimizer without its state ({user.state_text()}); "
            f"the framework's SGD(momentum=0.9) loses the same ({reference.state_text()})."
        )
    return failed(
        f"after a {suffix} save and load the optimizer came back with {user.state_text()}, while the "
        "framework's SGD keeps its state through the same format",
        where=ctx.target.class_location(),
        fix=f"{kit.advice.state_in_checkpoint}, in a fixed order, so a loaded model's optimizer can receive "
        "the saved values",
    )


def _whole_model_reload(kit: KerasDriver, build: Callable[[], Any], path: Any) -> _Reload:
    model = kit.tiny_model(seed=50)
    optimizer = build()
    model.compile(optimizer=optimizer, loss="mse")
    variables = model.trainable_variables
    kit.create_state(optimizer, variables)
    x = kit.tf.constant(arrays([(8, 4)], seed=51)[0])
    with kit.tf.GradientTape() as tape:
        loss = kit.tf.reduce_mean(kit.tf.square(model(x)))
    grads = tape.gradient(loss, variables)
    for _ in range(applies_per_update(optimizer)):  # one update, so its state has values to compare
        kit.apply(optimizer, grads, variables)
    try:
        with _quiet():
            model.save(path)
            loaded = kit.km.models.load_model(path).optimizer
    except Exception as exc:
        return _Reload(error=exc)
    saved_config, loaded_config = plain_config(optimizer), plain_config(loaded)
    differing = tuple(
        sorted(
            k
            for k in saved_config.keys() | loaded_config.keys()
            if not same_value(saved_config.get(k), loaded_config.get(k))
        )
    )
    saved_state = [value for _, value in kit.state(optimizer)]
    loaded_state = [value for _, value in kit.state(loaded)]
    diff = max_diff(saved_state, loaded_state) if len(saved_state) == len(loaded_state) else 0.0
    return _Reload(
        cls=type(loaded),
        config_keys=differing,
        iterations=(int(optimizer.iterations), int(loaded.iterations)),
        variables=(len(saved_state), len(loaded_state)),
        variable_diff=diff,
    )


def _state_outside_variables(ctx: CheckContext) -> int:
    """tf.Variables reachable from the optimizer as a checkpoint sees it, but neither in
    optimizer.variables nor among the variables it trains (`tracked_outside`): what
    tf.train.Checkpoint saves and a whole-model file does not."""
    optimizer, variables = fresh(ctx)
    return len(tracked_outside(_kit(ctx).tf, optimizer, variables))


# -- graph_mode ---------------------------------------------------------------------------------------------

GRAPH_STEPS = 3


# The seed every compared run of graph_mode draws from (each run seeded alike).
GRAPH_DRAWS = 11


@isolated
def check_graph_mode(ctx: CheckContext) -> Outcome:
    grads = [arrays(SHAPES, seed=60 + step) for step in range(GRAPH_STEPS)]
    try:
        eager = _run_steps(ctx, grads, compile_with=None)
    except Exception:
        return skipped("not meaningful: the eager step itself raises (see dense_step)")
    try:
        graph = _run_steps(ctx, grads, compile_with=False)
    except Exception as exc:
        return failed(
            f"the update works eagerly but not inside tf.function: {_first_line(exc, ctx)}",
            where=user_line(ctx, exc),
            fix=known_fix(exc)
            or "use tensor ops (tf.where, tf.cond, ops.where) instead of Python if/while on tensor values, "
            "and no .numpy(), float(tensor) or .item() in the update",
        )
    unbounded = _made_non_finite(ctx, SHAPES, eager, graph)
    if unbounded:
        return non_finite_update(
            ctx,
            f"{GRAPH_STEPS} steps eagerly and under tf.function both end with non-finite values",
            unbounded,
            regardless="whatever this check changes",
        )
    diff = max_diff(eager, graph)
    # TensorFlow gives a random op traced in a function other op seeds than the same op run eagerly, so
    # a class that draws by design (SGLD's tf.random.normal) differs there whatever it does: only what
    # raises when traced can be judged then.
    random_graph = not _all_close(eager, graph, RTOL, ATOL) and draws_randomly(ctx)
    if not random_graph and not _all_close(eager, graph, RTOL, ATOL):
        return failed(
            f"{GRAPH_STEPS} steps under tf.function differ from the eager ones by up to {diff:.3g}: Python "
            "state (a counter, a cached value) is frozen when the function is traced",
            where=ctx.target.class_location(),
            fix="keep anything that changes between steps in optimizer variables (self.iterations, "
            "add_variable), not in Python attributes",
            figure=diff,
        )
    frozen = _draws_only_when_traced(ctx) if random_graph else _frozen_schedule(ctx, grads)
    if frozen is not None:
        return frozen
    # Before XLA: a warn of XLA's would otherwise hide a sparse fault, which is a fail.
    sparse = _sparse_graph_fault(ctx, compare=not random_graph)
    if sparse is not None:
        return sparse
    try:
        xla = _run_steps(ctx, grads, compile_with=True)
    except Exception as exc:
        return warned(
            f"the update {XLA_ONLY_FAILURE}: {xla_cannot_compile(exc) or _first_line(exc, ctx)}; "
            "jobs with jit_compile will fail",
            where=user_line(ctx, exc),
            fix=XLA_FIX,
        )
    if random_graph:
        return skipped(
            inconclusive_random("comparing steps under tf.function and XLA with eager ones")
            + " (TensorFlow gives a traced random op other seeds than an eager one); the update traces and "
            "compiles without error"
        )
    xla_diff = max_diff(eager, xla)
    if not _all_close(eager, xla, XLA_RTOL, XLA_ATOL):
        drawn = _random_ops(ctx)
        if drawn:  # XLA's random number generators are not TensorFlow's kernels, stateless ones included
            return skipped(
                f"inconclusive under XLA: the class draws random numbers in its steps ({', '.join(drawn)}), "
                "and XLA generates them otherwise than TensorFlow's kernels, whatever the seed, so steps "
                f"with jit_compile=True differ from eager by up to {xla_diff:.3g} by design; {GRAPH_STEPS} "
                f"steps under tf.function match the eager ones (max abs difference {diff:.3g})"
            )
        return warned(
            f"with jit_compile=True (XLA) {GRAPH_STEPS} steps differ from eager by up to {xla_diff:.3g}, "
            "more "
            "than float32 reordering explains",
            where=ctx.target.class_location(),
            fix="look for ops whose XLA lowering differs (random ops, reductions over huge ranges)",
            figure=xla_diff,
        )
    return passed(
        f"{GRAPH_STEPS} steps under tf.function and with jit_compile=True match the eager ones",
        figure=max(diff, xla_diff),
    )


def _frozen_schedule(ctx: CheckContext, grads: Sequence[Sequence[Any]]) -> Outcome | None:
    """The same steps eagerly and under tf.function, with a schedule whose rate changes every step.
    A rate read in Python code that runs only when traced (a legacy `_create_slots` caching
    `_decayed_lr`, which runs under init_scope at every eager call but once in a function) follows the
    schedule eagerly, where `schedule` steps, and is frozen in every `fit` job. None where they match,
    where the class takes no rate, or where a schedule makes it raise (`schedule` judges that)."""
    if not ctx.has_lr:
        return None
    rates = [ctx.lr * factor for factor in POSITIVE_SCHEDULE_FACTORS[: len(grads)]]
    try:
        eager = _run_steps(ctx, grads, compile_with=None, rates=rates)
        graph = _run_steps(ctx, grads, compile_with=False, rates=rates)
    except Exception:
        return None
    if _all_close(eager, graph, RTOL, ATOL) or any(non_finite(value) for value in eager + graph):
        return None
    diff = max_diff(eager, graph)
    shown = [round(rate, 8) for rate in rates]
    return failed(
        f"with a LearningRateSchedule of rates {shown}, {GRAPH_STEPS} steps under tf.function (every fit "
        f"job) differ from the eager ones by up to {diff:.3g}, though at a constant rate they match: the "
        "schedule's rate is read at trace time, so Python state frozen when the function is traced keeps "
        "the first step's rate for the whole job",
        where=ctx.target.class_location(),
        fix=f"{_kit(ctx).advice.read_lr_each_step}; a value computed in _create_slots, build or any code "
        "that runs eagerly (init_scope) is computed once when traced",
        figure=diff,
    )


def _random_ops(ctx: CheckContext) -> list[str]:
    """The random ops a traced step runs (functions it calls included), stateless ones too."""
    return sorted(op for op in _traced_op_types(ctx) if _is_random(op))


def _is_random(op: str) -> bool:
    return op in OP_SEEDED_RANDOM_OPS or "Random" in op or op.startswith(("Rng", "Stateful"))


def _traced_op_types(ctx: CheckContext) -> set[str]:
    """The op types of a traced step, those of the functions it calls included."""
    kit = _kit(ctx)
    optimizer, variables = fresh(ctx, **ctx.stateful_overrides())
    grads = kit.gradient_tensors(arrays(SHAPES, seed=60))
    step = kit.tf.function(lambda step_grads: kit.apply(optimizer, step_grads, variables))
    graph = step.get_concrete_function(grads).graph
    ops = {op.type for op in graph.get_operations()}
    for function in graph.as_graph_def().library.function:
        ops.update(node.op for node in function.node_def)
    return ops


def _draws_only_when_traced(ctx: CheckContext) -> Outcome | None:
    """A class that draws random numbers in its steps (numpy's or Python's RNG moved) whose traced
    step runs no random op: numpy drew once, when the function was traced, and the graph adds those
    same numbers at every step of every `fit` job. A class drawing with TensorFlow or Keras ops has
    them in its graph, and one that calls Python each step (tf.py_function) draws anew: None."""
    try:
        ops = _traced_op_types(ctx)
    except Exception:  # the trace itself is judged by the comparison that ran it
        return None
    if any(_is_random(op) or "PyFunc" in op for op in ops):
        return None
    return failed(
        "the class draws random numbers in its steps, but its step under tf.function (every fit job) runs "
        "no random op: numpy's or Python's random drew once, when the function was traced, and the same "
        f"numbers are added at every step (its {GRAPH_STEPS} traced steps differ from the eager ones, which "
        "draw anew each call)",
        where=ctx.target.class_location(),
        fix="draw with keras.random.* (keras.random.normal(shape, seed=self.seed_generator), a "
        "keras.random.SeedGenerator made in __init__) or tf.random ops, never np.random or Python's random "
        "in the update",
    )


# Row-sparse steps on an embedding table (unique ids, then a repeated one, in batch order), as an
# Embedding's gradients come to an optimizer under `fit`'s tf.function.
# As many ids each step, so the function is traced once, as fit's is.
SPARSE_GRAPH_ROWS = ([3, 1, 7], [8, 6, 0], [5, 2, 5])


def _sparse_graph_fault(ctx: CheckContext, *, compare: bool = True) -> Outcome | None:
    """The sparse path under tf.function, where `fit` runs it: a class whose sparse update works
    eagerly (the `sparse` check's steps) but not traced (a Python `if` on a hyperparameter tensor in
    `_resource_apply_sparse_duplicate_indices`) failed every job of an Embedding model at its first
    step, with every check passed. None where it matches, or where the eager sparse step raises
    (`sparse` judges that). Without `compare` (a class whose draws a traced step cannot repeat),
    only an error when traced is judged."""
    grads = [
        SparseRows(rows=rows, values=arrays([(len(rows), TABLE_SHAPE[1])], 70 + i)[0], shape=TABLE_SHAPE)
        for i, rows in enumerate(SPARSE_GRAPH_ROWS)
    ]
    try:
        eager = _run_sparse_steps(ctx, grads, traced=False)
    except Exception:
        return None
    try:
        graph = _run_sparse_steps(ctx, grads, traced=True)
    except Exception as exc:
        return failed(
            "the update works inside tf.function on dense gradients, and eagerly on row-sparse ones "
            f"(tf.IndexedSlices, an Embedding's), but not on row-sparse ones inside tf.function, where fit "
            f"runs it: {_first_line(exc, ctx)}",
            where=user_line(ctx, exc),
            fix=known_fix(exc)
            or "use tensor ops (tf.where, tf.cond) instead of Python if/while on tensor values in the sparse "
            "path too, and no .numpy(), float(tensor) or .item() there",
        )
    unbounded = _made_non_finite(ctx, (TABLE_SHAPE,), eager, graph) if compare else []
    if unbounded:
        return non_finite_update(
            ctx,
            f"{len(grads)} row-sparse steps eagerly and under tf.function both end with non-finite values",
            unbounded,
            regardless="whatever this check changes",
        )
    if compare and not _all_close(eager, graph, RTOL, ATOL):
        return failed(
            f"{len(grads)} row-sparse steps under tf.function differ from the eager ones by up to "
            f"{max_diff(eager, graph):.3g}: Python state (a counter, a cached value) is frozen when the "
            "sparse path is traced",
            where=ctx.target.class_location(),
            fix="keep anything that changes between steps in optimizer variables, not in Python attributes",
            figure=max_diff(eager, graph),
        )
    return None


def _run_sparse_steps(ctx: CheckContext, grads: Sequence[SparseRows], *, traced: bool) -> list[np.ndarray]:
    """The table and optimizer state after row-sparse steps, eagerly or in one tf.function. The
    IndexedSlices is made inside the function with its shape a constant, as the gradient of an
    Embedding's lookup is in `fit` (the table's shape is static there)."""
    kit = _kit(ctx)
    tf = kit.tf
    # Every run seeded alike: the draws a traced run can share with an eager one (Keras's SeedGenerator)
    # are shared.
    with same_draws(ctx, seed=GRAPH_DRAWS), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the framework's notes on sparse tensors are not the user's
        optimizer, table = fresh(ctx, (TABLE_SHAPE,), **ctx.stateful_overrides())

        def step(values: Any, rows: Any) -> None:
            gradient = tf.IndexedSlices(values, rows, tf.constant(TABLE_SHAPE, dtype=tf.int64))
            kit.apply(optimizer, [gradient], table)

        run = tf.function(step) if traced else step
        for grad in grads:
            for _ in range(applies_per_update(optimizer)):  # one update each, as in _run_steps
                run(tf.constant(np.array(grad.values, np.float32)), tf.constant(grad.rows, dtype=tf.int64))
    return kit.values(table) + [value for _, value in kit.state(optimizer)]


def _run_steps(
    ctx: CheckContext,
    grads: Sequence[Sequence[Any]],
    *,
    compile_with: bool | None,
    rates: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """Variables and optimizer state after the steps: eagerly (None), tf.function, or XLA (True).
    Each step is one update: with `gradient_accumulation_steps` that many calls, each one traced
    call as `fit` makes one a batch (a fixed count of calls had compared no update at all). With
    `rates`, the optimizer is built over a schedule of them, one per update."""
    kit = _kit(ctx)
    with same_draws(ctx, seed=GRAPH_DRAWS):  # as in _run_sparse_steps
        optimizer, variables = _built_for_steps(ctx, rates)

        def step(step_grads: list[Any]) -> None:
            kit.apply(optimizer, step_grads, variables)

        run = step if compile_with is None else kit.tf.function(step, jit_compile=compile_with)
        for step_grads in grads:
            tensors = kit.gradient_tensors(step_grads)
            for _ in range(applies_per_update(optimizer)):
                run(tensors)
    return kit.values(variables) + [value for _, value in kit.state(optimizer)]


def _built_for_steps(ctx: CheckContext, rates: Sequence[float] | None) -> tuple[Any, list[Any]]:
    """A fresh optimizer for `_run_steps`: at the built rate, or over a schedule of `rates`, one per
    update, as `schedule` builds it (the driver's `scheduled`: apply() calls counted as Keras does)."""
    overrides = ctx.stateful_overrides()
    if rates is None:
        return fresh(ctx, **overrides)
    kit = _kit(ctx)
    variables = kit.variables(arrays(SHAPES, 0, mean=1.0))

    def create(params: Any, learning_rate: Any) -> Any:
        return ctx.build(params, learning_rate=learning_rate, **overrides)

    optimizer, _ = kit.scheduled(create, variables, rates, ctx.target.entry.lr_arg)
    return optimizer, variables


# -- mixed_precision ----------------------------------------------------------------------------------------


def check_mixed_precision(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    with _global_policy(kit, "mixed_float16"):
        model = kit.tiny_model(seed=80, hidden=8)
        before = [np.array(w) for w in model.get_weights()]
        inner = ctx.build()
        try:
            scales = _mixed_precision_steps(kit, model, inner)
        except Exception as exc:
            return failed(
                f"training under a mixed_float16 policy with {kit.loss_scale_name} raised "
                f"{_first_line(exc, ctx)}",
                where=user_line(ctx, exc),
                fix="keep the update dtype-generic (cast to variable.dtype, not a fixed float32/float16) and "
                "keep the base class's apply/apply_gradients signature",
            )
        after = model.get_weights()
    if not all(np.all(np.isfinite(w)) for w in after):
        float32 = _float32_weights(ctx)
        unbounded = made_non_finite(dict(enumerate(before)), dict(enumerate(after)), dict(enumerate(float32)))
        if unbounded:
            return non_finite_update(
                ctx,
                f"weights became non-finite under mixed_float16 with {kit.loss_scale_name}, and in float32 "
                "without mixed precision too",
                [f"weight {i} {shape_text(before[i].shape)}" for i in unbounded],
                regardless="whatever the dtype",
            )
        return failed(
            f"weights became non-finite under mixed_float16 with {kit.loss_scale_name}",
            where=ctx.target.class_location(),
            fix="compute the update in the variable's dtype (float32 here) and let the loss scale handle "
            "float16 gradients",
        )
    if not updates_nothing(ctx) and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)):
        return failed(
            f"{len(scales)} steps under mixed_float16 with {kit.loss_scale_name} changed no weight "
            f"(loss scales {scales})",
            where=ctx.target.class_location(),
            fix="the wrapped optimizer must apply the unscaled gradients it is given",
        )
    half, dtypes = _half_precision_state(inner, model.trainable_variables)
    if half:
        return warned(
            f"{len(scales)} steps under a mixed_float16 policy with {kit.loss_scale_name} are finite and "
            f"update the weights, but the optimizer keeps {half} while the variables they belong to are "
            f"float32: {'; '.join(_HALF_PRECISION_COST[dtype] for dtype in dtypes)}, where Keras's own "
            "optimizers keep each slot in its variable's dtype",
            where=method_location(ctx, "build"),
            fix="create each slot in its variable's dtype (add_variable_from_reference(variable, name), or "
            "add_variable(shape, dtype=variable.dtype)), not in the policy's compute dtype"
            + (
                "; if bfloat16 state is meant to save memory, this is the precision it costs"
                if "bfloat16" in dtypes
                else ""
            ),
        )
    uncast = _bfloat16_fault(ctx)
    if uncast is not None:
        return uncast
    return passed(
        f"{len(scales)} steps under a mixed_float16 policy with {kit.loss_scale_name}: finite, weights "
        "updated",
        figure=scales[-1] if scales else None,
    )


def _bfloat16_fault(ctx: CheckContext) -> Outcome | None:
    """One step on bfloat16 variables (a model under a "bfloat16" policy, or built in half precision),
    which mixed_float16 never gives the optimizer (its variables stay float32): a rate never cast to the
    variable's dtype raises there in the class's own line. Keras 3 only; judged only where Keras's
    own SGD steps the same variables, and not for a deliberate `raise` of the class's."""
    kit = _kit(ctx)
    if kit.style != "keras":
        return None
    try:
        _bfloat16_step(ctx, lambda: kit.plain_reference_sgd())
    except Exception:  # the framework itself cannot: nothing to ask of the class
        return None
    try:
        _bfloat16_step(ctx, lambda: ctx.build(**ctx.stateful_overrides()))
    except Exception as exc:
        message = str(exc)
        if ctx.user_frame(exc) is None or raised_in(exc, own_code(ctx), by="raise"):
            return None
        if "bfloat16" not in message or not _MIXED_DTYPES.search(message):
            return None  # not two dtypes mixed (a kernel with no bfloat16 version, as eigh has)
        return failed(
            f"one step on bfloat16 variables (a model under a 'bfloat16' policy, or built in half precision) "
            f"raised {_first_line(exc, ctx)}, while Keras's own SGD steps the same variables; mixed_float16 "
            "keeps the variables float32, so only this shows it",
            where=user_line(ctx, exc),
            fix="cast every float the update mixes with the variable to its dtype "
            "(ops.cast(learning_rate, variable.dtype), and the same for a hyperparameter or state of another "
            "dtype)",
        )
    return None


# TensorFlow's words for an op given two dtypes: eagerly, and when traced.
_MIXED_DTYPES = re.compile(
    r"expected to be a \w+ tensor but is a \w+ tensor|has type \w+ that does not match type"
)


def _bfloat16_step(ctx: CheckContext, build: Callable[[], Any]) -> None:
    """One update of the optimizer `build` makes, over bfloat16 variables with bfloat16 gradients."""
    kit = _kit(ctx)
    values = arrays(SHAPES, seed=85, mean=1.0)
    variables = [kit.km.Variable(value, dtype="bfloat16") for value in values]
    optimizer = kit.optimizer_over(lambda _: build(), variables)
    grads = [kit.tf.constant(value, dtype=kit.tf.bfloat16) for value in arrays(SHAPES, seed=86)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(applies_per_update(optimizer)):
            kit.apply(optimizer, grads, variables)


# What a slot kept in a 16-bit float costs, by dtype: float16 narrows both range and precision,
# bfloat16 keeps float32's range and loses only precision ("small contributions vanish" had been said
# of both).
_HALF_PRECISION_COST = {
    "float16": "float16 state is rounded to 11 significant bits every step and flushes values below "
    "6e-8 to zero (a momentum's small contributions vanish)",
    "bfloat16": "bfloat16 state keeps float32's range but is rounded to 8 significant bits every step "
    "(a change under 1/256 of the value it is added to is lost: precision, not range)",
}


def _half_precision_state(optimizer: Any, variables: Sequence[Any]) -> tuple[str, list[str]]:
    """The optimizer's float16/bfloat16 state of the shape of a float32 variable it trains (a slot
    made in the policy's compute dtype), said by name and count ('' where none), and those dtypes."""
    shapes = {tuple(v.shape) for v in variables if str(getattr(v.dtype, "name", v.dtype)) == "float32"}
    found: dict[tuple[str, str], int] = {}
    for state in optimizer_variables_of(optimizer):
        dtype = str(getattr(state.dtype, "name", state.dtype))
        shape = tuple(state.shape)
        if dtype in _HALF_PRECISION_COST and shape and shape in shapes:
            name = str(getattr(state, "path", None) or state.name).rsplit("/", 1)[-1].split(":", 1)[0]
            found[(name, dtype)] = found.get((name, dtype), 0) + 1
    said = ", ".join(
        f"{name!r} in {dtype} ({count} variable{'s' if count > 1 else ''})"
        for (name, dtype), count in found.items()
    )
    return said, sorted({dtype for _, dtype in found})


MIXED_PRECISION_STEPS = 3


def _float32_weights(ctx: CheckContext) -> list[np.ndarray]:
    """The weights after the same steps under the float32 policy (none where they raise, which is not
    what the mixed-precision fail is about): where they are non-finite too, float16 is not the cause
    (the dtype advice would mislead), the update is."""
    kit = _kit(ctx)
    with _global_policy(kit, "float32"):
        try:
            model = kit.tiny_model(seed=80, hidden=8)
            _mixed_precision_steps(kit, model, ctx.build())
            return [np.array(w) for w in model.get_weights()]
        except Exception:  # raising in float32 is not what the mixed-precision fail is about
            return []


@contextlib.contextmanager
def _global_policy(kit: KerasDriver, name: str) -> Iterator[None]:
    """Keras's global dtype policy set to `name` for the block, and the one before put back."""
    mixed = kit.km.mixed_precision
    previous = mixed.global_policy()
    try:
        mixed.set_global_policy(name)
        yield
    finally:
        mixed.set_global_policy(previous)


def _mixed_precision_steps(kit: KerasDriver, model: Any, inner: Any) -> list[float]:
    """The loss scale after each of the steps. A step is one update of the wrapped optimizer: with
    its `gradient_accumulation_steps`, that many apply() calls, each on a batch's gradients as `fit`
    makes them (three calls had made no update of a class accumulating four, a fail)."""
    tf = kit.tf
    x, y = (tf.constant(a) for a in arrays([(16, 4), (16, 1)], seed=81))
    variables = model.trainable_variables
    optimizer = kit.loss_scale_optimizer(inner, initial_scale=2.0**8)
    scales = []
    for _ in range(MIXED_PRECISION_STEPS):
        for _ in range(applies_per_update(inner)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))
                scaled = kit.scaled_loss(optimizer, loss)
            grads = kit.unscaled_gradients(optimizer, tape.gradient(scaled, variables))
            kit.apply(optimizer, grads, variables)
        scales.append(kit.loss_scale(optimizer))
    return scales


CHECKS: Mapping[str, Callable[[CheckContext], Outcome]] = {
    "save_load_model": check_save_load_model,
    "graph_mode": check_graph_mode,
    "mixed_precision": check_mixed_precision,
}
