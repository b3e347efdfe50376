"""The checks that mean the same in every framework, written once over the drivers.

Each check makes variables from numpy arrays, builds the optimizer over them through the
catalogue (so the user's hyperparameters apply), feeds numpy gradients and reads values
and state back as numpy; `jobs.frameworks` says how for each style. What passes, warns
and fails, and the fix, read here; a fix sentence that must name framework API comes from
the driver's `advice`.
"""

from __future__ import annotations

import functools
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext, overrides_note, with_defaults
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.frameworks.base import ConfigNotSerialized, Driver, Gradient, SparseRows, StateNotRestored
from optimizers.hyperparams import Param

CheckFunction = Callable[[CheckContext], Outcome]

# Small shapes with distinct sizes, so an optimizer's state can be told apart by its shape.
SHAPES: tuple[tuple[int, ...], ...] = ((4, 3), (3,), (5,))
FROZEN_SHAPE = (7, 2)
LATER_FROZEN_SHAPE = (2, 6)
DESCENT_STEPS = 20
# step_cost: over this ratio to the framework's SGD(momentum=0.9) is a warn.
STEP_COST_LIMIT = 3.0
MOVES_NOTHING = "not meaningful: a step changes no variable at all (see dense_step)"
# Words an error may use for an argument instead of its own name.
_ARGUMENT_WORDS: dict[str, tuple[str, ...]] = {
    "lr": ("learning rate", "learning_rate", "step size"),
    "learning_rate": ("learning rate", "lr"),
    "eps": ("epsilon",),
    "epsilon": ("eps",),
    "betas": ("beta",),
}


# -- shared tools ------------------------------------------------------------------------------------


def isolated(check: CheckFunction) -> CheckFunction:
    """The framework's RNG seeded for the check, the caller's given back afterwards."""

    @functools.wraps(check)
    def run(ctx: CheckContext) -> Outcome:
        with ctx.driver.isolated():
            return check(ctx)

    return run


