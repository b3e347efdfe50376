"""step_cost and deprecations: what an update costs and what it triggers, written once over the
drivers.
"""

from __future__ import annotations

import math
import re
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, passed, skipped, warned
from jobs.checks.tools import (
    SHAPES,
    CheckFunction,
    arrays,
    fresh,
    isolated,
    method_location,
)
from jobs.frameworks.base import known_fix
from optimizers.loop_needs import PLAIN, LoopNeeds

# Over this ratio to the framework's built-in of comparable state is a warn.
STEP_COST_LIMIT = 3.0
# What to do about a step whose time is in matrix math: a preconditioner's (Shampoo, SOAP, Kron), which
# may be refreshed less often, or an orthogonalization's (Muon's Newton-Schulz), which runs every step.
MATRIX_MATH_FIX = (
    "if the method needs this math, the code is not at fault: to pay less, do it less often where the "
    "method allows (refresh a preconditioner every few steps, or only for large matrices), in lower "
    "precision where it is stable (Muon runs its Newton-Schulz iterations in bfloat16), and weigh its "
    "cost per step against the steps it saves"
)
# State tensors per variable from which the yardstick is AdamW (two moments), not SGD(momentum).
ADAPTIVE_SLOTS = 2


# -- step_cost ---------------------------------------------------------------------------------------


@isolated
def check_step_cost(ctx: CheckContext) -> Outcome:
    """The update's time against the framework's built-in of comparable state on the same
    variables: SGD(momentum=0.9) for up to one state tensor per variable, AdamW for two or more,
    so an Adam-like optimizer is not flagged for being Adam-like; a wrapper against its base."""
    if ctx.needs.closure:
        return skipped(
            "not measured: the class is stepped with a closure, whose forward and backward passes are "
            "part of its step by design (a second one for SAM, a line search's), so its step() cannot "
            "be timed against a built-in's update of given gradients"
        )
    driver = ctx.driver
    shapes = driver.cost_shapes
    grads = arrays(shapes, seed=100)
    with driver.timing():
        try:
            optimizer, variables = fresh(ctx, shapes, seed=101)
            driver.to_training(optimizer, ctx.needs)  # timed as a job steps it
            candidate = driver.timed_update(optimizer, variables, grads)
        except Exception as exc:
            fix = f". Fix: {known}" if (known := known_fix(exc)) else ""
            return skipped(
                f"not measurable: {driver.timed_update_name} raised {ctx.describe_error(exc)}{fix}"
            )
        yardstick = _yardstick(ctx, optimizer, variables)
        reference_name = yardstick.name
        try:
            reference_variables = driver.variables(arrays(shapes, seed=101, mean=1.0))
            reference_optimizer = yardstick.build(reference_variables)
            driver.to_training(reference_optimizer, yardstick.needs)  # a schedule-free base too
            reference = driver.timed_update(reference_optimizer, reference_variables, grads)
        except Exception as exc:
            raised = ctx.describe_error(exc)
            return skipped(f"not measurable: {reference_name}'s {driver.timed_update_name} raised {raised}")
        ours, theirs = interleaved_best(candidate, reference)
        if ours / theirs > STEP_COST_LIMIT:  # a busy machine can fake one slow round: measure once more
            ours, theirs = min(
                (ours, theirs), interleaved_best(candidate, reference), key=lambda t: t[0] / t[1]
            )
        ratio = ours / theirs
        slow = ratio > STEP_COST_LIMIT
        spent = driver.where_time_goes(candidate, reference) if slow else None
    timing = (
        f"{driver.timed_update_name} takes {ours * 1e3:.3g} ms, {reference_name} "
        f"{theirs * 1e3:.3g} ms on {sum(math.prod(s) for s in shapes):,} parameters"
    )
    if spent is None:
        return passed(f"{timing} (figure: ratio)", ratio)
    if spent.in_matrix_math:
        return warned(
            f"{timing}: {ratio:.1f}x; {spent.phrase}: matrix math (products, decompositions, solves), "
            "which a preconditioned or orthogonalized update (Shampoo, Muon) pays by design, not host "
            "syncs or per-element loops",
            where=method_location(ctx),
            figure=ratio,
            fix=MATRIX_MATH_FIX,
        )
    if spent.in_tensor_ops:
        return warned(
            f"{timing}: {ratio:.1f}x; {spent.phrase}: passes over whole tensors, not host syncs or "
            "Python loops; each is a trip through the variables' memory, so more per-element math than "
            "the yardstick's costs more by design",
            where=method_location(ctx),
            figure=ratio,
            fix=driver.advice.fewer_passes,
        )
    return warned(
        f"{timing}: {ratio:.1f}x; {spent.phrase}",
        where=method_location(ctx),
        figure=ratio,
        fix=driver.advice.fast_update,
    )


