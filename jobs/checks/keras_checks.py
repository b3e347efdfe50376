"""The TensorFlow check table: one set of checks for Keras 3 (`keras`) and legacy tf.keras (`tf_legacy`).

Every check builds its own tiny problem (a few hundred float32 numbers, fixed NumPy seeds,
CPU) through `ctx.build`, so the user's hyperparameters apply. Where the two styles differ
(how state is created, how gradients are applied, which module holds schedules, saving
formats) a `_Kit` says how; legacy classes are driven through `tf_keras` directly, never
`tf.keras`, so both styles work in one process. The steps run eagerly unless the check is
about compilation (`graph_mode`, `step_cost`), so a graph-only fault fails only `graph_mode`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext, overrides_note, with_defaults
from jobs.checks.fresh import distributed, resume_exact
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.frameworks.keras_driver import (
    optimizer_variables_of,
    plain_config,
    same_config_value,
    variable_device,
)
from optimizers.hyperparams import Param

# Small shapes with distinct sizes, so an optimizer variable can be told apart by its shape.
SHAPES: tuple[tuple[int, ...], ...] = ((4, 3), (3,), (5,))
FROZEN_SHAPE = (7, 2)
TABLE_SHAPE = (10, 4)
# Closeness of two computations that should agree up to float32 rounding (graph rewrites,
# a sparse and a dense path); XLA fuses and reorders more, so it gets a looser bound.
RTOL, ATOL = 1e-5, 1e-6
XLA_RTOL, XLA_ATOL = 1e-4, 1e-5
STEP_COST_LIMIT = 3.0
LINALG_OPS = ("SelfAdjointEig", "Svd", "Qr", "Cholesky", "Matrix", "BatchMatMul", "MatMul", "Einsum", "Lu")
HOST_SYNC_OPS = {"PrintV2", "Print", "PyFunc", "PyFuncStateless", "EagerPyFunc"}


# -- what differs between the two styles -------------------------------------------------------------


@dataclass(frozen=True)
class _Kit:
    style: str
    km: Any  # the `keras` module, or `tf_keras` for legacy optimizers
    tf: Any

    @property
    def legacy(self) -> bool:
        return self.style == "tf_legacy"

    def variable(self, value: np.ndarray) -> Any:
        if self.legacy:
            return self.tf.Variable(value)
        return self.km.Variable(value)

    def create_state(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Make every optimizer variable now, eagerly, as the trainer does before compiling."""
        if self.legacy:
            optimizer._create_all_weights(list(variables))  # the legacy API's only way to make slots
        else:
            optimizer.build(list(variables))

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """One update, called the way each style's own training loop calls it."""
        if self.legacy:
            optimizer.apply_gradients(list(zip(grads, variables, strict=True)))
        else:
            optimizer.apply(list(grads), list(variables))

    @property
    def schedules(self) -> Any:
        return self.km.optimizers.schedules

    def reference_sgd(self) -> Any:
        """The framework's SGD with momentum: the yardstick for formats and speed."""
        if self.legacy:
            return self.km.optimizers.legacy.SGD(learning_rate=0.01, momentum=0.9)
        return self.km.optimizers.SGD(learning_rate=0.01, momentum=0.9)

    def tiny_model(self, seed: int, hidden: int = 0) -> Any:
        layers = self.km.layers
        body = [layers.Dense(hidden, activation="tanh"), layers.Dense(1)] if hidden else [layers.Dense(3)]
        model = self.km.Sequential([self.km.Input((4,)), *body])
        rng = np.random.RandomState(seed)
        model.set_weights([rng.normal(0.0, 0.5, w.shape).astype(np.float32) for w in model.get_weights()])
        return model


@cache
def _kit_for(style: str) -> _Kit:
    import tensorflow as tf

    if style == "tf_legacy":
        import tf_keras

        return _Kit(style, tf_keras, tf)
    import keras

    return _Kit(style, keras, tf)


def _kit(ctx: CheckContext) -> _Kit:
    return _kit_for(ctx.target.style)


# -- small tools -------------------------------------------------------------------------------------


def _arrays(shapes: Sequence[tuple[int, ...]], seed: int, mean: float = 0.0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [(mean + rng.normal(0.0, 1.0, shape)).astype(np.float32) for shape in shapes]


def _tensors(arrays: Sequence[np.ndarray | None], kit: _Kit) -> list[Any]:
    return [None if a is None else kit.tf.constant(a) for a in arrays]


def _values(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _fresh(
    ctx: CheckContext,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    *,
    seed: int = 0,
    learning_rate: Any = None,
    **overrides: Any,
) -> tuple[Any, list[Any]]:
    """A new optimizer with the user's params over new variables, its state already created."""
    kit = _kit(ctx)
    variables = [kit.variable(a) for a in _arrays(shapes, seed, mean=1.0)]
    optimizer = ctx.build(learning_rate=learning_rate, **overrides)
    kit.create_state(optimizer, variables)
    return optimizer, variables


def _state(optimizer: Any) -> list[np.ndarray]:
    return [np.array(np.asarray(v.numpy())) for v in optimizer_variables_of(optimizer)]


def _max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return math.inf
    diffs = [float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b, strict=True) if x.size]
    return max(diffs, default=0.0)


def _all_close(a: Sequence[np.ndarray], b: Sequence[np.ndarray], rtol: float, atol: float) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=False)
        for x, y in zip(a, b, strict=True)
    )


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + (",)" if len(shape) == 1 else ")")


def _user_line(ctx: CheckContext, error: BaseException) -> str:
    """`file:line` in the user's file: from the traceback, else from an autograph message that
    quotes the user's code (`File "x.py", line 12`), else the class statement."""
    source = ctx.target.source_file()
    if source is not None:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
        if frames:
            return f"{source}:{frames[-1].lineno}"
        quoted = re.findall(rf'File "{re.escape(source)}", line (\d+)', str(error))
        if quoted:
            return f"{source}:{quoted[-1]}"
    return ctx.target.class_location()