def arrays(shapes: Sequence[tuple[int, ...]], seed: int, mean: float = 0.0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [(mean + rng.normal(0.0, 1.0, shape)).astype(np.float32) for shape in shapes]


def fresh(
    ctx: CheckContext,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    *,
    seed: int = 0,
    learning_rate: Any = None,
    **overrides: Any,
) -> tuple[Any, list[Any]]:
    """A new optimizer with the user's params over new variables, its state already created."""
    driver = ctx.driver
    variables = driver.variables(arrays(shapes, seed, mean=1.0))

    def create(model_params: Any) -> Any:
        return ctx.build(model_params, learning_rate=learning_rate, **overrides)

    return driver.optimizer_over(create, variables), variables


def max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return math.inf
    diffs = [
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
        for x, y in zip(a, b, strict=True)
        if x.size
    ]
    return max(diffs, default=0.0)


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + (",)" if len(shape) == 1 else ")")


def method_location(ctx: CheckContext, method: str | None = None) -> str:
    """`file:line` of the class's update method (where the fix goes) when the user's file
    defines it, else the class statement."""
    import inspect

    # Unwrapped: torch wraps `step` in profiling hooks and no_grad decorators defined elsewhere.
    function = getattr(ctx.target.cls, method or ctx.driver.advice.update_method, None)
    try:
        function = inspect.unwrap(function)  # type: ignore[arg-type]
        _, first = inspect.getsourcelines(function)
        source = inspect.getsourcefile(function)
    except (OSError, TypeError):
        return ctx.where()
    if source is None or source != ctx.target.source_file():
        return ctx.where()
    return f"{source}:{first}"


def user_line(ctx: CheckContext, error: BaseException) -> str:
    """`file:line` in the user's file: from the traceback, else from a message that quotes the
    user's code (`File "x.py", line 12`: autograph, dynamo), else the class statement."""
    source = ctx.target.source_file()
    if source is not None:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
        if frames:
            return f"{source}:{frames[-1].lineno}"
        quoted = re.findall(rf'File "{re.escape(source)}", line (\d+)', str(error))
        if quoted:
            return f"{source}:{quoted[-1]}"
    return ctx.target.class_location()


def updates_nothing(ctx: CheckContext) -> bool:
    """`dense_step` saw no variable move: checks that need movement say so instead of failing."""
    return ctx.notes.get("moves_nothing", False) is True


# -- construct ---------------------------------------------------------------------------------------


@isolated
def check_construct(ctx: CheckContext) -> Outcome:
    entry, driver = ctx.target.entry, ctx.driver
    for label, params in (
        ("the default hyperparameters", {}),
        (f"the given hyperparameters {ctx.params}", ctx.params),
    ):
        try:
            entry.create(params, model_params=driver.variables(arrays(SHAPES, seed=0)))
        except Exception as exc:
            ctx.mark_unbuildable()
            return failed(
                f"building with {label} raised {ctx.describe_error(exc)}",
                where=user_line(ctx, exc),
                fix="the constructor must accept every declared hyperparameter at its default and in range",
            )
    probed: list[str] = []
    problems: list[str] = []
    where = ""
    for param in entry.params.values():
        values = _invalid_values(ctx, param)
        if values:
            probed.append(param.name)
        for value in values:
            problem, at = _probe_invalid(ctx, param, value)
            if problem:
                problems.append(problem)
                where = where or at
    if problems:
        return failed(
            "; ".join(problems),
            where=where,
            figure=float(len(problems)),
            fix="validate each argument in __init__ and raise ValueError naming it, the value and what is "
            "allowed (e.g. 'lr must be a number > 0; received -1')",
        )
    if not probed:
        return passed("builds with the defaults and the given params; it declares no ranges to probe", 0.0)
    return passed(
        f"builds with the defaults and the given params; values just outside the ranges of {len(probed)} "
        f"arguments ({', '.join(probed)}) were rejected with errors naming the argument "
        "(figure: arguments probed)",
        float(len(probed)),
    )


def _native(ctx: CheckContext, name: str) -> str:
    """The class's own argument name for catalogue name `name` (`lr` may be `learning_rate`)."""
    return ctx.target.entry.lr_arg if name == "lr" else name


def _native_kwargs(ctx: CheckContext, params: Mapping[str, Any]) -> dict[str, Any]:
    return {_native(ctx, k): v for k, v in params.items()}


def _invalid_values(ctx: CheckContext, param: Param) -> list[Any]:
    """Values just outside `param`'s range: the ranges the class declares (the exclusive bound
    itself too), and the learning rate's `> 0` only where the framework's own optimizers refuse
    a negative rate (torch; Keras accepts one by design)."""
    if param.type not in ("float", "number", "int", "float_pair"):
        return []
    declared = _native(ctx, param.name) in (getattr(ctx.target.cls, "optlab_hyperparameters", {}) or {})
    if not declared and not (param.name == "lr" and ctx.driver.capabilities.refuses_negative_lr):
        return []
    numbers: list[float] = []
    for bound, inclusive, direction in (
        (param.low, param.low_inclusive, -1),
        (param.high, param.high_inclusive, 1),
    ):
        if bound is None or not math.isfinite(bound):
            continue
        margin = 1 if param.type == "int" else 1e-3 * max(1.0, abs(bound))
        numbers.append(bound + direction * margin)
        if not inclusive and declared:
            numbers.append(bound)
    if param.type == "int":
        return [int(n) for n in numbers]
    if param.type == "float_pair":
        pair = ctx.params.get(param.name, param.default)
        return [(n, pair[1]) for n in numbers]
    return numbers


def _probe_invalid(ctx: CheckContext, param: Param, value: Any) -> tuple[str, str]:
    """('', '') when building with `value` raises an error naming the argument, else (problem, where)."""
    name = _native(ctx, param.name)
    try:
        ctx.driver.construct(ctx.target.cls, _native_kwargs(ctx, {**ctx.params, param.name: value}))
    except Exception as exc:
        if names_argument(str(exc), name):
            return "", ""
        return (
            f"{name}={value!r} was rejected with {ctx.describe_error(exc)}, which does not name {name}",
            user_line(ctx, exc),
        )
    return (
        f"{name}={value!r} was accepted although {name} must be {param.allowed()}",
        method_location(ctx, "__init__"),
    )


def names_argument(message: str, name: str) -> bool:
    """Whether an error message names argument `name`, in its own words or a usual synonym."""
    words = {name, name.replace("_", " "), name.replace("_", ""), *_ARGUMENT_WORDS.get(name, ())}
    stem = re.sub(r"[_\d]+$", "", name).rstrip("s")  # beta_1 -> beta, betas -> beta
    if len(stem) > 2:
        words.add(stem)
    lowered = message.lower()
    return any(re.search(rf"(?<![a-z0-9]){re.escape(w.lower())}(?![a-z0-9])", lowered) for w in words)


# -- dense_step, descends ----------------------------------------------------------------------------


@isolated
def check_dense_step(ctx: CheckContext) -> Outcome:
    driver = ctx.driver
    optimizer, variables = fresh(ctx)
    before = driver.values(variables)
    driver.step(optimizer, variables, arrays(SHAPES, seed=1))
    after = driver.values(variables)
    unchanged = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if np.array_equal(a, b)]
    ctx.notes["moves_nothing"] = len(unchanged) == len(variables)
    bad = [f"variable {shape_text(SHAPES[i])}" for i, a in enumerate(after) if not np.all(np.isfinite(a))]
    bad += [name for name, value in driver.state(optimizer) if not _finite(value)]
    if bad:
        return failed(
            f"after one step these are not finite: {', '.join(bad[:6])}",
            where=method_location(ctx),
            figure=float(len(bad)),
            fix=driver.advice.finite_state,
        )
    if unchanged:
        shapes = ", ".join(shape_text(SHAPES[i]) for i in unchanged)
        return failed(
            f"{len(unchanged)} of {len(variables)} variables with a nonzero gradient did not change after "
            f"one step: left unchanged (shapes {shapes})",
            where=method_location(ctx),
            figure=float(len(unchanged)),
            fix=driver.advice.in_place_update,
        )
    smallest = min(float(np.max(np.abs(a - b))) for a, b in zip(before, after, strict=True))
    return passed(
        f"one step changed all {len(variables)} variables; values and state finite "
        "(figure: smallest largest change)",
        smallest,
    )


def _finite(value: np.ndarray) -> bool:
    return not np.issubdtype(value.dtype, np.floating) or bool(np.all(np.isfinite(value)))