@dataclass(frozen=True)
class Yardstick:
    """What an update is timed against: how to build it over variables, its name, how it is stepped."""

    build: Callable[[Any], Any]
    name: str
    needs: LoopNeeds = PLAIN


def _yardstick(ctx: CheckContext, optimizer: Any, variables: list[Any]) -> Yardstick:
    """A wrapper's base alone (what the wrapper adds is its cost; timm's Lookahead even keeps the
    base's state out of its own `state`), else the framework's built-in of comparable state."""
    base = ctx.base
    if base is not None:
        return Yardstick(
            lambda params: base.entry.create(base.hyperparams, model_params=params),
            f"its base {base.entry.name} alone",
            base.entry.needs,
        )
    driver = ctx.driver
    if slots_per_variable(ctx, optimizer, variables) >= ADAPTIVE_SLOTS:
        return Yardstick(driver.reference_adamw, driver.reference_adamw_name)
    return Yardstick(driver.reference_sgd, driver.reference_sgd_name)


def slots_per_variable(ctx: CheckContext, optimizer: Any, variables: list[Any]) -> float:
    """State tensors (not scalar counters) per variable, once the update has run (torch makes
    its state lazily in the first step)."""
    tensors = [value for _, value in ctx.driver.state(optimizer) if value.ndim > 0]
    return len(tensors) / max(1, len(variables))


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
    own_notices: list[str] = []

    def record(
        message: str, category: type[Warning] | None, filename: str | None, lineno: int | None
    ) -> None:
        if not is_deprecation(category, message):
            return
        if _issued_by_the_class(ctx):
            own_notices.append(" ".join(message.split()))
            return
        found.append((" ".join(message.split()), _line_in_user_file(ctx, filename, lineno)))

    with driver.recording_warnings(record):
        optimizer, variables = fresh(ctx, **ctx.stateful_overrides())
        for seed in (110, 111):
            driver.step(optimizer, variables, arrays(SHAPES, seed), ctx.needs)
        driver.state(optimizer)
    located = [(message, where) for message, where in found if where]
    if not located:
        other = f"; {len(found)} raised by framework code outside the class were ignored" if found else ""
        if own_notices:
            other += (
                f"; {len(own_notices)} that the class issues itself were not counted (its authors' notice, "
                f"not a deprecated call it makes), first: {own_notices[0][:160]}"
            )
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


def _issued_by_the_class(ctx: CheckContext) -> bool:
    """Whether the warning being shown comes from a `warn(...)` call in the class's own file (GaLore's
    AdamW: "This implementation of AdamW is deprecated ... Use torch.optim.AdamW"): the authors'
    notice about their own code, which no framework upgrade breaks. Told by the innermost frame of
    the class's file on the stack, whatever `stacklevel` the warning names."""
    source = ctx.target.source_file()
    frames = [f for f in traceback.extract_stack() if f.filename == source]
    return bool(frames) and re.search(r"(?<![\w.])(warnings\.)?warn\(", frames[-1].line or "") is not None


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
    "step_cost": check_step_cost,
    "deprecations": check_deprecations,
}
