"""schedule and sparse: the rate a schedule sets, and row-sparse gradients, written once over
the drivers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.tools import (
    MOVES_NOTHING,
    SHAPES,
    SPARSE_METHODS,
    SPARSE_WORDS,
    WARMUP_STEPS,
    CheckFunction,
    arrays,
    clear_refusal,
    fresh,
    isolated,
    made_non_finite,
    max_diff,
    method_location,
    non_finite,
    non_finite_update,
    own_code,
    raised_in,
    reached_user_code,
    refusal_files,
    refused_rate,
    refuses_dense,
    same_draws,
    shape_text,
    still_steps,
    update_made_non_finite,
    updates_nothing,
    user_line,
    user_method_lines,
    wrong_signature,
)
from jobs.frameworks.base import Driver, ScheduleUnreachable, SparseRows, raising_frame
from optimizers.loop_needs import user_classes

# -- schedule ----------------------------------------------------------------------------------------

# Multiples of the learning rate for steps 0..4: zero on some steps, so an optimizer that
# reads the rate once (in __init__, build or the first step) instead of every step is caught.
SCHEDULE_FACTORS = (0.0, 1.0, 0.0, 2.0, 0.5)
# Where a rate of 0 is outside what the optimizer can take (FTRL divides by it): every step
# must move, and differently from a constant rate.
POSITIVE_SCHEDULE_FACTORS = (1.0, 0.5, 2.0, 0.25, 1.0)
# How a run is given its rates: the style's schedule, the rate set by hand between steps, or (styles
# with schedule objects) a schedule object whose rate is set by hand between steps.
SCHEDULED, BY_HAND, HAND_FED = "scheduled", "by hand", "hand-fed schedule"


@isolated
def check_schedule(ctx: CheckContext) -> Outcome:
    """The rate the style's schedule sets must be the one applied at every step: zero-rate steps
    move nothing, the others move, and the result equals the rate set by hand each step. One
    step of lag is allowed: averaging optimizers (torch's ASGD) apply a rate derived from the
    previous step's."""
    if updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    if not ctx.has_lr and ctx.rate_in_groups() is None:
        groups = ", and no `lr` given to it lands in its param groups" if ctx.target.style == "torch" else ""
        return skipped(
            f"not meaningful: the class takes no learning rate (its constructor declares none{groups}), so "
            "there is no rate to schedule"
        )
    refused = refused_rate(ctx)
    if refused is not None:
        return skipped(
            "not meaningful: with these hyperparameters the class refuses a learning rate "
            f"({ctx.describe_error(refused)}): it sets its own step size, so there is no rate to schedule"
        )
    driver = ctx.driver
    overrides = _without_weight_decay(ctx)
    zero_rate_ok = _takes_a_zero_rate(ctx, overrides)
    rates = [ctx.lr * f for f in (SCHEDULE_FACTORS if zero_rate_ok else POSITIVE_SCHEDULE_FACTORS)]
    # Steps that only build state come first at the base rate, in every run compared, so the
    # schedule's steps are judged like for like; they are left out of the comparison.
    warmup = still_steps(ctx, **overrides)
    # One step more than the schedule: the perturbation runs below need one after the last rate.
    grads = [arrays(SHAPES, seed=10 + step) for step in range(warmup + len(rates) + 1)]
    updates = functools.partial(_updates, ctx, grads[:-1], overrides=overrides, warmup=warmup)
    try:
        scheduled = updates(rates, how=SCHEDULED)
    except ScheduleUnreachable as exc:
        if _ignores_its_rate(ctx, grads[:-1], overrides):  # a rate argument kept for show (A2Grad)
            return skipped(f"not meaningful: the update does not depend on {ctx.target.entry.lr_arg} at all")
        if _own_step_size_at_none(ctx):
            return _judged_given_a_rate(ctx)
        return failed(str(exc), where=method_location(ctx, "__init__"), fix=exc.fix)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if not _names_a_schedule(exc):
            return failed(
                f"built with {driver.schedule_name} (as a job builds it, with its schedule) the class "
                f"crashes: {ctx.describe_error(exc)}",
                where=user_line(ctx, exc),
                fix=f"accept a schedule and {driver.advice.read_lr_each_step}",
            )
        return warned(
            f"the class refuses {driver.schedule_name} with a clear error ({ctx.describe_error(exc)}), so no "
            "schedule can be used with it",
            where=method_location(ctx, "__init__"),
            fix=f"accept a schedule and {driver.advice.read_lr_each_step}; until then, set the rate by hand "
            "between steps",
        )
    miscounted = _counts_iterations_itself(ctx)
    if miscounted is not None:  # the schedule is then asked at the wrong step: the cause, not a cached rate
        return miscounted
    by_hand = updates(rates, how=BY_HAND)
    unbounded = _non_finite_in(scheduled)
    if unbounded and update_made_non_finite(ctx):  # neither way of setting the rate is then at fault
        return non_finite_update(
            ctx,
            f"steps under {driver.schedule_name} end with non-finite values",
            unbounded,
            regardless="whatever sets the rate",
        )
    decay_note = (
        " (weight_decay set to 0 for this check: decay need not follow the rate)" if overrides else ""
    )
    if warmup:
        decay_note += f" (after {warmup} warm-up step(s) at the base rate that only built state)"
    shown = [round(r, 8) for r in rates]
    fix = driver.advice.read_lr_each_step

    def not_followed(why: str, figure: float | None) -> Outcome:
        return failed(
            f"{driver.schedule_name} of rates {shown} was not followed: {why}{decay_note}",
            where=method_location(ctx),
            figure=figure,
            fix=fix,
        )

    moved = [max(float(np.max(np.abs(d))) for d in update) > 0 for update in scheduled]
    # A rate read once (at construction, or on the first step) and kept: the schedule never reaches
    # the update, which then equals the same optimizer's at that constant rate.
    for constant_rate in dict.fromkeys((ctx.lr, rates[0])):
        constant = updates([constant_rate] * len(rates), how=BY_HAND)
        if all(max_diff(a, b) == 0 for a, b in zip(scheduled, constant, strict=True)):
            if _ignores_its_rate(ctx, grads[:-1], overrides):
                return skipped(
                    "not meaningful: with these hyperparameters the update does not depend on "
                    f"{ctx.target.entry.lr_arg} at all (built with {ctx.lr:g} and {2 * ctx.lr:g}, every "
                    "update is bitwise the same: a relative or learning-rate-free step), so there is no rate "
                    f"for a schedule to set{decay_note}"
                )
            still = "; every step left every variable unchanged" if not any(moved) else ""
            return failed(
                f"with {driver.schedule_name} of rates {shown} every update was bitwise the same as at a "
                f"constant rate of {constant_rate:g}: a schedule is never applied{still}{decay_note}",
                where=method_location(ctx),
                fix=fix,
            )
    on_time = [rate > 0 for rate in rates]
    late = [rates[max(step - 1, 0)] > 0 for step in range(len(rates))]
    if moved != on_time and moved == late and zero_rate_ok:
        return passed(
            f"the update follows {driver.schedule_name} one step late (the rate applied is derived from the "
            "previous step's, as in averaging optimizers such as ASGD); zero-rate steps moved nothing"
            f"{decay_note}"
        )
    differing = _differing(scheduled, by_hand, rates)
    hand_set_differs = None
    if differing and driver.capabilities.schedule_objects:
        # The class may keep rates of its own (per variable group) that a schedule reaches and a rate
        # set by hand does not: then the same rates fed through a schedule object give its steps.
        hand_fed = updates(rates, how=HAND_FED)
        if not _differing(scheduled, hand_fed, rates):
            hand_set_differs, by_hand, differing = differing[0], hand_fed, []
    matched = (
        "matched the rate set by hand each step"
        if hand_set_differs is None
        else "matched the same rates set by hand in a schedule object each step"
    )
    worst = max(max_diff(a, b) for a, b in zip(scheduled, by_hand, strict=True))
    if differing:
        return not_followed(differing[0], worst)

    def followed(detail: str, figure: float) -> Outcome:
        if hand_set_differs is None:
            return passed(detail, figure)
        return warned(
            f"{detail}; but a rate set by hand between steps ({driver.rate_set_by_hand}) is not the rate "
            f"the class steps with: {hand_set_differs}. The class keeps a rate of its own that a schedule "
            "reaches and the hand-set rate does not",
            where=method_location(ctx),
            figure=figure,
            fix="derive every rate the class keeps from the one learning rate each step, or say in its "
            "documentation how to set them; optlab's jobs pass a schedule object, which it follows",
        )

    still_moving = [
        step
        for step, (move, expected) in enumerate(zip(moved, on_time, strict=True))
        if move and not expected
    ]
    if still_moving:
        # Momentum or averaging that carries earlier rates (LaProp's lr inside exp_avg, MADGRAD's
        # dual averaging, parameter averaging): judged on the part the schedule drives, i.e. every
        # step's rate must change what follows.
        ignored = _ignored_rates(ctx, grads, rates, overrides, warmup)
        if ignored:
            return not_followed(ignored[0], None)
        return followed(
            f"{driver.schedule_name} reached every step: zero-rate step(s) {still_moving} still moved, "
            "which the optimizer's own momentum or averaging of earlier rates explains, and changing any one "
            f"step's rate changes the result; {matched}{decay_note}",
            worst,
        )
    still_at_rate = [
        f"step {step} (rate {rate:g}) left every variable unchanged"
        for step, (rate, move, expected) in enumerate(zip(rates, moved, on_time, strict=True))
        if expected and not move
    ]
    if still_at_rate:
        return not_followed(still_at_rate[0], worst)
    zero_note = (
        "zero-rate steps left the variables alone"
        if zero_rate_ok
        else "rates kept above 0: a step at rate 0 raises or gives non-finite values in this optimizer "
        "(FTRL divides by the rate)"
    )
    return followed(
        f"{driver.schedule_name} was applied at each of {len(rates)} steps ({zero_note}) and {matched}"
        f"{decay_note}",
        worst,
    )


# A Keras class writing the step count Keras keeps (`self.iterations.assign_add(1)` in update_step).
_WRITES_ITERATIONS = re.compile(r"\biterations\.assign(?:_add|_sub)?\(")
COUNTED_STEPS = 3


def _counts_iterations_itself(ctx: CheckContext) -> Outcome | None:
    """A Keras class that writes `self.iterations`, which Keras increments once per apply(): where its
    steps then count other than the applies made, the schedule is asked at the wrong step (and bias
    corrections and warm-ups read the wrong count). Judged only where the class's own source writes it,
    at that line."""
    driver = ctx.driver
    written_at = _iterations_written_at(ctx)
    if written_at is None:
        return None
    try:
        optimizer, variables = fresh(ctx)
        for step in range(COUNTED_STEPS):
            driver.step(optimizer, variables, arrays(SHAPES, seed=90 + step), ctx.needs)
        counts = driver.framework_step_count(optimizer, COUNTED_STEPS)
    except Exception:  # a step that raises is dense_step's to judge
        return None
    if counts is None:
        return None
    counted, expected = counts
    if counted == expected:
        return None
    return failed(
        f"after {COUNTED_STEPS} steps ({expected} apply() calls) self.iterations is {counted}: the class "
        "changes it itself, and Keras already increments it once per apply(), so a schedule is asked for the "
        "rate of a later step (and bias corrections or warm-ups read the wrong count)",
        where=written_at,
        fix="never assign to self.iterations; where the class needs a count of its own, keep it in a "
        "variable made with self.add_variable in build",
    )


def _iterations_written_at(ctx: CheckContext) -> str | None:
    """`file:line` where the user's class (or a base of theirs) writes `iterations`, if it does."""
    written = (found.where for found in user_method_lines(ctx) if _WRITES_ITERATIONS.search(found.code))
    return next(written, None)


def _own_step_size_at_none(ctx: CheckContext) -> bool:
    """Whether the class, left at its default lr=None (none given), keeps 'lr': None in its groups: it
    computes its own step size then, and a given lr switches it to that rate (timm's Adafactor:
    relative step at lr=None, writing its step size into group['lr'] each step). Built with lr and
    2 lr, as _ignores_its_rate builds it, it is in its other mode: that comparison cannot judge it."""
    declared = ctx.target.entry.params.get("lr")
    if declared is None or declared.default is not None or ctx.params.get("lr") is not None:
        return False
    optimizer, _ = fresh(ctx)
    groups = getattr(optimizer, "param_groups", None) or []  # ScheduleUnreachable is torch's alone
    return any("lr" in group and group["lr"] is None for group in groups)


def _judged_given_a_rate(ctx: CheckContext) -> Outcome:
    """The check of a class that computes its own step size at its lr=None default, run with an lr
    given, the mode a schedule reaches (a rate cached when given still fails), said so."""
    lr_arg, rate = ctx.target.entry.lr_arg, ctx.lr
    said = (
        f"at {lr_arg}=None, the class's default, it computes its own step size (its param groups hold "
        f"'lr': None), so no schedule reaches it; a schedule applies once an {lr_arg} is given, and "
        f"given {lr_arg}={rate:g}: "
    )
    before = ctx.params
    ctx.params = {**before, "lr": rate}
    try:
        outcome = check_schedule(ctx)
    finally:
        ctx.params = before
    return dataclasses.replace(outcome, detail=said + outcome.detail)


def _ignores_its_rate(
    ctx: CheckContext, grads: Sequence[Sequence[np.ndarray]], overrides: Mapping[str, Any]
) -> bool:
    """Built with lr and with 2 lr and never touched again, the updates are bitwise equal: the
    class does not use a learning rate with these hyperparameters (AdaFactor's relative step)."""
    runs = []
    for lr in (ctx.lr, 2 * ctx.lr):
        with same_draws(ctx, seed=5):
            # A rate the constructor takes only through **kwargs is not catalogued: given unvalidated.
            rate = {"lr": lr} if ctx.has_lr else {"learning_rate": lr}
            optimizer, variables = fresh(ctx, **{**overrides, **rate})
            for step_grads in grads:
                ctx.driver.step(optimizer, variables, step_grads, ctx.needs)
            runs.append(ctx.driver.values(variables))
    return max_diff(*runs) == 0


def _ignored_rates(
    ctx: CheckContext,
    grads: Sequence[Sequence[np.ndarray]],
    rates: Sequence[float],
    overrides: Mapping[str, Any],
    warmup: int,
) -> list[str]:
    """The steps whose rate, changed alone, changes nothing by one step after the last."""

    def final(these: Sequence[float]) -> list[np.ndarray]:
        steps = _updates(ctx, grads, [*these, ctx.lr], overrides, warmup, how=BY_HAND)
        return [np.sum(parts, axis=0) for parts in zip(*steps, strict=True)]

    unchanged = final(rates)
    ignored = []
    for step, rate in enumerate(rates):
        other = rate * 2 if rate > 0 else ctx.lr
        if max_diff(final([*rates[:step], other, *rates[step + 1 :]]), unchanged) == 0:
            ignored.append(
                f"setting step {step}'s rate to {other:g} instead of {rate:g} changed nothing, then or later"
            )
    return ignored


def _updates(
    ctx: CheckContext,
    grads: Sequence[Sequence[np.ndarray]],
    rates: Sequence[float],
    overrides: Mapping[str, Any],
    warmup: int,
    *,
    how: str,
) -> list[list[np.ndarray]]:
    """What each step after `warmup` steps at the base rate changed, with the rates given `how`
    (SCHEDULED, BY_HAND or HAND_FED); every run draws the same random numbers."""
    with same_draws(ctx, seed=5):
        return _seeded_updates(ctx, grads, rates, overrides, warmup, how=how)


def _seeded_updates(
    ctx: CheckContext,
    grads: Sequence[Sequence[np.ndarray]],
    rates: Sequence[float],
    overrides: Mapping[str, Any],
    warmup: int,
    *,
    how: str,
) -> list[list[np.ndarray]]:
    driver = ctx.driver
    rates = [ctx.lr] * warmup + list(rates)
    lr_arg = ctx.target.entry.lr_arg
    variables = driver.variables(arrays(SHAPES, seed=0, mean=1.0))
    before_step: Callable[[int], None]

    def create(params: Any, learning_rate: Any) -> Any:
        return ctx.build(params, learning_rate=learning_rate, **overrides)

    if how == BY_HAND:
        plain = _plain_rate(ctx)
        optimizer = driver.optimizer_over(
            lambda params: ctx.build(params, learning_rate=plain, **overrides), variables
        )
        before_step = functools.partial(_set_rate, driver, optimizer, rates, lr_arg)
    elif how == HAND_FED:
        optimizer, before_step = driver.hand_fed_schedule(create, variables, rates, lr_arg)
    else:
        optimizer, before_step = driver.scheduled(create, variables, rates, lr_arg)
    updates = []
    for step, step_grads in enumerate(grads):
        before_step(step)
        before = driver.values(variables)
        driver.step(optimizer, variables, step_grads, ctx.needs)
        updates.append([a - b for a, b in zip(driver.values(variables), before, strict=True)])
    return updates[warmup:]


def _non_finite_in(updates: Sequence[Sequence[np.ndarray]]) -> list[str]:
    """The variables (by shape) whose update in some step holds a NaN or an infinity."""
    return [
        f"variable {shape_text(SHAPES[i])}"
        for i in range(len(SHAPES))
        if any(non_finite(np.asarray(update[i])) for update in updates)
    ]


def _differing(
    scheduled: Sequence[Sequence[np.ndarray]],
    reference: Sequence[Sequence[np.ndarray]],
    rates: Sequence[float],
) -> list[str]:
    """The steps whose update differs beyond rounding from the reference run's, in words."""
    return [
        f"after step {step} the update differs by {max_diff(a, b):.3g} from the same optimizer with its rate "
        f"set to {rates[step]:g} by hand"
        for step, (a, b) in enumerate(zip(scheduled, reference, strict=True))
        if not _close(a, b)
    ]


def _names_a_schedule(error: Exception) -> bool:
    """Whether the error speaks of schedules itself: not only through an object's repr it quotes
    (TensorFlow's "Attempt to convert a value (<...PiecewiseConstantDecay object at 0x...>) to a
    Tensor" is a crash of math on the schedule object, not a refusal of it)."""
    return "schedule" in re.sub(r"<[^<>]*>", "", str(error)).lower()


def _plain_rate(ctx: CheckContext) -> float | None:
    """The rate to build with where the rate is then set by hand: in a style with schedule objects the
    class's default may be one (a warm-up schedule built when no rate is given), which Keras lets no
    rate set by hand replace; so it is built with a plain rate, as a user who sets rates by hand
    builds it. None (the class's own default) elsewhere."""
    return ctx.lr if ctx.driver.capabilities.schedule_objects and ctx.has_lr else None


def _set_rate(driver: Driver, optimizer: Any, rates: Sequence[float], lr_arg: str, step: int) -> None:
    driver.set_learning_rate(optimizer, rates[step], lr_arg)


def _close(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Equal up to float32 rounding: a schedule and a rate set by hand take different code paths."""
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def _takes_a_zero_rate(ctx: CheckContext, overrides: Mapping[str, Any]) -> bool:
    """Whether steps at learning rate 0 run and stay finite, the first step and one after a step at
    the base rate, as the schedule has them: FTRL divides by the rate, so the zero-rate steps would
    compare NaN with NaN for it; torch's LBFGS with a strong-Wolfe line search, once it has a
    curvature history, divides by the zero-length interval it brackets (ZeroDivisionError)."""
    driver = ctx.driver
    try:
        optimizer, variables = fresh(ctx, learning_rate=_plain_rate(ctx), **overrides)
        for seed, rate in enumerate((0.0, ctx.lr, 0.0), start=10):
            driver.set_learning_rate(optimizer, rate, ctx.target.entry.lr_arg)
            driver.step(optimizer, variables, arrays(SHAPES, seed=seed), ctx.needs)
            # After each step: legacy FTRL's closed-form update makes its variables finite again.
            if not all(bool(np.all(np.isfinite(value))) for value in driver.values(variables)):
                return False
    except Exception:
        return False
    return True


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
# One seed for a sparse step and the step it is compared with: a class that draws random numbers in
# its step (Dion's random initial basis, GlobalRandomSGD's scale) draws the same on both sides.
_COMPARED_DRAWS = 7


@isolated
def check_sparse(ctx: CheckContext) -> Outcome:
    """Unique rows first (the plain case), then a second step elsewhere to see whether rows the
    gradient did not touch move, then a repeated id (as an Embedding batch has), twice, so that state
    a repeat wrote wrongly shows in the second step. Ids come in batch order, unsorted, as an
    Embedding's gradient has them: an update that sorts the ids without their rows moves wrong rows."""
    driver = ctx.driver
    sparse_method = method_location(ctx, driver.advice.sparse_update_method)
    first_rows, second_rows, repeated_rows = [3, 1], [8, 6], [5, 2, 5]
    only_sparse = dense_refusal(ctx)
    # A class that takes only sparse gradients has no dense step to compare with: its first step is
    # judged by what it moves, and a repeated id against the same gradient with its repeats summed.
    takes_dense = only_sparse is None
    with same_draws(ctx, seed=_COMPARED_DRAWS):
        optimizer, table = fresh(ctx, (TABLE_SHAPE,))
        start = driver.values(table)[0]
        try:
            _sparse_step(ctx, optimizer, table, _rows(first_rows, seed=20))
        except Exception as exc:
            return _sparse_refusal(ctx, exc)
    after_first = driver.values(table)[0]
    first = [_rows(first_rows, seed=20)]
    diff = _sparse_vs_reference(ctx, first, after_first, against_dense=True) if takes_dense else 0.0
    unbounded = (
        made_non_finite({"table": start}, {"table": after_first}, {"table": _dense_table(ctx, first)})
        if takes_dense and non_finite(after_first)
        else []
    )
    if unbounded:  # NaN against NaN is no fault of the sparse path's: the dense update makes them too
        return non_finite_update(
            ctx,
            f"a row-sparse gradient ({driver.sparse_gradient_name}) and the equivalent dense one both make "
            "the table non-finite in one step",
            [f"table {shape_text(TABLE_SHAPE)}"],
            regardless="whatever the gradient's form",
        )
    if not np.all(np.isfinite(after_first)) or diff > 0:
        own = _own_sparse_method(ctx) if takes_dense else None
        return failed(
            f"the rows a row-sparse gradient ({driver.sparse_gradient_name}) touches differ by up to "
            f"{diff:.3g} from the same optimizer on the equivalent dense gradient"
            + (
                f": the class's {own} computes them otherwise than its {driver.advice.update_method}"
                if own
                else ""
            )
            if takes_dense
            else f"after a row-sparse gradient ({driver.sparse_gradient_name}) the table is not finite",
            where=sparse_method,
            figure=diff,
            fix=_touched_rows_fix(ctx, own) if own else _sparse_branch_fix(ctx, after_first),
        )
    if not takes_dense and not _moves_touched_rows(ctx, first_rows):
        return failed(
            f"row-sparse gradients ({driver.sparse_gradient_name}) on rows {first_rows} moved none of them "
            f"in {WARMUP_STEPS} steps, and the class refuses dense gradients ({only_sparse}): it never "
            "updates anything",
            where=sparse_method,
            fix=driver.advice.sparse_update,
        )
    _sparse_step(ctx, optimizer, table, _rows(second_rows, seed=21))
    densified = _rows_changed(start, after_first, exclude=first_rows) | _rows_changed(
        after_first, driver.values(table)[0], exclude=second_rows
    )
    moved_apart = (
        _still_in_dense_steps(ctx, [first[0], _rows(second_rows, seed=21)], densified)
        if takes_dense
        else set()
    )
    if moved_apart:
        return failed(
            f"the sparse path computes other math than the dense path on rows the gradient did not touch: "
            f"{len(moved_apart)} of {TABLE_SHAPE[0]} such rows ({sorted(moved_apart)}) changed under the "
            f"row-sparse steps ({driver.sparse_gradient_name}), and the same optimizer's dense steps on the "
            "zero-padded gradients leave them unchanged",
            where=sparse_method,
            figure=float(len(moved_apart)),
            fix=_untouched_rows_fix(ctx),
        )
    repeated = [_rows(repeated_rows, seed=22), _rows(repeated_rows, seed=25)]
    with same_draws(ctx, seed=_COMPARED_DRAWS):
        repeated_optimizer, repeated_table = fresh(ctx, (TABLE_SHAPE,))
        for grad in repeated:
            _sparse_step(ctx, repeated_optimizer, repeated_table, grad)
    # Against the class's own sparse steps on the same gradients with each id's rows summed, not
    # against dense steps: a sparse path may rightly differ from the dense one after a first step
    # (SM3 keeps accumulators of rows only for a sparse gradient), which is not about repeats.
    repeated_diff = _sparse_vs_reference(ctx, repeated, driver.values(repeated_table)[0], against_dense=False)
    repeats = (
        f"with a repeated index (ids {repeated_rows}, two steps) the touched rows differ by up to "
        f"{repeated_diff:.3g} from the same gradients with each id's rows summed first"
    )
    # tf.keras's base class sums them for every built-in, unless an override skips it (legacy SGD's own
    # does only where its update is linear); anything else that differs there (clipnorm's clip of the
    # unsummed values) tf.keras's own optimizers do too.
    summed_apart = repeated_diff > REPEATS_ROUNDING and ctx.target.style == "tf_legacy"
    override = _summing_overridden(ctx) if summed_apart else None
    if override is not None:
        return failed(
            f"{repeats} (tf.keras's own optimizers sum them first: the base class's "
            f"{SUMMING_METHOD} does, before _resource_apply_sparse, and the class's override of it skips "
            "that, so every Embedding batch with a repeated id updates its rows wrongly)",
            where=override,
            figure=repeated_diff,
            fix=f"leave {SUMMING_METHOD} to the base class, or sum the repeated indices in it first "
            "(tf.unique, then tf.math.unsorted_segment_sum) before the update",
        )
    if repeated_diff > 0 and driver.capabilities.sums_repeated_rows:
        return failed(
            repeats + " (the framework's own optimizers sum them first)",
            where=sparse_method,
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
    made_dense = _made_dense(ctx, first_rows, second_rows)
    if made_dense:
        notes.append(
            f"densifies: step() turns the sparse gradient into a dense tensor (to_dense() at {made_dense}): "
            "every step costs the whole table (O(table) work) however few rows the gradient touches"
        )
    if notes:
        return warned(
            "sparse gradients work, but " + "; ".join(notes),
            where=made_dense or sparse_method,
            figure=float(len(densified)) if densified or made_dense else repeated_diff,
            fix=(
                "sum repeated indices first (unique + segment sum) before squaring or taking signs; "
                if repeated_diff > 0
                else ""
            )
            + ("keep the gradient sparse (no to_dense()): " if made_dense else "")
            + "for large embeddings update only the touched rows (gather, compute, scatter: LazyAdam-style), "
            "weight decay included",
        )
    if only_sparse is not None:
        return passed(
            f"the class takes only sparse gradients (it refuses a dense one: {only_sparse}); row-sparse "
            f"gradients ({driver.sparse_gradient_name}) move the rows they touch and only those, and a "
            "repeated id acts as the summed gradient of its rows (figure: rows changed outside the gradient)",
            0.0,
        )
    return passed(
        f"row-sparse gradients ({driver.sparse_gradient_name}), repeated ids too, update only the rows they "
        "touch, and those match the dense computation (figure: rows changed outside the gradient)",
        0.0,
    )


def _made_dense(ctx: CheckContext, first_rows: list[int], second_rows: list[int]) -> str:
    """`file:line` where a step after the first turns the sparse gradient into a dense tensor, or "".
    Watched in a run of its own, whose errors are not this check's to judge, and after the first step,
    where a class may densify once to size its state (SM3's accumulators)."""
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    try:
        _sparse_step(ctx, optimizer, table, _rows(first_rows, seed=20))
        with ctx.driver.densifying(TABLE_SHAPE, ctx.user_files()) as lines:
            _sparse_step(ctx, optimizer, table, _rows(second_rows, seed=21))
    except Exception:
        return ""
    return lines[0] if lines else ""


def _rows(rows: list[int], seed: int) -> SparseRows:
    return SparseRows(rows=rows, values=arrays([(len(rows), TABLE_SHAPE[1])], seed)[0], shape=TABLE_SHAPE)


def _dense(grad: SparseRows) -> np.ndarray:
    dense = np.zeros(grad.shape, np.float32)
    np.add.at(dense, grad.rows, grad.values)
    return dense


def _sparse_step(ctx: CheckContext, optimizer: Any, table: list[Any], grad: SparseRows) -> None:
    with warnings.catch_warnings():  # the framework's notes on sparse tensors are not the user's
        warnings.simplefilter("ignore")
        ctx.driver.step(optimizer, table, [grad], ctx.needs)


def _summed(grad: SparseRows) -> SparseRows:
    """The same gradient with each repeated row's values summed into one row."""
    rows = sorted(set(grad.rows))
    return SparseRows(rows=rows, values=_dense(grad)[rows], shape=grad.shape)


def dense_refusal(ctx: CheckContext) -> str | None:
    """The clear error of a class that takes only sparse gradients (torch's SparseAdam) when given a
    dense one, or None for any other class: one that takes dense gradients, one that fails on them
    for another reason (which `_sparse_vs_reference` then reports), and one that refuses sparse
    gradients as well, which takes no gradient at all. Decided once, for `dense_step` and `sparse`."""
    if "dense_refusal" not in ctx.notes:
        ctx.notes["dense_refusal"] = _refused_dense_only(ctx)
    refusal: str | None = ctx.notes["dense_refusal"]
    return refusal


def _refused_dense_only(ctx: CheckContext) -> str | None:
    grad = _rows([0, 2], seed=23)
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    try:
        ctx.driver.step(optimizer, table, [_dense(grad)], ctx.needs)
        return None
    except Exception as exc:
        if not refuses_dense(ctx, exc):
            return None
        refusal = ctx.describe_error(exc)
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    try:
        _sparse_step(ctx, optimizer, table, grad)
    except Exception:
        return None
    return refusal


def _moves_touched_rows(ctx: CheckContext, rows: list[int]) -> bool:
    """Whether sparse steps on `rows` move any of them within WARMUP_STEPS (a first step may only
    build state, as `dense_step` allows)."""
    optimizer, table = fresh(ctx, (TABLE_SHAPE,))
    start = ctx.driver.values(table)[0]
    for step in range(WARMUP_STEPS):
        _sparse_step(ctx, optimizer, table, _rows(rows, seed=24 + step))
        if _rows_changed(start, ctx.driver.values(table)[0], exclude=[]):
            return True
    return False


# The legacy tf.keras method whose base sums a row-sparse gradient's repeated indices before it calls
# `_resource_apply_sparse`, for every built-in that does not override it.
SUMMING_METHOD = "_resource_apply_sparse_duplicate_indices"
# More than float32 rounding of a+b added at once or one after the other (values about 1).
REPEATS_ROUNDING = 1e-6


def _summing_overridden(ctx: CheckContext) -> str | None:
    """Where the user's class overrides `SUMMING_METHOD`, if it does."""
    where = method_location(ctx, SUMMING_METHOD)
    return None if where == ctx.where() else where


def _sparse_vs_reference(
    ctx: CheckContext, grads: Sequence[SparseRows], sparse_result: np.ndarray, *, against_dense: bool
) -> float:
    """How far the touched rows after sparse steps on `grads` are from the same optimizer's dense
    steps, or its sparse steps on the gradients with repeats summed (0 when within float32
    rounding)."""
    with same_draws(ctx, seed=_COMPARED_DRAWS):  # the draws the sparse steps it is compared with made
        optimizer, table = fresh(ctx, (TABLE_SHAPE,))
        for grad in grads:
            if against_dense:
                ctx.driver.step(optimizer, table, [_dense(grad)], ctx.needs)
            else:
                _sparse_step(ctx, optimizer, table, _summed(grad))
    touched = sorted({row for grad in grads for row in grad.rows})
    dense = ctx.driver.values(table)[0][touched]
    if np.allclose(sparse_result[touched], dense, rtol=1e-5, atol=1e-6):
        return 0.0
    return float(np.max(np.abs(sparse_result[touched].astype(np.float64) - dense)))


def _rows_changed(before: np.ndarray, after: np.ndarray, *, exclude: list[int]) -> set[int]:
    changed = np.nonzero(np.any(before != after, axis=1))[0]
    return {int(row) for row in changed} - set(exclude)


def _sparse_refusal(ctx: CheckContext, error: Exception) -> Outcome:
    """A deliberate `raise` that mentions sparse gradients, in the class's own code (or the
    framework's optimizers', or the base optimizer's a wrapper wraps), is a clear refusal; anything
    else is an error from deep inside an op."""
    driver = ctx.driver
    deepest = raising_frame(error)
    own = deepest is not None and deepest.filename in refusal_files(ctx)
    statement = (deepest.line or "").lstrip() if deepest is not None else ""
    message = str(error).lower()
    about_sparse = any(word in message for word in SPARSE_WORDS)
    if own and about_sparse and statement.startswith("assert"):
        return failed(
            f"refuses sparse gradients with an assert, not a raise ({ctx.describe_error(error)}): python -O "
            "strips asserts, and then the sparse gradient runs into the dense math",
            where=user_line(ctx, error),
            fix=driver.advice.sparse_update,
        )
    # A raise in the class's own sparse method: the framework's base one raises too, for a class that
    # left it out, which is a fault (`_left_to_the_base` below), so only the user's files count.
    in_own_sparse_method = (
        deepest is not None and deepest.name in SPARSE_METHODS and raised_in(error, own_code(ctx), by="raise")
    )
    if clear_refusal(ctx, error, SPARSE_WORDS) or in_own_sparse_method:
        if ctx.target.entry.supports_sparse:
            return failed(
                f"the class declares optlab_supports_sparse but refuses sparse gradients: "
                f"{ctx.describe_error(error)}",
                where=user_line(ctx, error),
                fix="support sparse gradients or drop optlab_supports_sparse",
            )
        return passed(f"refuses sparse gradients with a clear error: {ctx.describe_error(error)}")
    wrong = wrong_signature(ctx, error)  # the class's sparse method, called as the framework calls it
    if wrong is not None:
        return wrong.failed(ctx.describe_error(error))
    if deepest is not None and _left_to_the_base(ctx, error, deepest.name, deepest.filename):
        return failed(
            f"a row-sparse gradient ({driver.sparse_gradient_name}) reached `{deepest.name}`, which the "
            f"class leaves to the framework's base class, and that refuses it: {ctx.describe_error(error)}",
            where=ctx.target.class_location(),
            fix=driver.advice.sparse_update,
        )
    if deepest is not None and ctx.target.source_file() is not None and not reached_user_code(ctx, error):
        return failed(
            f"a row-sparse gradient ({driver.sparse_gradient_name}) crashed in the framework's code with "
            f"none of the class's on the way ({Path(deepest.filename).name}:{deepest.lineno}, "
            f"`{(deepest.line or '').strip()}`): {ctx.describe_error(error)}",
            where=ctx.target.class_location(),
            fix="the framework's base class crashes on a row-sparse gradient as the class configures it (an "
            "option of the base the class sets, such as Keras's loss_scale_factor, can be why): leave that "
            "option unset, or refuse sparse gradients with a clear error in the class",
        )
    return failed(
        f"a row-sparse gradient ({driver.sparse_gradient_name}) crashed inside the update: "
        f"{ctx.describe_error(error)}",
        where=user_line(ctx, error),
        fix=driver.advice.sparse_update,
    )


def _dense_table(ctx: CheckContext, grads: Sequence[SparseRows]) -> np.ndarray:
    """The table after the same optimizer's dense steps on `grads` (an empty array where they raise:
    not shown non-finite, the sparse step's difference stands)."""
    with same_draws(ctx, seed=_COMPARED_DRAWS):
        optimizer, table = fresh(ctx, (TABLE_SHAPE,))
        try:
            for grad in grads:
                ctx.driver.step(optimizer, table, [_dense(grad)], ctx.needs)
        except Exception:
            return np.zeros(0, np.float32)
    return ctx.driver.values(table)[0]


def _still_in_dense_steps(ctx: CheckContext, grads: Sequence[SparseRows], moved: set[int]) -> set[int]:
    """Of `moved`, rows that sparse steps on `grads` changed outside their gradients, those the same
    optimizer's dense steps on the zero-padded gradients leave unchanged in every step (none where a
    dense step raises: not shown to differ). Where the dense steps move them too (Adam's momentum on
    rows of zero gradient), the sparse path only does the same O(table) work."""
    if not moved:
        return set()
    driver = ctx.driver
    dense_moved: set[int] = set()
    with same_draws(ctx, seed=_COMPARED_DRAWS):
        optimizer, table = fresh(ctx, (TABLE_SHAPE,))
        try:
            for grad in grads:
                before = driver.values(table)[0]
                driver.step(optimizer, table, [_dense(grad)], ctx.needs)
                dense_moved |= _rows_changed(before, driver.values(table)[0], exclude=grad.rows)
        except Exception:
            return set()
    return moved - dense_moved


def _untouched_rows_fix(ctx: CheckContext) -> str:
    advice = ctx.driver.advice
    sparse_path = (
        advice.sparse_update_method
        if advice.sparse_update_method not in (None, advice.update_method)
        else f"the sparse branch of {advice.update_method}"
    )
    return (
        f"make {sparse_path} leave the rows the gradient did not touch as {advice.update_method} leaves them "
        "with a zero gradient there: update only the touched rows (gather them and their slots, compute, "
        "scatter back)"
    )


def _own_sparse_method(ctx: CheckContext) -> str | None:
    """The style's sparse update method (legacy tf.keras's `_resource_apply_sparse`) where the class
    defines one of its own, apart from its dense update; else None."""
    method = ctx.driver.advice.sparse_update_method
    if method is None or method == ctx.driver.advice.update_method:
        return None
    return method if any(method in vars(k) for k in user_classes(ctx.target.cls)) else None


def _touched_rows_fix(ctx: CheckContext, method: str) -> str:
    """A class that has its sparse method had been told to implement it: its math is what differs."""
    dense = ctx.driver.advice.update_method
    return (
        f"make {method} compute on the touched rows what {dense} computes on them (the same math on the "
        "gathered rows of the variable and its slots), and write the result back as it is meant: "
        "_resource_scatter_add adds a change to the rows, _resource_scatter_update replaces them with a "
        "new value"
    )


def _sparse_branch_fix(ctx: CheckContext, after_first: np.ndarray) -> str:
    """Where the sparse step ran and only its values differ from the dense path's, the class handles
    sparse gradients in its update method: its math there is what to mend, not the handling (the
    advice for a crash). A table made non-finite is left that advice."""
    advice = ctx.driver.advice
    if not np.all(np.isfinite(after_first)):
        return advice.sparse_update
    return (
        f"make the sparse branch of {advice.update_method} compute on the touched rows what its dense path "
        "computes on them (the same math on the gathered rows of the variable and its state), and write the "
        "result back as it is meant: a change added to the rows, or the rows replaced by their new value"
    )


def _left_to_the_base(ctx: CheckContext, error: Exception, function: str, filename: str) -> bool:
    """Whether `error` is the NotImplementedError raised by a method the class inherits, unchanged,
    from the framework's base, to be implemented by subclasses (legacy tf.keras's
    `_resource_apply_sparse`); not one of torch's missing sparse kernels, raised in the class's step."""
    if not isinstance(error, NotImplementedError):
        return False
    defining = next((k for k in ctx.target.cls.__mro__ if function in vars(k)), None)
    if defining is None or defining in user_classes(ctx.target.cls):
        return False
    code = getattr(inspect.unwrap(vars(defining)[function]), "__code__", None)
    return code is not None and code.co_filename == filename


CHECKS: Mapping[str, CheckFunction] = {
    "schedule": check_schedule,
    "sparse": check_sparse,
}