@isolated
def check_descends(ctx: CheckContext) -> Outcome:
    """0.5 * |w - t|^2 (condition number 1): any optimizer's steps must bring the loss down."""
    if updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    driver = ctx.driver
    optimizer, variables = fresh(ctx)
    targets = arrays(SHAPES, seed=2)

    def loss() -> float:
        values = driver.values(variables)
        return sum(0.5 * float(np.sum((v - t) ** 2)) for v, t in zip(values, targets, strict=True))

    start = loss()
    for _ in range(DESCENT_STEPS):
        grads = [v - t for v, t in zip(driver.values(variables), targets, strict=True)]
        driver.step(optimizer, variables, grads)
    end = loss()
    ratio = end / start
    if not math.isfinite(end) or end >= start:
        return failed(
            f"the loss went from {start:.4g} to {end:.4g} in {DESCENT_STEPS} steps on a well-conditioned "
            f"quadratic with lr={ctx.lr:g}",
            where=method_location(ctx),
            figure=ratio,
            fix=f"{driver.advice.sign_of_update}; check signs and that the learning rate is applied to the "
            "update and not far too large",
        )
    return passed(
        f"loss fell to {ratio:.3g} of its start in {DESCENT_STEPS} steps on a quadratic (lr={ctx.lr:g}; "
        "figure: final/initial)",
        ratio,
    )


# -- none_grads --------------------------------------------------------------------------------------


@isolated
def check_none_grads(ctx: CheckContext) -> Outcome:
    """A variable that never gets a gradient, and one whose gradient goes away after a step."""
    driver = ctx.driver
    shapes = (*SHAPES[:2], LATER_FROZEN_SHAPE, FROZEN_SHAPE)
    frozen, later = 3, 2
    overrides = ctx.stateful_overrides()
    optimizer, variables = fresh(ctx, shapes, **overrides)

    def grads(seed: int, *, later_too: bool) -> list[Gradient]:
        trained = arrays(shapes[:3], seed)
        return [trained[0], trained[1], trained[2] if later_too else None, None]

    try:
        driver.step(optimizer, variables, grads(3, later_too=True))
        saved = driver.values(variables)
        state = {i: driver.state_of(optimizer, variables, i) for i in (later, frozen)}
        for seed in (4, 5):
            driver.step(optimizer, variables, grads(seed, later_too=False))
    except Exception as exc:
        return failed(
            f"a step where a variable has no gradient (None, as for a frozen layer) raised "
            f"{ctx.describe_error(exc)}",
            where=user_line(ctx, exc),
            fix=driver.advice.skip_none_grad,
        )
    after = driver.values(variables)
    problems = []
    for index, label in ((frozen, "never had"), (later, "lost its")):
        moved = max_diff([after[index]], [saved[index]])
        if moved > 0:
            problems.append(f"a variable that {label} gradient (None) moved by {moved:.3g}")
        state_moved = max_diff(driver.state_of(optimizer, variables, index), state[index])
        if state_moved > 0:
            problems.append(
                f"the state of a variable that {label} gradient (None) changed by {state_moved:.3g}"
            )
    if problems:
        return failed(
            "; ".join(problems),
            where=method_location(ctx),
            figure=float(len(problems)),
            fix="leave a variable whose gradient is None alone: no weight decay, no momentum step, no state "
            "update for it",
        )
    if not updates_nothing(ctx) and max_diff(after[:2], saved[:2]) == 0:
        return failed(
            "with one gradient None, the variables that do have gradients were not updated either",
            where=method_location(ctx),
            fix="drop only the None pairs, not the whole step",
        )
    return passed(
        "variables with a None gradient (never trained, and frozen after a step) and their state stayed "
        f"bitwise unchanged over 2 steps; the others were updated{overrides_note(overrides)}",
        0.0,
    )


# -- schedule ----------------------------------------------------------------------------------------

# Multiples of the learning rate for steps 0..4: zero on some steps, so an optimizer that
# reads the rate once (in __init__, build or the first step) instead of every step is caught.
SCHEDULE_FACTORS = (0.0, 1.0, 0.0, 2.0, 0.5)
# Where a rate of 0 is outside what the optimizer can take (FTRL divides by it): every step
# must move, and differently from a constant rate.
POSITIVE_SCHEDULE_FACTORS = (1.0, 0.5, 2.0, 0.25, 1.0)