def _raised_by_user(ctx: CheckContext, error: BaseException) -> bool:
    """The exception was raised by a `raise` in the user's own file (not deep inside TF)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename == ctx.target.source_file()


def _first_line(error: BaseException, ctx: CheckContext) -> str:
    """The error in one line; for an autograph error (which quotes the traced code first, the
    user's line included) its last line, where the actual complaint is."""
    text = str(error)
    if "in user code:" in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        last = lines[-1][:300]
        return last if last.startswith(type(error).__name__) else f"{type(error).__name__}: {last}"
    return ctx.describe_error(error)


@contextmanager
def _quiet() -> Iterator[None]:
    """Framework chatter that is expected in a check (missing gradients, h5 is legacy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _updates_nothing(ctx: CheckContext) -> bool:
    """`dense_step` saw no variable move: checks that need movement say so instead of failing."""
    return ctx.notes.get("keras.moves_nothing", False) is True


MOVES_NOTHING = "not meaningful: a step changes no variable at all (see dense_step)"


def _constructor_kwargs(ctx: CheckContext) -> dict[str, Any]:
    entry = ctx.target.entry
    return {(entry.lr_arg if k == "lr" else k): v for k, v in with_defaults(ctx.target, ctx.params).items()}


def _without_weight_decay(ctx: CheckContext) -> dict[str, Any]:
    """`weight_decay=0` when the class has one and allows 0: decay not scaled by the learning rate
    is a legitimate design, and would blur checks about the learning rate."""
    param = ctx.target.entry.params.get("weight_decay")
    if param is None or param.type not in ("float", "number"):
        return {}
    try:
        param.check(0.0)
    except ValueError:
        return {}
    return {"weight_decay": 0.0}


def _stateful(ctx: CheckContext) -> dict[str, Any]:
    """Overrides that give the optimizer per-variable state when the user's settings leave it with
    none (SGD's default momentum=0), so state checks have something to check: `momentum=0.9` when
    the class declares a momentum it would accept. Empty when state exists or nothing helps."""
    if "keras.stateful" in ctx.notes:
        return dict(ctx.notes["keras.stateful"])
    overrides: dict[str, Any] = {}
    optimizer, _ = _fresh(ctx)
    param = ctx.target.entry.params.get("momentum")
    if not any(len(v.shape) > 0 for v in optimizer_variables_of(optimizer)) and param is not None:
        try:
            param.check(0.9)
            overrides = {"momentum": 0.9}
        except ValueError:
            pass
    ctx.notes["keras.stateful"] = overrides
    return dict(overrides)


# -- construct -----------------------------------------------------------------------------------------


def check_construct(ctx: CheckContext) -> Outcome:
    try:
        ctx.build()
    except Exception as exc:
        ctx.mark_unbuildable()
        return failed(
            f"building with {ctx.params or 'the defaults'} raised {ctx.describe_error(exc)}",
            where=_user_line(ctx, exc),
            fix="the constructor must accept its own defaults and any value in its declared ranges",
        )
    probes = list(_range_probes(ctx))
    problems: list[tuple[str, BaseException | None]] = []
    for arg, bad, param in probes:
        kwargs = {**_constructor_kwargs(ctx), arg: bad}
        try:
            ctx.target.cls(**kwargs)
        except Exception as exc:
            if arg not in str(exc):
                problems.append(
                    (
                        f"{arg}={bad!r} is rejected, but the error does not name {arg}: "
                        f"{ctx.describe_error(exc)}",
                        exc,
                    )
                )
            continue
        problems.append(
            (f"{arg}={bad!r} is accepted although the class declares {arg} {param.allowed()}", None)
        )
    if problems:
        text, error = problems[0]
        more = (
            f"; and {len(problems) - 1} more: " + "; ".join(t for t, _ in problems[1:])
            if len(problems) > 1
            else ""
        )
        return failed(
            text + more,
            where=_user_line(ctx, error) if error is not None else ctx.target.class_location(),
            fix="validate each argument in __init__ (e.g. optlab_hyperparameters[...].check) and name it "
            "in the error",
            figure=float(len(problems)),
        )
    if not probes:
        return passed("builds with the defaults and the given params; it declares no ranges to probe")
    return passed(
        f"builds with the defaults and the given params; {len(probes)} out-of-range values rejected "
        "with errors naming the argument",
        figure=float(len(probes)),
    )


def _range_probes(ctx: CheckContext) -> Iterator[tuple[str, Any, Param]]:
    """(argument, a value outside its declared range, its declaration) for each declared range.

    Only ranges the class itself declares (`optlab_hyperparameters`) are probed: Keras and
    tf_keras accept e.g. a negative learning rate, and that is the framework's choice.
    """
    declared: Mapping[str, Param] = getattr(ctx.target.cls, "optlab_hyperparameters", {}) or {}
    entry = ctx.target.entry
    arguments = {entry.lr_arg if name == "lr" else name for name in entry.params}
    for arg, param in declared.items():
        if arg not in arguments:
            continue
        bad = _outside(param)
        if bad is None:
            continue
        if param.type == "float_pair":
            default = param.default if isinstance(param.default, tuple | list) else (bad, bad)
            yield arg, (bad, default[1]), param
        elif param.type in ("float", "number", "int"):
            yield arg, bad, param


def _outside(param: Param) -> float | int | None:
    integer = param.type == "int"
    if param.low is not None and math.isfinite(param.low):
        value = param.low - 1 if param.low_inclusive else param.low
    elif param.high is not None and math.isfinite(param.high):
        value = param.high + 1 if param.high_inclusive else param.high
    else:
        return None
    return int(value) if integer else float(value)


# -- dense_step, descends --------------------------------------------------------------------------------


def check_dense_step(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    optimizer, variables = _fresh(ctx)
    before = _values(variables)
    kit.apply(optimizer, _tensors(_arrays(SHAPES, seed=1), kit), variables)
    after = _values(variables)
    nonfinite = [i for i, a in enumerate(after) if not np.all(np.isfinite(a))]
    unchanged = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if np.array_equal(a, b)]
    ctx.notes["keras.moves_nothing"] = len(unchanged) == len(variables)
    if nonfinite:
        return failed(
            f"one step left non-finite values in {len(nonfinite)} of {len(variables)} variables",
            where=ctx.target.class_location(),
            fix="look for a division by a zero state (add epsilon) or a log/sqrt of a negative value",
            figure=float(len(nonfinite)),
        )
    if unchanged:
        shapes = ", ".join(_shape_text(SHAPES[i]) for i in unchanged)
        return failed(
            f"one step with a non-zero gradient left {len(unchanged)} of {len(variables)} variables "
            "unchanged "
            f"(shapes {shapes})",
            where=ctx.target.class_location(),
            fix="update the variable in place (self.assign / assign_sub, or var.assign in legacy code); "
            "`variable = variable - lr * g` only rebinds a local name, and every variable with a gradient "
            "must be updated",
            figure=float(len(unchanged)),
        )
    smallest = min(float(np.max(np.abs(a - b))) for a, b in zip(before, after, strict=True))
    return passed(f"one step changed all {len(variables)} variables, values finite", figure=smallest)


def check_descends(ctx: CheckContext) -> Outcome:
    """0.5 * |w - t|^2 (condition number 1): any optimizer's steps must bring the loss down."""
    if _updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    kit = _kit(ctx)
    optimizer, variables = _fresh(ctx)
    targets = _arrays(SHAPES, seed=2)
    steps = 20

    def loss() -> float:
        return sum(
            0.5 * float(np.sum((v - t) ** 2)) for v, t in zip(_values(variables), targets, strict=True)
        )

    start = loss()
    for _ in range(steps):
        grads = [v - t for v, t in zip(_values(variables), targets, strict=True)]
        kit.apply(optimizer, _tensors(grads, kit), variables)
    end = loss()
    ratio = end / start
    if not math.isfinite(end) or end >= start:
        return failed(
            f"the loss went from {start:.4g} to {end:.4g} in {steps} steps on a well-conditioned quadratic "
            f"with lr={ctx.lr:g}",
            where=ctx.target.class_location(),
            fix="check the sign of the update (subtract lr * direction) and that the learning rate is "
            "applied to it",
            figure=ratio,
        )
    return passed(f"loss fell to {ratio:.3g} of its start in {steps} steps (lr={ctx.lr:g})", figure=ratio)


# -- none_grads ------------------------------------------------------------------------------------------


def check_none_grads(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    shapes = (*SHAPES[:2], FROZEN_SHAPE)
    stateful = _stateful(ctx)
    optimizer, variables = _fresh(ctx, shapes, **stateful)

    def frozen_state() -> list[np.ndarray]:  # its slots: the only optimizer variables of its shape
        return [s for s in _state(optimizer) if s.shape == FROZEN_SHAPE]

    frozen_before, state_before = _values(variables)[2], frozen_state()
    others_before = _values(variables)[:2]
    try:
        with _quiet():
            for seed in (3, 4):
                grads = [*_tensors(_arrays(SHAPES[:2], seed), kit), None]
                kit.apply(optimizer, grads, variables)
    except Exception as exc:
        return failed(
            f"a step where one variable has no gradient (None, as for a frozen layer) raised "
            f"{ctx.describe_error(exc)}",
            where=_user_line(ctx, exc),
            fix="skip pairs whose gradient is None before using them (as the base class's "
            "apply does), e.g. in an overridden apply/apply_gradients",
        )
    moved = float(np.max(np.abs(_values(variables)[2] - frozen_before)))
    state_moved = _max_diff(frozen_state(), state_before)
    if moved > 0 or state_moved > 0:
        what = "the variable" if moved > 0 else "its optimizer state"
        return failed(
            f"a variable whose gradient is None changed ({what}, by up to {max(moved, state_moved):.3g})",
            where=ctx.target.class_location(),
            fix="leave a variable without a gradient alone: no weight decay, momentum or slot update for it",
            figure=max(moved, state_moved),
        )
    if not _updates_nothing(ctx) and all(
        np.array_equal(a, b) for a, b in zip(others_before, _values(variables)[:2], strict=True)
    ):
        return failed(
            "with one gradient None, the variables that do have gradients were not updated either",
            where=ctx.target.class_location(),
            fix="drop only the None pairs, not the whole step",
        )
    return passed(
        "a variable with a None gradient and its state were left alone; the others were updated"
        + overrides_note(stateful)
    )


# -- schedule ------------------------------------------------------------------------------------------

# Multiples of the learning rate for steps 0..4: zero on some steps, so an optimizer that
# reads the rate once (in __init__ or build) instead of every step is caught.
SCHEDULE_FACTORS = (0.0, 1.0, 0.0, 2.0, 0.5)
# Where a rate of 0 is outside what the optimizer can take: every step must move, and differently.
POSITIVE_SCHEDULE_FACTORS = (1.0, 0.5, 2.0, 0.25, 1.0)


def check_schedule(ctx: CheckContext) -> Outcome:
    if _updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    refusal = _schedule_refusal(ctx)
    if refusal is not None:
        return warned(
            f"the class refuses a LearningRateSchedule with a clear error ({refusal}), so no schedule can "
            "be used with it",
            where=ctx.target.class_location(),
            fix="accept a schedule and read the rate each step (legacy: self._decayed_lr(var_dtype)); "
            "until then, set the rate by hand between steps",
        )
    kit = _kit(ctx)
    overrides = _without_weight_decay(ctx)
    zero_rate_ok = _takes_a_zero_rate(ctx, overrides)
    rates = [ctx.lr * f for f in (SCHEDULE_FACTORS if zero_rate_ok else POSITIVE_SCHEDULE_FACTORS)]
    schedule = kit.schedules.PiecewiseConstantDecay(list(range(len(rates) - 1)), rates)
    optimizer, variables = _fresh(ctx, learning_rate=schedule, **overrides)
    reference = _reference_with_rate_set_each_step(ctx, overrides)
    grads = [_tensors(_arrays(SHAPES, seed=10 + step), kit) for step in range(len(rates))]
    wrong: list[str] = []  # movement against the schedule: the plainest evidence, reported first
    off_reference: list[str] = []
    worst = 0.0
    for step, rate in enumerate(rates):
        before = _values(variables)
        kit.apply(optimizer, grads[step], variables)
        change = _max_diff(_values(variables), before)
        if rate == 0.0 and change > 0.0:
            wrong.append(f"step {step} (rate 0) moved the variables by {change:.3g}")
        elif rate > 0.0 and change == 0.0:
            wrong.append(f"step {step} (rate {rate:g}) left every variable unchanged")
        if reference is not None:
            ref_optimizer, ref_variables = reference
            ref_optimizer.learning_rate = rate
            kit.apply(ref_optimizer, grads[step], ref_variables)
            diff = _max_diff(_values(variables), _values(ref_variables))
            worst = max(worst, diff)
            if not _all_close(_values(variables), _values(ref_variables), RTOL, ATOL):
                off_reference.append(
                    f"after step {step} the result differs by {diff:.3g} from the same optimizer with "
                    f"its learning rate set to {rate:g} by hand"
                )
    wrong.extend(off_reference)
    decay_note = " (weight_decay set to 0 for this check)" if overrides else ""
    if wrong:
        return failed(
            f"a LearningRateSchedule of rates {[round(r, 8) for r in rates]} was not followed: {wrong[0]}"
            f"{decay_note}",
            where=ctx.target.class_location(),
            fix="use the learning_rate argument update_step receives (legacy: _decayed_lr / "
            "apply_state['lr_t']) every step; never cache float(self.learning_rate) in __init__ or build",
            figure=worst,
        )
    compared = " and matched the rate set by hand each step" if reference is not None else ""
    zero_note = (
        "zero-rate steps left the variables alone"
        if zero_rate_ok
        else "rates kept above 0: a step at rate 0 gives non-finite values in this optimizer (e.g. FTRL)"
    )
    return passed(
        f"a LearningRateSchedule was applied at each of {len(rates)} steps ({zero_note}){compared}"
        f"{decay_note}",
        figure=worst,
    )


def _takes_a_zero_rate(ctx: CheckContext, overrides: Mapping[str, Any]) -> bool:
    """Whether a step at learning rate 0 stays finite: FTRL divides by the rate, so the zero-rate
    steps of the schedule check would compare NaN with NaN for it."""
    kit = _kit(ctx)
    try:
        optimizer, variables = _fresh(ctx, learning_rate=0.0, **overrides)
        kit.apply(optimizer, _tensors(_arrays(SHAPES, seed=10), kit), variables)
    except Exception:
        return False
    return all(np.all(np.isfinite(value)) for value in _values(variables))


def _reference_with_rate_set_each_step(
    ctx: CheckContext, overrides: Mapping[str, Any]
) -> tuple[Any, list[Any]] | None:
    """The same optimizer with a plain rate that the check assigns before each step, or None
    when the class does not let its learning rate be assigned."""
    try:
        optimizer, variables = _fresh(ctx, **overrides)
        optimizer.learning_rate = ctx.lr
    except Exception:
        return None
    return optimizer, variables


# -- sparse ---------------------------------------------------------------------------------------------


def check_sparse(ctx: CheckContext) -> Outcome:
    """Unique rows first (the plain case), then a repeated id (as an Embedding batch has), then a
    second step elsewhere to see whether rows the gradient did not touch move."""
    kit = _kit(ctx)
    first_rows, second_rows, repeated_rows = [1, 3], [6, 8], [2, 5, 5]
    optimizer, (table,) = _fresh(ctx, (TABLE_SHAPE,))
    start = _values([table])[0]
    try:
        kit.apply(optimizer, [_slices(kit, first_rows, 20)], [table])
    except Exception as exc:
        return _sparse_refused(ctx, exc)
    after_first = _values([table])[0]
    diff = _sparse_vs_dense(ctx, first_rows, 20, after_first)
    if not np.all(np.isfinite(after_first)) or diff > 0:
        return failed(
            f"the rows a tf.IndexedSlices gradient touches differ by up to {diff:.3g} from the same "
            "optimizer "
            "on the equivalent dense gradient",
            where=ctx.target.class_location(),
            fix="in the sparse path gather the touched rows, apply the same math to them and scatter them "
            "back (legacy: _resource_apply_sparse gets the touched rows' values and their indices)",
            figure=diff,
        )
    kit.apply(optimizer, [_slices(kit, second_rows, 21)], [table])
    densified = _rows_changed(start, after_first, exclude=first_rows) | _rows_changed(
        after_first, _values([table])[0], exclude=second_rows
    )
    notes = []
    repeated_optimizer, (repeated_table,) = _fresh(ctx, (TABLE_SHAPE,))
    kit.apply(repeated_optimizer, [_slices(kit, repeated_rows, 22)], [repeated_table])
    repeated_diff = _sparse_vs_dense(ctx, repeated_rows, 22, _values([repeated_table])[0])
    if repeated_diff > 0:
        notes.append(
            f"with a repeated index (ids {repeated_rows}) the touched rows differ by up to "
            f"{repeated_diff:.3g} "
            "from the dense gradient, which sums the repeats (Keras 3's own Adam and RMSprop square each "
            "repeat separately too)"
        )
    if densified:
        notes.append(
            f"{len(densified)} of {TABLE_SHAPE[0]} rows the gradient did not touch changed too: the update "
            "densifies the whole table every step (O(table) work, e.g. momentum or weight decay on all rows)"
        )
    if notes:
        return warned(
            "sparse gradients work, but " + "; ".join(notes),
            where=ctx.target.class_location(),
            fix=(
                "sum repeated indices first (tf.unique + tf.math.unsorted_segment_sum) before squaring or "
                "taking signs; "
                if repeated_diff > 0
                else ""
            )
            + "for large embeddings update only the touched rows (gather, compute, scatter: LazyAdam-style)",
            figure=float(len(densified)) if densified else repeated_diff,
        )
    return passed(
        "tf.IndexedSlices gradients (repeated ids too) update only the rows they touch, and those match the "
        "dense computation",
        figure=0.0,
    )


def _sparse_vs_dense(ctx: CheckContext, rows: list[int], seed: int, sparse_result: np.ndarray) -> float:
    """How far the touched rows after one sparse step are from the same optimizer's dense step
    (0 when within float32 rounding)."""
    kit = _kit(ctx)
    optimizer, (table,) = _fresh(ctx, (TABLE_SHAPE,))
    kit.apply(optimizer, [kit.tf.convert_to_tensor(_slices(kit, rows, seed))], [table])
    touched = sorted(set(rows))
    dense = _values([table])[0][touched]
    if np.allclose(sparse_result[touched], dense, rtol=RTOL, atol=ATOL):
        return 0.0
    return float(np.max(np.abs(sparse_result[touched] - dense)))


def _slices(kit: _Kit, rows: list[int], seed: int) -> Any:
    tf = kit.tf
    values = _arrays([(len(rows), TABLE_SHAPE[1])], seed)[0]
    return tf.IndexedSlices(tf.constant(values), tf.constant(rows, dtype=tf.int64), tf.constant(TABLE_SHAPE))


def _rows_changed(before: np.ndarray, after: np.ndarray, *, exclude: list[int]) -> set[int]:
    changed = np.nonzero(np.any(before != after, axis=1))[0]
    return {int(row) for row in changed} - set(exclude)


def _sparse_refused(ctx: CheckContext, exc: BaseException) -> Outcome:
    message = str(exc).lower()
    clear = _raised_by_user(ctx, exc) and ("sparse" in message or "indexedslices" in message)
    if clear and not ctx.target.entry.supports_sparse:
        return passed(f"refuses sparse gradients with a clear error: {_first_line(exc, ctx)}")
    if clear:
        return failed(
            f"the class sets optlab_supports_sparse but refuses tf.IndexedSlices: {_first_line(exc, ctx)}",
            where=_user_line(ctx, exc),
            fix="implement the sparse path, or drop optlab_supports_sparse",
        )
    return failed(
        f"a tf.IndexedSlices gradient (what an Embedding produces) raised {_first_line(exc, ctx)}",
        where=_user_line(ctx, exc),
        fix="handle tf.IndexedSlices (legacy: _resource_apply_sparse gets only the touched rows' values "
        "and their indices), or raise a clear error saying sparse gradients are not supported",
    )


# -- config_roundtrip -------------------------------------------------------------------------------------


def check_config_roundtrip(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    optimizer, variables = _fresh(ctx)
    kit.apply(optimizer, _tensors(_arrays(SHAPES, seed=30), kit), variables)  # legacy: hypers now variables
    problem = _config_problem(ctx, optimizer, schedule=False)
    if problem is not None:
        return problem
    count = len(ctx.target.entry.params)
    refusal = _schedule_refusal(ctx)
    if refusal is not None:
        return passed(
            f"get_config() is JSON-serializable, carries all {count} hyperparameters and survives "
            f"from_config() (not tried with a LearningRateSchedule, which the class refuses: {refusal})",
            figure=float(count),
        )
    schedule = kit.schedules.ExponentialDecay(ctx.lr, decay_steps=10, decay_rate=0.5)
    problem = _config_problem(ctx, ctx.build(learning_rate=schedule), schedule=True)
    if problem is not None:
        return problem
    return passed(
        f"get_config() is JSON-serializable, carries all {count} hyperparameters and survives "
        "from_config(), with a plain rate and with a LearningRateSchedule",
        figure=float(count),
    )


def _schedule_refusal(ctx: CheckContext) -> str | None:
    """The message of a clear refusal to take a LearningRateSchedule at construction (legacy
    Nadam has one), or None when the class accepts one (or fails in some other way, which
    the checks that use a schedule then report)."""
    kit = _kit(ctx)
    schedule = kit.schedules.ExponentialDecay(ctx.lr, decay_steps=10, decay_rate=0.5)
    try:
        ctx.build(learning_rate=schedule)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if "schedule" in str(exc).lower():
            return ctx.describe_error(exc)
    return None


def _config_problem(ctx: CheckContext, optimizer: Any, *, schedule: bool) -> Outcome | None:
    cls: Any = ctx.target.cls
    with_what = " (built with a LearningRateSchedule)" if schedule else ""
    try:
        config = optimizer.get_config()
        json.dumps(config, default=_numpy_scalar)
    except Exception as exc:
        return failed(
            f"get_config(){with_what} is not JSON-serializable: {ctx.describe_error(exc)}",
            where=_user_line(ctx, exc),
            fix="return plain Python values from get_config (floats, not tensors or variables; "
            "a schedule through its serialize())",
        )
    missing = _missing_hyperparameters(ctx, config, schedule=schedule)
    if missing is not None:
        return missing
    try:
        clone = cls.from_config(dict(config))
        again = plain_config(clone)
    except Exception as exc:
        return failed(
            f"{cls.__name__}.from_config(get_config()){with_what} raised {ctx.describe_error(exc)}",
            where=_user_line(ctx, exc),
            fix="get_config must return exactly the constructor's arguments (plus the base class's)",
        )
    first = plain_config(optimizer)
    differing = sorted(
        k for k in first.keys() | again.keys() if not _config_value_equal(first.get(k), again.get(k))
    )
    if differing:
        key = differing[0]
        return failed(
            f"from_config(get_config()){with_what} gives a different config: {key!r} was {first.get(key)!r}, "
            f"came back {again.get(key)!r}"
            + (f" ({len(differing) - 1} more keys)" if len(differing) > 1 else ""),
            where=ctx.target.class_location(),
            fix="store each constructor argument as given and return it from get_config unchanged",
        )
    return None


def _missing_hyperparameters(
    ctx: CheckContext, config: Mapping[str, Any], *, schedule: bool
) -> Outcome | None:
    """Comparing a config with its reload cannot see an argument missing from both: the reloaded
    optimizer would silently use its default."""
    built_with = _constructor_kwargs(ctx)
    for arg, value in built_with.items():
        if arg not in config:
            return failed(
                f"hyperparameter {arg!r} is missing from get_config(); a reloaded optimizer would silently "
                "use its default",
                where=ctx.target.class_location(),
                fix=f"add {arg!r} to the dict get_config returns (config.update({{{arg!r}: ...}}))",
            )
        if arg == ctx.target.entry.lr_arg and schedule:
            continue
        if not same_config_value(_plain_scalar(config[arg]), value):
            return failed(
                f"hyperparameter {arg!r} was built as {value!r} but get_config() says {config[arg]!r}",
                where=ctx.target.class_location(),
                fix=f"return the value {arg!r} was built with from get_config",
            )
    return None


def _numpy_scalar(value: Any) -> Any:
    """What Keras's own JSON encoders accept beyond json's: NumPy scalars."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _plain_scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _config_value_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_config_value_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_config_value_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- state_roundtrip ----------------------------------------------------------------------------------------


def check_state_roundtrip(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    tf = kit.tf
    stateful = _stateful(ctx)
    optimizer, variables = _fresh(ctx, **stateful)
    for seed in (40, 41):
        kit.apply(optimizer, _tensors(_arrays(SHAPES, seed), kit), variables)
    prefix = str(ctx.workdir / "state_roundtrip" / "ckpt")
    written = tf.train.Checkpoint(optimizer=optimizer, variables=list(variables)).write(prefix)
    fresh, fresh_variables = _fresh(ctx, **stateful)
    status = tf.train.Checkpoint(optimizer=fresh, variables=list(fresh_variables)).read(written)
    try:
        status.assert_consumed()
    except AssertionError as exc:
        return failed(
            f"tf.train.Checkpoint: saved optimizer values found no variable in a freshly built optimizer "
            f"({str(exc).splitlines()[0][:200]})",
            where=ctx.target.class_location(),
            fix="create all state in build (add_variable / add_optimizer_variables; legacy: add_slot in "
            "_create_slots) so a fresh optimizer has it before restoring",
        )
    saved, restored = _state(optimizer), _state(fresh)
    if len(restored) != len(saved) or _max_diff(saved, restored) > 0:
        diff = _max_diff(saved, restored)
        return failed(
            f"the restored optimizer's variables differ from the saved ones ({len(saved)} saved, "
            f"{len(restored)} restored, max abs difference {diff:.3g})",
            where=ctx.target.class_location(),
            fix="create state only through add_variable / add_slot, in a fixed order",
            figure=diff,
        )
    if int(fresh.iterations) != int(optimizer.iterations):
        return failed(
            f"iterations came back as {int(fresh.iterations)}, not {int(optimizer.iterations)}",
            where=ctx.target.class_location(),
            fix="let the base class count steps in self.iterations; keep no step counter of your own",
        )
    grads = _tensors(_arrays(SHAPES, seed=42), kit)
    kit.apply(optimizer, grads, variables)
    kit.apply(fresh, grads, fresh_variables)
    diff = _max_diff(_values(variables) + _state(optimizer), _values(fresh_variables) + _state(fresh))
    if diff > 0:
        return failed(
            f"after restoring, the next step differs from the uninterrupted one by up to {diff:.3g}: some "
            "state lives outside the checkpointed variables (a Python attribute, a dict of tf.Variables "
            "the optimizer does not track)",
            where=ctx.target.class_location(),
            fix="keep all state in optimizer variables (Keras 3: self.add_variable / "
            "add_optimizer_variables; "
            "legacy: self.add_slot / add_weight)",
            figure=diff,
        )
    return passed(
        f"{len(saved)} optimizer variables and iterations restored into a fresh optimizer; the next step "
        "is bitwise identical" + overrides_note(stateful),
        figure=0.0,
    )


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
    formats = (".h5", ".keras") if kit.legacy else (".keras",)
    untracked = _state_outside_variables(ctx)
    if untracked:
        return failed(
            f"{untracked} tf.Variable(s) the optimizer tracks are not among optimizer.variables, so a "
            "whole-model save (which writes optimizer.variables) drops them",
            where=ctx.target.class_location(),
            fix="create state with self.add_variable / add_optimizer_variables, not tf.Variable",
            figure=float(untracked),
        )
    stateful = _stateful(ctx)
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


def _judge_reload(ctx: CheckContext, kit: _Kit, suffix: str, user: _Reload) -> Outcome | str | None:
    """None when the reload is complete; a `fail` for the class's faults; what the format loses
    when the framework's SGD loses the same through it (for a `warn`)."""
    cls = ctx.target.cls
    if user.error is not None:
        message = str(user.error)
        not_found = "Could not locate class" in message or "Unknown optimizer" in message
        return failed(
            f"load_model of a {suffix} model compiled with it raised {_first_line(user.error, ctx)}",
            where=ctx.target.class_location() if not_found else _user_line(ctx, user.error),
            fix=(
                f"decorate the class with @{'tf_keras.utils' if kit.legacy else 'keras.saving'}"
                ".register_keras_serializable(package=...) so load_model finds it by name"
                if not_found
                else "get_config must return exactly what the constructor accepts"
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
    reference = _whole_model_reload(kit, kit.reference_sgd, ctx.workdir / f"reference{suffix}")
    if reference.error is None and reference.lost_state:
        return (
            f"{suffix}: the format itself reloads the optimizer without its state ({user.state_text()}); "
            f"the framework's SGD(momentum=0.9) loses the same ({reference.state_text()})."
        )
    return failed(
        f"after a {suffix} save and load the optimizer came back with {user.state_text()}, while the "
        "framework's SGD keeps its state through the same format",
        where=ctx.target.class_location(),
        fix="create every optimizer variable in build (legacy: _create_slots) in a fixed order, so a "
        "loaded model's optimizer can receive the saved values",
    )


def _whole_model_reload(kit: _Kit, build: Callable[[], Any], path: Any) -> _Reload:
    model = kit.tiny_model(seed=50)
    optimizer = build()
    model.compile(optimizer=optimizer, loss="mse")
    variables = model.trainable_variables
    kit.create_state(optimizer, variables)
    x = kit.tf.constant(_arrays([(8, 4)], seed=51)[0])
    with kit.tf.GradientTape() as tape:
        loss = kit.tf.reduce_mean(kit.tf.square(model(x)))
    kit.apply(optimizer, tape.gradient(loss, variables), variables)
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
            if not _config_value_equal(saved_config.get(k), loaded_config.get(k))
        )
    )
    saved_state, loaded_state = _state(optimizer), _state(loaded)
    diff = _max_diff(saved_state, loaded_state) if len(saved_state) == len(loaded_state) else 0.0
    return _Reload(
        cls=type(loaded),
        config_keys=differing,
        iterations=(int(optimizer.iterations), int(loaded.iterations)),
        variables=(len(saved_state), len(loaded_state)),
        variable_diff=diff,
    )


def _state_outside_variables(ctx: CheckContext) -> int:
    """tf.Variables (not scalars) reachable from the optimizer as a checkpoint sees it, but neither
    in optimizer.variables nor among the variables it trains: what tf.train.Checkpoint saves and a
    whole-model file does not."""
    optimizer, variables = _fresh(ctx)
    return len(_tracked_outside(_kit(ctx), optimizer, variables))


def _tracked_outside(kit: _Kit, optimizer: Any, trained: Sequence[Any]) -> list[Any]:
    known = {id(_backing(v)) for v in [*optimizer_variables_of(optimizer), *trained]}
    found = []
    for item in kit.tf.train.TrackableView(optimizer).descendants():
        backing = _backing(item)
        if isinstance(backing, kit.tf.Variable) and id(backing) not in known and len(backing.shape) > 0:
            known.add(id(backing))
            found.append(item)
    return found


def _backing(variable: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable (itself for a tf.Variable)."""
    value = getattr(variable, "_value", None)
    return value if value is not None and hasattr(value, "handle") else variable


# -- graph_mode ---------------------------------------------------------------------------------------------

GRAPH_STEPS = 3


def check_graph_mode(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    grads = [_tensors(_arrays(SHAPES, seed=60 + step), kit) for step in range(GRAPH_STEPS)]
    try:
        eager = _run_steps(ctx, grads, compile_with=None)
    except Exception:
        return skipped("not meaningful: the eager step itself raises (see dense_step)")
    try:
        graph = _run_steps(ctx, grads, compile_with=False)
    except Exception as exc:
        return failed(
            f"the update works eagerly but not inside tf.function: {_first_line(exc, ctx)}",
            where=_user_line(ctx, exc),
            fix="use tensor ops (tf.where, tf.cond, ops.where) instead of Python if/while on tensor values, "
            "and no .numpy(), float(tensor) or .item() in the update",
        )
    diff = _max_diff(eager, graph)
    if not _all_close(eager, graph, RTOL, ATOL):
        return failed(
            f"{GRAPH_STEPS} steps under tf.function differ from the eager ones by up to {diff:.3g}: Python "
            "state (a counter, a cached value) is frozen when the function is traced",
            where=ctx.target.class_location(),
            fix="keep anything that changes between steps in optimizer variables (self.iterations, "
            "add_variable), not in Python attributes",
            figure=diff,
        )
    try:
        xla = _run_steps(ctx, grads, compile_with=True)
    except Exception as exc:
        return warned(
            "the update works under tf.function but not with jit_compile=True (XLA): "
            f"{_first_line(exc, ctx)}; "
            "jobs with jit_compile will fail",
            where=_user_line(ctx, exc),
            fix="avoid ops XLA cannot compile in the update (tf.py_function, tf.print, string ops)",
        )
    xla_diff = _max_diff(eager, xla)
    if not _all_close(eager, xla, XLA_RTOL, XLA_ATOL):
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


def _run_steps(
    ctx: CheckContext, grads: Sequence[Sequence[Any]], *, compile_with: bool | None
) -> list[np.ndarray]:
    """Variables and optimizer state after the steps: eagerly (None), tf.function, or XLA (True)."""
    kit = _kit(ctx)
    optimizer, variables = _fresh(ctx, **_stateful(ctx))

    def step(step_grads: list[Any]) -> None:
        kit.apply(optimizer, step_grads, variables)

    run = step if compile_with is None else kit.tf.function(step, jit_compile=compile_with)
    for step_grads in grads:
        run(list(step_grads))
    return _values(variables) + _state(optimizer)


# -- device_placement ------------------------------------------------------------------------------


def check_device_placement(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    tf = kit.tf
    if not tf.config.list_physical_devices("GPU"):
        return skipped("no GPU visible to TensorFlow: optimizer state placement needs one to mean anything")
    with tf.device("/GPU:0"):
        optimizer, variables = _fresh(ctx, **_stateful(ctx))
        kit.apply(optimizer, _tensors(_arrays(SHAPES, seed=70), kit), variables)
    misplaced = _misplaced_slots(variables, optimizer)
    if not misplaced:
        # Restored into objects built on the GPU again, as a job resumed on a GPU host does.
        written = tf.train.Checkpoint(optimizer=optimizer, variables=list(variables)).write(
            str(ctx.workdir / "device_placement" / "ckpt")
        )
        with tf.device("/GPU:0"):
            fresh, fresh_variables = _fresh(ctx, **_stateful(ctx))
            tf.train.Checkpoint(optimizer=fresh, variables=list(fresh_variables)).read(written)
        misplaced = [f"after restore: {m}" for m in _misplaced_slots(fresh_variables, fresh)]
    if misplaced:
        return failed(
            f"{len(misplaced)} optimizer variables sit on another device than their variable: {misplaced[0]}",
            where=ctx.target.class_location(),
            fix="create slots with add_variable_from_reference / add_optimizer_variables (legacy: add_slot), "
            "which place them next to their variable",
            figure=float(len(misplaced)),
        )
    return passed("every slot variable sits on its variable's device, also after a checkpoint restore")


def _misplaced_slots(variables: Sequence[Any], optimizer: Any) -> list[str]:
    """Slots are matched to variables by shape (the variables' shapes are all distinct)."""
    device_of_shape = {tuple(v.shape): variable_device(v) for v in variables}
    misplaced = []
    for slot in optimizer_variables_of(optimizer):
        home = device_of_shape.get(tuple(slot.shape))
        if home is not None and variable_device(slot) != home:
            misplaced.append(
                f"{getattr(slot, 'path', None) or slot.name} on {variable_device(slot)}, variable on {home}"
            )
    return misplaced


# -- mixed_precision ----------------------------------------------------------------------------------------


def check_mixed_precision(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    mixed = kit.km.mixed_precision
    previous = mixed.global_policy()
    try:
        mixed.set_global_policy("mixed_float16")
        model = kit.tiny_model(seed=80, hidden=8)
        before = [np.array(w) for w in model.get_weights()]
        try:
            scales = _mixed_precision_steps(kit, model, ctx.build())
        except Exception as exc:
            return failed(
                f"training under a mixed_float16 policy with {_loss_scale_name(kit)} raised "
                f"{_first_line(exc, ctx)}",
                where=_user_line(ctx, exc),
                fix="keep the update dtype-generic (cast to variable.dtype, not a fixed float32/float16) and "
                "keep the base class's apply/apply_gradients signature",
            )
        after = model.get_weights()
    finally:
        mixed.set_global_policy(previous)
    if not all(np.all(np.isfinite(w)) for w in after):
        return failed(
            f"weights became non-finite under mixed_float16 with {_loss_scale_name(kit)}",
            where=ctx.target.class_location(),
            fix="compute the update in the variable's dtype (float32 here) and let the loss scale handle "
            "float16 gradients",
        )
    if not _updates_nothing(ctx) and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)):
        return failed(
            f"{len(scales)} steps under mixed_float16 with {_loss_scale_name(kit)} changed no weight "
            f"(loss scales {scales})",
            where=ctx.target.class_location(),
            fix="the wrapped optimizer must apply the unscaled gradients it is given",
        )
    return passed(
        f"{len(scales)} steps under a mixed_float16 policy with {_loss_scale_name(kit)}: finite, weights "
        "updated",
        figure=scales[-1] if scales else None,
    )


def _loss_scale_name(kit: _Kit) -> str:
    return f"{'tf_keras' if kit.legacy else 'keras'}.mixed_precision.LossScaleOptimizer"


def _mixed_precision_steps(kit: _Kit, model: Any, inner: Any) -> list[float]:
    tf = kit.tf
    x, y = (tf.constant(a) for a in _arrays([(16, 4), (16, 1)], seed=81))
    variables = model.trainable_variables
    if kit.legacy:
        optimizer = kit.km.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0**8)
    else:
        optimizer = kit.km.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**8)
    scales = []
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))
            scaled = optimizer.get_scaled_loss(loss) if kit.legacy else optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        if kit.legacy:
            grads = optimizer.get_unscaled_gradients(grads)
        kit.apply(optimizer, grads, variables)
        scales.append(float(optimizer.loss_scale if kit.legacy else optimizer.dynamic_scale))
    return scales


# -- state_untrainable ---------------------------------------------------------------------------------------


def check_state_untrainable(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    tf = kit.tf
    model = kit.tiny_model(seed=90)
    stateful = _stateful(ctx)
    optimizer = ctx.build(**stateful)
    model.compile(optimizer=optimizer, loss="mse")
    kit.create_state(optimizer, model.trainable_variables)
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    kit.apply(optimizer, grads, model.trainable_variables)
    weights = model.trainable_variables
    state = [*optimizer_variables_of(optimizer), *_tracked_outside(kit, optimizer, weights)]
    weight_ids = {id(_backing(v)) for v in weights}
    in_model = [v for v in state if id(_backing(v)) in weight_ids]
    trainable = [
        v for v in state if id(_backing(v)) not in weight_ids and bool(getattr(v, "trainable", False))
    ]
    bad = trainable + in_model
    if bad:
        name = getattr(bad[0], "path", None) or bad[0].name
        return failed(
            f"{len(bad)} optimizer variables are trainable (e.g. {name!r}); a tape watches them and a "
            "model or strategy may treat them as weights",
            where=ctx.target.class_location(),
            fix="create state with add_variable / add_optimizer_variables (legacy: add_slot), or pass "
            "trainable=False",
            figure=float(len(bad)),
        )
    return passed(
        f"all {len(state)} optimizer variables are non-trainable and none is a model weight"
        + overrides_note(stateful),
        figure=0.0,
    )


# -- step_cost -------------------------------------------------------------------------------------

COST_SHAPES: tuple[tuple[int, ...], ...] = ((16, 16), (16,), (16, 8), (8,), (8, 1), (1,))


def check_step_cost(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    grads = _tensors(_arrays(COST_SHAPES, seed=100), kit)
    try:
        user, user_graph = _compiled_update(ctx, ctx.build, grads)
    except Exception:
        return skipped("not measurable: the update fails under tf.function (see graph_mode)")
    reference, reference_graph = _compiled_update(ctx, kit.reference_sgd, grads)
    user_s, reference_s = _interleaved_medians(user, reference)
    ratio = user_s / reference_s
    if ratio <= STEP_COST_LIMIT:
        return passed(
            f"update {user_s * 1e6:.0f} us vs {reference_s * 1e6:.0f} us for SGD(momentum=0.9) under "
            "tf.function",
            figure=ratio,
        )
    return warned(
        f"the update takes {ratio:.1f}x as long as SGD(momentum=0.9) on the same {len(COST_SHAPES)} "
        "variables "
        f"under tf.function ({user_s * 1e6:.0f} us vs {reference_s * 1e6:.0f} us); "
        + _where_time_goes(user_graph, reference_graph),
        where=ctx.target.class_location(),
        fix="keep host round-trips (tf.print, py_function, .numpy()) out of the update, clip by one global "
        "norm, and move per-step work that does not depend on the variable out of the per-variable loop",
        figure=ratio,
    )


def _compiled_update(
    ctx: CheckContext, build: Callable[[], Any], grads: list[Any]
) -> tuple[Callable[[], Any], Any]:
    kit = _kit(ctx)
    variables = [kit.variable(a) for a in _arrays(COST_SHAPES, seed=101, mean=1.0)]
    optimizer = build()
    kit.create_state(optimizer, variables)
    update = kit.tf.function(lambda gs: kit.apply(optimizer, gs, variables))
    graph = update.get_concrete_function(grads).graph.as_graph_def()
    for _ in range(3):  # warm-up: tracing and first-call costs are not the step's
        update(grads)
    return (lambda: update(grads)), graph


def _interleaved_medians(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[float, float]:
    """Median seconds per call of each, measured in alternating rounds so that load from other
    processes hits both alike; the best round of each counts."""
    rounds: tuple[list[float], list[float]] = ([], [])
    deadline = time.perf_counter() + 1.0
    for _ in range(7):
        for index, run in enumerate((first, second)):
            times = []
            for _ in range(15):
                started = time.perf_counter()
                run()
                times.append(time.perf_counter() - started)
            rounds[index].append(statistics.median(times))
        if time.perf_counter() > deadline:
            break
    return min(rounds[0]), min(rounds[1])


def _graph_op_types(graph_def: Any) -> list[tuple[str, str]]:
    nodes = [(n.op, n.name) for n in graph_def.node]
    for function in graph_def.library.function:
        nodes.extend((n.op, n.name) for n in function.node_def)
    return nodes


def _where_time_goes(user_graph: Any, reference_graph: Any) -> str:
    user_ops, reference_ops = _graph_op_types(user_graph), _graph_op_types(reference_graph)
    syncs = sorted({op for op, _ in user_ops if op in HOST_SYNC_OPS})
    if syncs:
        count = sum(op in HOST_SYNC_OPS for op, _ in user_ops)
        return (
            f"the traced update has {count} host round-trip ops ({', '.join(syncs)}: tf.print / py_function)"
        )
    norms = {
        name.rsplit("/", 1)[0] for _, name in user_ops if "clip_by_norm" in name or "norm" in name.lower()
    }
    if len(norms) > 1:
        return (
            f"the traced update computes {len(norms)} separate norms (per-variable clipping or normalisation)"
        )
    known = {op for op, _ in reference_ops} | {"Const", "Identity", "NoOp", "ReadVariableOp"}
    extra = Counter(op for op, _ in user_ops if op not in known)
    # Linear algebra first: a few of those cost more than all the elementwise ops together.
    ranked = sorted(extra.items(), key=lambda item: (not item[0].startswith(LINALG_OPS), -item[1]))
    listed = ", ".join(f"{op} x{count}" for op, count in ranked[:4])
    return f"the traced update has {len(user_ops)} ops against SGD's {len(reference_ops)}" + (
        f"; ops SGD does not need: {listed}" if listed else ""
    )


# -- deprecations --------------------------------------------------------------------------------------------


def check_deprecations(ctx: CheckContext) -> Outcome:
    kit = _kit(ctx)
    found: list[tuple[str, str]] = []  # (message, user's line or "")
    with _recording_deprecations(ctx, found):
        optimizer, variables = _fresh(ctx)
        for seed in (110, 111):
            kit.apply(optimizer, _tensors(_arrays(SHAPES, seed), kit), variables)
        optimizer.get_config()
    located = [(message, where) for message, where in found if where]
    if not located:
        other = f"; {len(found)} raised by framework code outside the class were ignored" if found else ""
        return passed(
            f"building, two steps and get_config raised no deprecation warning from the class{other}"
        )
    message, where = located[0]
    return warned(
        f"{len(located)} deprecation warning(s) from the class's code, first: {message[:200]}",
        where=where,
        fix="change that line to the replacement the warning names before the deprecated API is removed",
        figure=float(len(located)),
    )


def _is_deprecation(category: type[Warning] | None, message: str) -> bool:
    deprecated = category is not None and issubclass(category, DeprecationWarning | FutureWarning)
    return deprecated or "deprecat" in message.lower()


def _line_in_user_file(ctx: CheckContext, filename: str | None = None, lineno: int | None = None) -> str:
    """The user's line responsible: the warning's own location when it is there, else the
    innermost frame of the current stack inside the class's file."""
    source = ctx.target.source_file()
    if source is None:
        return ""
    if filename == source and lineno is not None:
        return f"{source}:{lineno}"
    frames = [f for f in traceback.extract_stack() if f.filename == source]
    return f"{source}:{frames[-1].lineno}" if frames else ""


@contextmanager
def _recording_deprecations(ctx: CheckContext, found: list[tuple[str, str]]) -> Iterator[None]:
    """Python deprecation warnings, and TensorFlow's own (logged once per process through the
    `tensorflow` logger, so its once-only memory is emptied for the duration)."""

    def show(message: Any, category: type[Warning], filename: str, lineno: int, *_: Any, **__: Any) -> None:
        if _is_deprecation(category, str(message)):
            found.append((str(message), _line_in_user_file(ctx, filename, lineno)))

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if _is_deprecation(None, text):
                # TensorFlow starts with "From <its own caller>:<line>:", never the user's line.
                text = re.sub(r"^From \S+:\d+: ", "", " ".join(text.split()))
                found.append((text, _line_in_user_file(ctx)))

    from tensorflow.python.util import deprecation

    printed = getattr(deprecation, "_PRINTED_WARNING", None)
    handler = Handler()
    logger = logging.getLogger("tensorflow")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        logger.addHandler(handler)
        if isinstance(printed, dict):
            deprecation._PRINTED_WARNING = {}
        try:
            yield
        finally:
            logger.removeHandler(handler)
            if isinstance(printed, dict):
                deprecation._PRINTED_WARNING = printed


CHECKS: Mapping[str, Callable[[CheckContext], Outcome]] = {
    "construct": check_construct,
    "dense_step": check_dense_step,
    "descends": check_descends,
    "none_grads": check_none_grads,
    "schedule": check_schedule,
    "sparse": check_sparse,
    "config_roundtrip": check_config_roundtrip,
    "state_roundtrip": check_state_roundtrip,
    "save_load_model": check_save_load_model,
    "resume_exact": resume_exact,
    "graph_mode": check_graph_mode,
    "distributed": distributed,
    "device_placement": check_device_placement,
    "mixed_precision": check_mixed_precision,
    "state_untrainable": check_state_untrainable,
    "step_cost": check_step_cost,
    "deprecations": check_deprecations,
}