@isolated
def check_schedule(ctx: CheckContext) -> Outcome:
    """The rate the style's schedule sets must be the one applied at every step: zero-rate steps
    move nothing, the others move, and the result equals the rate set by hand each step. One
    step of lag is allowed: averaging optimizers (torch's ASGD) apply a rate derived from the
    previous step's."""
    if updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    driver = ctx.driver
    overrides = _without_weight_decay(ctx)
    zero_rate_ok = _takes_a_zero_rate(ctx, overrides)
    rates = [ctx.lr * f for f in (SCHEDULE_FACTORS if zero_rate_ok else POSITIVE_SCHEDULE_FACTORS)]
    grads = [arrays(SHAPES, seed=10 + step) for step in range(len(rates))]
    try:
        scheduled = _updates(ctx, grads, rates, overrides, by_hand=False)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if "schedule" not in str(exc).lower():
            raise
        return warned(
            f"the class refuses {driver.schedule_name} with a clear error ({ctx.describe_error(exc)}), so no "
            "schedule can be used with it",
            where=method_location(ctx, "__init__"),
            fix=f"accept a schedule and {driver.advice.read_lr_each_step}; until then, set the rate by hand "
            "between steps",
        )
    by_hand = _updates(ctx, grads, rates, overrides, by_hand=True)
    decay_note = (
        " (weight_decay set to 0 for this check: decay need not follow the rate)" if overrides else ""
    )
    shown = [round(r, 8) for r in rates]
    fix = driver.advice.read_lr_each_step
    moved = [max(float(np.max(np.abs(d))) for d in update) > 0 for update in scheduled]
    # A rate read once (at construction, or on the first step) and kept: the schedule never reaches
    # the update, which then equals the same optimizer's at that constant rate.
    for constant_rate in dict.fromkeys((ctx.lr, rates[0])):
        constant = _updates(ctx, grads, [constant_rate] * len(rates), overrides, by_hand=True)
        if all(max_diff(a, b) == 0 for a, b in zip(scheduled, constant, strict=True)):
            still = "; every step left every variable unchanged" if not any(moved) else ""
            return failed(
                f"with {driver.schedule_name} of rates {shown} every update was bitwise the same as at a "
                f"constant rate of {constant_rate:g}: a schedule is never applied{still}{decay_note}",
                where=method_location(ctx),
                fix=fix,
            )
    moved = [max(float(np.max(np.abs(d))) for d in update) > 0 for update in scheduled]
    on_time = [rate > 0 for rate in rates]
    late = [rates[max(step - 1, 0)] > 0 for step in range(len(rates))]
    if moved != on_time and moved == late and zero_rate_ok:
        return passed(
            f"the update follows {driver.schedule_name} one step late (the rate applied is derived from the "
            "previous step's, as in averaging optimizers such as ASGD); zero-rate steps moved nothing"
            f"{decay_note}"
        )
    wrong = [
        f"step {step} (rate {rate:g}) " + ("moved the variables" if move else "left every variable unchanged")
        for step, (rate, move, expected) in enumerate(zip(rates, moved, on_time, strict=True))
        if move != expected
    ]
    worst = max(max_diff(a, b) for a, b in zip(scheduled, by_hand, strict=True))
    wrong += [
        f"after step {step} the update differs by {max_diff(a, b):.3g} from the same optimizer with its rate "
        f"set to {rates[step]:g} by hand"
        for step, (a, b) in enumerate(zip(scheduled, by_hand, strict=True))
        if not _close(a, b)
    ]
    if wrong:
        return failed(
            f"{driver.schedule_name} of rates {shown} was not followed: {wrong[0]}{decay_note}",
            where=method_location(ctx),
            figure=worst,
            fix=fix,
        )
    zero_note = (
        "zero-rate steps left the variables alone"
        if zero_rate_ok
        else "rates kept above 0: a step at rate 0 gives non-finite values in this optimizer (e.g. FTRL)"
    )
    return passed(
        f"{driver.schedule_name} was applied at each of {len(rates)} steps ({zero_note}) and matched the "
        f"rate set by hand each step{decay_note}",
        figure=worst,
    )


def _updates(
    ctx: CheckContext,
    grads: Sequence[Sequence[np.ndarray]],
    rates: Sequence[float],
    overrides: Mapping[str, Any],
    *,
    by_hand: bool,
) -> list[list[np.ndarray]]:
    """What each step changed, with the rates scheduled the style's way or set by hand."""
    driver = ctx.driver
    lr_arg = ctx.target.entry.lr_arg
    variables = driver.variables(arrays(SHAPES, seed=0, mean=1.0))
    before_step: Callable[[int], None]
    if by_hand:
        optimizer = driver.optimizer_over(lambda params: ctx.build(params, **overrides), variables)
        before_step = functools.partial(_set_rate, driver, optimizer, rates, lr_arg)
    else:

        def create(params: Any, learning_rate: Any) -> Any:
            return ctx.build(params, learning_rate=learning_rate, **overrides)

        optimizer, before_step = driver.scheduled(create, variables, rates, lr_arg)
    updates = []
    for step, step_grads in enumerate(grads):
        before_step(step)
        before = driver.values(variables)
        driver.step(optimizer, variables, step_grads)
        updates.append([a - b for a, b in zip(driver.values(variables), before, strict=True)])
    return updates


def _set_rate(driver: Driver, optimizer: Any, rates: Sequence[float], lr_arg: str, step: int) -> None:
    driver.set_learning_rate(optimizer, rates[step], lr_arg)


def _close(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Equal up to float32 rounding: a schedule and a rate set by hand take different code paths."""
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def _takes_a_zero_rate(ctx: CheckContext, overrides: Mapping[str, Any]) -> bool:
    """Whether a step at learning rate 0 stays finite: FTRL divides by the rate, so the zero-rate
    steps would compare NaN with NaN for it."""
    driver = ctx.driver
    try:
        optimizer, variables = fresh(ctx, **overrides)
        driver.set_learning_rate(optimizer, 0.0, ctx.target.entry.lr_arg)
        driver.step(optimizer, variables, arrays(SHAPES, seed=10))
    except Exception:
        return False
    return all(bool(np.all(np.isfinite(value))) for value in driver.values(variables))


def _without_weight_decay(ctx: CheckContext) -> dict[str, Any]:
    """`weight_decay=0` when the class has one and allows 0: decay not scaled by the learning rate
    is a legitimate design, and would blur a check about the learning rate."""
    param = ctx.target.entry.params.get("weight_decay")
    if param is None or param.type not in ("float", "number"):
        return {}
    try:
        param.check(0.0)
    except ValueError:
        return {}
    return {"weight_decay": 0.0}


# -- sparse ------------------------------------------------------------------------------------------

TABLE_SHAPE = (10, 4)


@isolated
def check_sparse(ctx: CheckContext) -> Outcome:
    """Unique rows first (the plain case), then a second step elsewhere to see whether rows the
    gradient did not touch move, then a repeated id (as an Embedding batch has)."""
    driver = ctx.driver
    first_rows, second_rows, repeated_rows = [1, 3], [6, 8], [2, 5, 5]
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    start = driver.values(table)[0]
    try:
        _sparse_step(ctx, optimizer, table, _rows(first_rows, seed=20))
    except Exception as exc:
        return _sparse_refusal(ctx, exc)
    after_first = driver.values(table)[0]
    diff = _sparse_vs_dense(ctx, _rows(first_rows, seed=20), after_first)
    if not np.all(np.isfinite(after_first)) or diff > 0:
        return failed(
            f"the rows a row-sparse gradient ({driver.sparse_gradient_name}) touches differ by up to "
            f"{diff:.3g} from the same optimizer on the equivalent dense gradient",
            where=method_location(ctx),
            figure=diff,
            fix=driver.advice.sparse_update,
        )
    _sparse_step(ctx, optimizer, table, _rows(second_rows, seed=21))
    densified = _rows_changed(start, after_first, exclude=first_rows) | _rows_changed(
        after_first, driver.values(table)[0], exclude=second_rows
    )
    repeated_optimizer, repeated_table = fresh(ctx, (TABLE_SHAPE,))
    _sparse_step(ctx, repeated_optimizer, repeated_table, _rows(repeated_rows, seed=22))
    repeated_diff = _sparse_vs_dense(ctx, _rows(repeated_rows, seed=22), driver.values(repeated_table)[0])
    repeats = (
        f"with a repeated index (ids {repeated_rows}) the touched rows differ by up to {repeated_diff:.3g} "
        "from the dense gradient, which sums the repeats"
    )
    if repeated_diff > 0 and driver.capabilities.sums_repeated_rows:
        return failed(
            repeats + " (the framework's own optimizers sum them first)",
            where=method_location(ctx),
            figure=repeated_diff,
            fix=driver.advice.sparse_update,
        )
    notes = []
    if repeated_diff > 0:
        notes.append(repeats + " (the framework's own Adam and RMSprop square each repeat separately too)")
    if densified:
        notes.append(
            f"densifies: {len(densified)} of {TABLE_SHAPE[0]} rows the gradient did not touch changed too: "
            "the update touches the whole table every step (O(table) work, e.g. momentum or weight decay on "
            "all rows)"
        )
    if notes:
        return warned(
            "sparse gradients work, but " + "; ".join(notes),
            where=method_location(ctx),
            figure=float(len(densified)) if densified else repeated_diff,
            fix=(
                "sum repeated indices first (unique + segment sum) before squaring or taking signs; "
                if repeated_diff > 0
                else ""
            )
            + "for large embeddings update only the touched rows (gather, compute, scatter: LazyAdam-style), "
            "weight decay included",
        )
    return passed(
        f"row-sparse gradients ({driver.sparse_gradient_name}), repeated ids too, update only the rows they "
        "touch, and those match the dense computation (figure: rows changed outside the gradient)",
        0.0,
    )


def _rows(rows: list[int], seed: int) -> SparseRows:
    return SparseRows(rows=rows, values=arrays([(len(rows), TABLE_SHAPE[1])], seed)[0], shape=TABLE_SHAPE)


def _dense(grad: SparseRows) -> np.ndarray:
    dense = np.zeros(grad.shape, np.float32)
    np.add.at(dense, grad.rows, grad.values)
    return dense


def _sparse_step(ctx: CheckContext, optimizer: Any, table: list[Any], grad: SparseRows) -> None:
    with warnings.catch_warnings():  # the framework's notes on sparse tensors are not the user's
        warnings.simplefilter("ignore")
        ctx.driver.step(optimizer, table, [grad])


def _sparse_vs_dense(ctx: CheckContext, grad: SparseRows, sparse_result: np.ndarray) -> float:
    """How far the touched rows after one sparse step are from the same optimizer's dense step
    (0 when within float32 rounding)."""
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    ctx.driver.step(optimizer, table, [_dense(grad)])
    touched = sorted(set(grad.rows))
    dense = ctx.driver.values(table)[0][touched]
    if np.allclose(sparse_result[touched], dense, rtol=1e-5, atol=1e-6):
        return 0.0
    return float(np.max(np.abs(sparse_result[touched].astype(np.float64) - dense)))


def _rows_changed(before: np.ndarray, after: np.ndarray, *, exclude: list[int]) -> set[int]:
    changed = np.nonzero(np.any(before != after, axis=1))[0]
    return {int(row) for row in changed} - set(exclude)


def _sparse_refusal(ctx: CheckContext, error: Exception) -> Outcome:
    """A deliberate `raise` that mentions sparse gradients, in the class's own code (or the
    framework's optimizers'), is a clear refusal; anything else is an error from deep inside an op."""
    driver = ctx.driver
    frames = traceback.extract_tb(error.__traceback__)
    deepest = frames[-1] if frames else None
    own = deepest is not None and deepest.filename in driver.refusal_files(ctx.target.cls)
    statement = (deepest.line or "").lstrip() if deepest is not None else ""
    message = str(error).lower()
    about_sparse = "sparse" in message or "indexedslices" in message
    if own and about_sparse and statement.startswith("assert"):
        return failed(
            f"refuses sparse gradients with an assert, not a raise ({ctx.describe_error(error)}): python -O "
            "strips asserts, and then the sparse gradient runs into the dense math",
            where=user_line(ctx, error),
            fix=driver.advice.sparse_update,
        )
    if own and about_sparse:
        if ctx.target.entry.supports_sparse:
            return failed(
                f"the class declares optlab_supports_sparse but refuses sparse gradients: "
                f"{ctx.describe_error(error)}",
                where=user_line(ctx, error),
                fix="support sparse gradients or drop optlab_supports_sparse",
            )
        return passed(f"refuses sparse gradients with a clear error: {ctx.describe_error(error)}")
    return failed(
        f"a row-sparse gradient ({driver.sparse_gradient_name}) crashed inside the update: "
        f"{ctx.describe_error(error)}",
        where=user_line(ctx, error),
        fix=driver.advice.sparse_update,
    )


# -- config_roundtrip --------------------------------------------------------------------------------


@isolated
def check_config_roundtrip(ctx: CheckContext) -> Outcome:
    """Every hyperparameter is where the style serializes it, with the value it was built with
    (the learning rate halved, so a stored default cannot pass for it), and comes back from the
    style's round trip into an optimizer built with other values; with a schedule object too
    where the style has them."""
    driver = ctx.driver
    problem = _config_problem(ctx, schedule=False)
    if problem is not None:
        return problem
    count = len(ctx.target.entry.params)
    where_kept = f"{driver.config_name} carries all {count} hyperparameters with their values and survives"
    if not driver.capabilities.schedule_objects:
        return passed(f"{where_kept} {driver.config_roundtrip_name}", float(count))
    try:
        problem = _config_problem(ctx, schedule=True)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if "schedule" not in str(exc).lower():
            raise
        return passed(
            f"{where_kept} {driver.config_roundtrip_name} (not tried with {driver.schedule_name}, which the "
            f"class refuses: {ctx.describe_error(exc)})",
            float(count),
        )
    if problem is not None:
        return problem
    return passed(
        f"{where_kept} {driver.config_roundtrip_name}, with a plain rate and with {driver.schedule_name}",
        float(count),
    )


def _config_problem(ctx: CheckContext, *, schedule: bool) -> Outcome | None:
    driver = ctx.driver
    lr_arg = ctx.target.entry.lr_arg
    expected = {_native(ctx, k): v for k, v in with_defaults(ctx.target, ctx.params).items()}
    expected[lr_arg] = ctx.lr * 0.5
    learning_rate = driver.learning_rate_schedule(ctx.lr * 0.5) if schedule else None
    with_what = f" (built with {driver.schedule_name})" if schedule else ""
    optimizer, variables = fresh(ctx, learning_rate=learning_rate, lr=ctx.lr * 0.5)
    driver.step(optimizer, variables, arrays(SHAPES, seed=30))  # legacy: hyperparameters now variables
    if schedule:
        del expected[lr_arg]  # serialized as the schedule, compared with the round trip below
    fix = driver.advice.keep_hyperparameters
    where = method_location(ctx, "__init__")
    try:
        built = driver.config(optimizer)
        problems = _missing(driver.config_name, built, expected, f"after construction{with_what}")
        if problems:
            return failed("; ".join(problems), where=where, fix=fix)
        reloaded = driver.config_roundtrip(optimizer, lambda: fresh(ctx, seed=1)[0])
    except ConfigNotSerialized as exc:
        return failed(f"{exc}{with_what}", where=where, fix=exc.fix)
    when = f"after {driver.config_roundtrip_name}{with_what}"
    problems = _missing(driver.config_name, reloaded, expected, when)
    for index, (first, again) in enumerate(zip(built, reloaded, strict=True)):
        differing = sorted(
            k for k in first.keys() | again.keys() if not same_value(first.get(k), again.get(k))
        )
        if differing and not problems:
            key = differing[0]
            problems.append(
                f"{driver.config_name}[{index}][{key!r}] was {first.get(key)!r} and is {again.get(key)!r} "
                f"{when}" + (f" ({len(differing) - 1} more keys)" if len(differing) > 1 else "")
            )
    if problems:
        return failed("; ".join(problems), where=where, fix=fix)
    return None


def _missing(
    config_name: str, configs: Sequence[Mapping[str, Any]], expected: Mapping[str, Any], when: str
) -> list[str]:
    """Comparing a config with its reload cannot see an argument missing from both: a reloaded
    optimizer would silently use its default. So each built value is looked for by name."""
    problems = []
    for name, value in expected.items():
        for index, config in enumerate(configs):
            if name not in config:
                problems.append(
                    f"hyperparameter {name!r} is not in {config_name}[{index}] {when}; a reloaded optimizer "
                    "would silently use its default"
                )
                break
            if not same_value(config[name], value):
                problems.append(
                    f"{config_name}[{index}][{name!r}] is {config[name]!r} {when}, expected {value!r}"
                )
                break
    return problems


def same_value(actual: Any, expected: Any) -> bool:
    """Equal as hyperparameters: one-element tensors and numpy scalars as numbers, floats to
    float32 precision (legacy Keras stores them as float32 variables), lists as tuples."""
    if hasattr(actual, "item") and getattr(actual, "size", 1) in (1, None) and np.ndim(actual) == 0:
        actual = actual.item()
    if isinstance(actual, Mapping) and isinstance(expected, Mapping):
        return actual.keys() == expected.keys() and all(same_value(actual[k], expected[k]) for k in actual)
    if isinstance(expected, tuple | list) and isinstance(actual, tuple | list):
        return len(actual) == len(expected) and all(
            same_value(a, e) for a, e in zip(actual, expected, strict=True)
        )
    numbers = (int, float)
    if isinstance(expected, float) and isinstance(actual, numbers) and not isinstance(actual, bool):
        return math.isclose(actual, expected, rel_tol=1e-6) or (math.isnan(actual) and math.isnan(expected))
    return bool(actual == expected)


# -- state_roundtrip ---------------------------------------------------------------------------------


@isolated
def check_state_roundtrip(ctx: CheckContext) -> Outcome:
    """Save after 3 steps, restore into a never-stepped optimizer over equal variables: the state
    must come back equal, and the next step bitwise equal to the uninterrupted one (which catches
    state the save never sees, since both copies would lack it alike)."""
    driver = ctx.driver
    overrides = ctx.stateful_overrides()
    optimizer, variables = fresh(ctx, **overrides)
    for seed in (40, 41, 42):
        driver.step(optimizer, variables, arrays(SHAPES, seed))
    saved = driver.save_state(optimizer, variables, ctx.workdir / "state_roundtrip")
    # A never-stepped optimizer over variables equal to the saved ones, as a resumed job builds it.
    restored_variables = driver.variables(driver.values(variables))
    restored = driver.optimizer_over(lambda params: ctx.build(params, **overrides), restored_variables)
    try:
        driver.restore_state(restored, restored_variables, saved)
    except StateNotRestored as exc:
        return failed(str(exc), where=method_location(ctx), fix=exc.fix)
    fix = driver.advice.state_in_checkpoint
    found = driver.state_difference(optimizer, restored)
    if found:
        return failed(f"the restored optimizer's state differs: {found}", where=method_location(ctx), fix=fix)
    grads = arrays(SHAPES, seed=43)
    driver.step(optimizer, variables, grads)
    driver.step(restored, restored_variables, grads)
    diff = max_diff(
        driver.values(variables) + [v for _, v in driver.state(optimizer)],
        driver.values(restored_variables) + [v for _, v in driver.state(restored)],
    )
    if diff > 0:
        return failed(
            f"the restored state matched, but the next step after reloading differs from the uninterrupted "
            f"one by up to {diff:.3g}: with equal saved state, a next step differs only when the optimizer "
            "keeps state the save does not see (a Python attribute, a dict of tensors it does not track)",
            where=method_location(ctx),
            figure=diff,
            fix=fix,
        )
    count = len(driver.state(optimizer))
    return passed(
        f"{driver.state_format} into a fresh optimizer: {count} state tensors identical and the next step "
        f"bitwise equal{overrides_note(overrides)}",
        0.0,
    )


# -- device_placement --------------------------------------------------------------------------------


@isolated
def check_device_placement(ctx: CheckContext) -> Outcome:
    """State next to its variable on an accelerator, after steps and after a restore that loads
    the saved state onto the host first (as a job resumed on another machine does)."""
    driver = ctx.driver
    if driver.accelerator() is None:
        return skipped(driver.no_accelerator)
    overrides = ctx.stateful_overrides()
    with _on_accelerator(driver):
        optimizer, variables = fresh(ctx, **overrides)
        for seed in (70, 71):
            driver.step(optimizer, variables, arrays(SHAPES, seed))
    misplaced = driver.misplaced_state(optimizer, variables)
    if misplaced:
        return failed(
            f"{len(misplaced)} state tensors on the wrong device after 2 steps: {'; '.join(misplaced[:4])}",
            where=method_location(ctx),
            figure=float(len(misplaced)),
            fix=driver.advice.state_on_device,
        )
    saved = driver.save_state(optimizer, variables, ctx.workdir / "device_placement")
    with _on_accelerator(driver):
        restored, restored_variables = fresh(ctx, **overrides)
        driver.restore_state(restored, restored_variables, saved)
        driver.step(restored, restored_variables, arrays(SHAPES, seed=72))
    misplaced = driver.misplaced_state(restored, restored_variables)
    if misplaced:
        return failed(
            f"after {driver.state_format} (loaded onto the host) into an optimizer on the accelerator, "
            f"{len(misplaced)} state tensors sit on the wrong device: {'; '.join(misplaced[:4])}",
            where=method_location(ctx),
            figure=float(len(misplaced)),
            fix=driver.advice.state_on_device_after_restore,
        )
    return passed(
        "state sits on its variable's device after steps on the accelerator and after a restore loaded "
        f"onto the host{overrides_note(overrides)}",
        0.0,
    )


def _on_accelerator(driver: Driver) -> AbstractContextManager[Any]:
    """A new scope each time: a framework's device scope need not be re-entrant."""
    scope = driver.accelerator()
    assert scope is not None, "checked before"
    return scope


# -- state_untrainable -------------------------------------------------------------------------------


@isolated
def check_state_untrainable(ctx: CheckContext) -> Outcome:
    driver = ctx.driver
    overrides = ctx.stateful_overrides()
    optimizer, variables = fresh(ctx, **overrides)
    for seed in (90, 91):
        driver.step(optimizer, variables, arrays(SHAPES, seed))
    count, offending = driver.trainable_state(optimizer, variables)
    if offending:
        return failed(
            f"{len(offending)} of {count} optimizer state tensors are trainable or are the trained "
            f"variables: {'; '.join(offending[:4])}; a tape or autograd watches them and a model or "
            "strategy may treat them as weights",
            where=method_location(ctx),
            figure=float(len(offending)),
            fix=driver.advice.untrainable_state,
        )
    if not count:
        return passed(f"the optimizer keeps no state tensors{overrides_note(overrides)}", 0.0)
    return passed(
        f"none of {count} optimizer state tensors is trainable or one of the trained variables"
        f"{overrides_note(overrides)}",
        0.0,
    )


# -- step_cost ---------------------------------------------------------------------------------------


@isolated
def check_step_cost(ctx: CheckContext) -> Outcome:
    """The update's time against the framework's SGD(momentum=0.9) on the same variables."""
    driver = ctx.driver
    shapes = driver.cost_shapes
    grads = arrays(shapes, seed=100)
    with driver.timing():
        try:
            optimizer, variables = fresh(ctx, shapes, seed=101)
            candidate = driver.timed_update(optimizer, variables, grads)
        except Exception as exc:
            return skipped(f"not measurable: {driver.timed_update_name} raised {ctx.describe_error(exc)}")
        reference_variables = driver.variables(arrays(shapes, seed=101, mean=1.0))
        reference = driver.timed_update(driver.reference_sgd(reference_variables), reference_variables, grads)
        ours, theirs = interleaved_best(candidate, reference)
        if ours / theirs > STEP_COST_LIMIT:  # a busy machine can fake one slow round: measure once more
            ours, theirs = min(
                (ours, theirs), interleaved_best(candidate, reference), key=lambda t: t[0] / t[1]
            )
        ratio = ours / theirs
        slow = ratio > STEP_COST_LIMIT
        where_time_goes = driver.where_time_goes(candidate, reference) if slow else ""
    timing = (
        f"{driver.timed_update_name} takes {ours * 1e3:.3g} ms, {driver.reference_sgd_name} "
        f"{theirs * 1e3:.3g} ms on {sum(math.prod(s) for s in shapes):,} parameters"
    )
    if not slow:
        return passed(f"{timing} (figure: ratio)", ratio)
    return warned(
        f"{timing}: {ratio:.1f}x; {where_time_goes}",
        where=method_location(ctx),
        figure=ratio,
        fix=driver.advice.fast_update,
    )


def interleaved_best(
    first: Callable[[], Any], second: Callable[[], Any], *, budget_s: float = 1.0
) -> tuple[float, float]:
    """The fastest call of each, timed in alternating rounds so that load from other processes
    hits both alike: the fastest is the sample least hurt by it. A very slow update needs
    fewer samples to say so."""
    best = [math.inf, math.inf]
    spent = [0.0, 0.0]
    for _ in range(7):
        for index, run in enumerate((first, second)):
            for _ in range(15):
                started = time.perf_counter()
                run()
                took = time.perf_counter() - started
                best[index], spent[index] = min(best[index], took), spent[index] + took
                if spent[index] > budget_s:
                    break
        if max(spent) > budget_s:
            break
    return best[0], best[1]


# -- deprecations ------------------------------------------------------------------------------------


@isolated
def check_deprecations(ctx: CheckContext) -> Outcome:
    """Building, two steps and reading the state: each deprecation warning the class's own code
    triggers is a `warn` at its line; ones raised by framework code alone are not the class's."""
    driver = ctx.driver
    found: list[tuple[str, str]] = []  # (message, the user's line or "")

    def record(
        message: str, category: type[Warning] | None, filename: str | None, lineno: int | None
    ) -> None:
        if is_deprecation(category, message):
            found.append((" ".join(message.split()), _line_in_user_file(ctx, filename, lineno)))

    with driver.recording_warnings(record):
        optimizer, variables = fresh(ctx, **ctx.stateful_overrides())
        for seed in (110, 111):
            driver.step(optimizer, variables, arrays(SHAPES, seed))
        driver.state(optimizer)
    located = [(message, where) for message, where in found if where]
    if not located:
        other = f"; {len(found)} raised by framework code outside the class were ignored" if found else ""
        return passed(f"building and two steps raised no deprecation warning from the class{other}", 0.0)
    message, where = located[0]
    return warned(
        f"{len(located)} deprecation warning(s) from the class's code, first: {message[:200]}",
        where=where,
        figure=float(len(located)),
        fix=f"switch to the replacement the warning names (e.g. {driver.advice.deprecated_call}) before a "
        "framework upgrade removes the old call",
    )


def is_deprecation(category: type[Warning] | None, message: str) -> bool:
    """The one deprecation filter: the warning classes for it, or a message that says so."""
    deprecated = category is not None and issubclass(category, DeprecationWarning | FutureWarning)
    return deprecated or "deprecat" in message.lower()


def _line_in_user_file(ctx: CheckContext, filename: str | None, lineno: int | None) -> str:
    """The user's line responsible: the warning's own location when it is there, else the
    innermost frame of the current stack inside the class's file."""
    source = ctx.target.source_file()
    if source is None:
        return ""
    if filename == source and lineno is not None:
        return f"{source}:{lineno}"
    frames = [f for f in traceback.extract_stack() if f.filename == source]
    return f"{source}:{frames[-1].lineno}" if frames else ""


CHECKS: Mapping[str, CheckFunction] = {
    "construct": check_construct,
    "dense_step": check_dense_step,
    "descends": check_descends,
    "none_grads": check_none_grads,
    "schedule": check_schedule,
    "sparse": check_sparse,
    "config_roundtrip": check_config_roundtrip,
    "state_roundtrip": check_state_roundtrip,
    "device_placement": check_device_placement,
    "state_untrainable": check_state_untrainable,
    "step_cost": check_step_cost,
    "deprecations": check_deprecations,
}
