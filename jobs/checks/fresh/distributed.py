"""`distributed`: two replicas, each on half the batch, against one on the full batch.

The runs happen in a fresh process: DDP needs processes of its own, and TensorFlow takes
the two logical CPU devices a MirroredStrategy needs only before its runtime starts.
The replicas must hold bitwise the same values, the optimizer state must be laid out as
on one device, and the result must equal one device's within rounding (`plan.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.fresh.plan import DISTRIBUTED_STEPS, INITIAL, REPLICA_RUNS, SINGLE, Wording, runs_for
from jobs.checks.fresh.results import (
    beyond_tolerance,
    first_difference,
    layout_difference,
    load_run,
    max_abs_difference,
)
from jobs.checks.fresh.spawner import ChildFailed, failed_in_child, run_fresh
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.state_checks import clipping_bypassed
from jobs.checks.tools import (
    ZERO_GRAD_FIX,
    draws_randomly,
    made_non_finite,
    method_location,
    non_finite_update,
    python_counters,
    state_shared_by_instances,
    zero_grad_keeps,
    zero_grad_said,
)
from optimizers.loop_needs import user_classes


def distributed(ctx: CheckContext) -> Outcome:
    runs = runs_for(ctx.target.style)
    overrides = ctx.stateful_overrides()
    outs = {name: ctx.workdir / f"distributed-{name}.npz" for name in (INITIAL, SINGLE, *REPLICA_RUNS)}
    request = {
        "overrides": overrides,
        "settings": runs.settings(),
        "outs": {k: str(v) for k, v in outs.items()},
    }
    try:
        run_fresh(ctx, "distributed", request)
    except ChildFailed as exc:
        if ctx.needs.closure and not exc.timed_out:
            # A class whose closure count follows the loss (a line search) runs a different number of
            # backward passes on each rank when their losses differ, and DDP's all-reduce then waits
            # on a rank that has moved on.
            observed = (
                f"the run failed ({exc.observed}): ranks that step by different losses may run different "
                "numbers of backward passes, whose all-reduces DDP cannot pair"
            )
            over_ranks = _judged_with_the_loss_over_ranks(ctx, request, observed)
            if over_ranks is not None:
                return over_ranks
        if ctx.needs.create_graph and not exc.timed_out:
            # DDP averages gradients in place, which a gradient carrying a graph (for Hessian-vector
            # products) refuses: a limit of DDP and so of this check, not a fault of the class.
            return skipped(
                f"inconclusive: {runs.WORDING.setup} could not run the steps with "
                f"backward(create_graph=True), which this class needs ({exc.observed}); DDP does not serve "
                "such gradients, so optlab cannot compare it with one device"
            )
        return failed_in_child(exc, runs.WORDING.setup, where=ctx.where(), fix=_child_fix(runs.WORDING, exc))
    outcome = judge(ctx, runs.WORDING, outs, overrides)
    kept = zero_grad_keeps(ctx) if outcome.status == "fail" else []
    if kept:  # not the all-reduce: each rank's gradients pile up, and one process's differently
        return failed(
            f"{outcome.detail.split('. Fix: ')[0].removesuffix(f' (at {outcome.where})')}; the cause: "
            f"{zero_grad_said(kept)}",
            where=method_location(ctx, "zero_grad"),
            fix=ZERO_GRAD_FIX,
            figure=outcome.figure,
        )
    if outcome.status == "fail" and ctx.needs.closure:
        observed = "the ranks part from one process fed the averaged gradient"
        return _judged_with_the_loss_over_ranks(ctx, request, observed, outcome.figure) or outcome
    if outcome.status == "fail":
        return _judged_without_per_replica_options(ctx, request, outcome) or outcome
    return outcome


def _child_fix(words: Wording, exc: ChildFailed) -> str:
    """The advice for the error a distributed run raised, by its kind: a typed error's own, the
    style's for what its line says (one sentence about variables made lazily had been given for
    every error, `int(self.iterations)` of a MirroredVariable's too), else the style's general one
    ('' for `failed_in_child`'s)."""
    if exc.fix:
        return exc.fix
    matching = (fix for pattern, fix in words.distributed_child_fixes if re.search(pattern, exc.observed))
    return next(matching, words.distributed_child_fix)


def _judged_without_per_replica_options(
    ctx: CheckContext, request: Mapping[str, Any], outcome: Outcome
) -> Outcome | None:
    """Keras 3 clips (`clipnorm`, `global_clipnorm`, `clipvalue`) and accumulates
    (`gradient_accumulation_steps`) each replica's own gradient in its apply(), before the update
    sums the replicas' gradients: a class that sets one of its base's options parts from one device
    by the framework's doing. Run again with those options off on both sides: if the replicas then
    agree with one device, the class's update is sound and a warn names the option; else None (the
    fail stands)."""
    if not ctx.driver.per_replica_option_effects:
        return None
    options = ctx.driver.per_replica_options(ctx.build(**request["overrides"]))
    if not options:
        return None
    runs = runs_for(ctx.target.style)
    outs = {
        name: Path(path).with_name(f"options-off-{Path(path).name}") for name, path in request["outs"].items()
    }
    off = {**request, "outs": {k: str(v) for k, v in outs.items()}, "options_off": [o.name for o in options]}
    try:
        run_fresh(ctx, "distributed", off)
    except ChildFailed:
        return None
    if judge(ctx, runs.WORDING, outs, request["overrides"]).status != "pass":
        return None
    observed = outcome.detail.split(". Fix: ")[0].removesuffix(f" (at {outcome.where})")
    named = " and ".join(f"{o.name}={o.value!r}" for o in options)
    effects = "; ".join(f"with {o.name}, {o.effect}" for o in options)
    return warned(
        f"{observed}; the cause is the framework's, not the update's: the class sets {named}, and under "
        f"{runs.WORDING.setup} {effects}; with {'them' if len(options) > 1 else 'it'} off, "
        f"{runs.WORDING.setup} equals {runs.WORDING.reference}",
        where=ctx.where(),
        fix="to clip or accumulate the summed gradient, do it where the replicas' gradients are summed "
        "already (in your train step after the all-reduce, or in the class's update step), not through "
        "the optimizer's option",
        figure=outcome.figure,
    )


def _judged_with_the_loss_over_ranks(
    ctx: CheckContext, request: Mapping[str, Any], observed: str, figure: float | None = None
) -> Outcome | None:
    """A class stepped with a closure may use the loss it returns (AliG's step size, LBFGS's line
    search), which in a plain DDP loop is each rank's own share's: DDP averages gradients, not
    losses. Run again with the closure returning the ranks' mean, as optlab's jobs do: if the ranks
    then agree with one process, that loss was the cause, which a warn names after `observed` (what
    the plain DDP loop did); else None (the fail stands)."""
    runs = runs_for(ctx.target.style)
    outs = {
        name: Path(path).with_name(f"mean-loss-{Path(path).name}") for name, path in request["outs"].items()
    }
    try:
        run_fresh(
            ctx,
            "distributed",
            {**request, "outs": {k: str(v) for k, v in outs.items()}, "loss_over_ranks": True},
        )
    except ChildFailed:
        return None
    if judge(ctx, runs.WORDING, outs, request["overrides"]).status != "pass":
        return None
    setup = runs.WORDING.setup
    return warned(
        f"under {setup}, with each rank's closure returning its own share's loss (as in a plain DDP loop), "
        f"{observed}; with the closure returning the mean "
        f"of the ranks' losses (as optlab's jobs do) they agree with it: the class steps by the loss (a "
        "line search, a loss-scaled step), which DDP does not average",
        where=ctx.where(),
        fix="in a DDP loop of your own, have the closure return the loss averaged over the ranks "
        "(torch.distributed.all_reduce, then divide by the world size), or all-reduce it in step()",
        figure=figure,
    )


COUNTER_FIX = (
    "keep the count in a variable of the optimizer (the framework's `iterations`, or one of its own: "
    "self.add_variable in Keras 3, self.add_weight in tf.keras), which every replica shares and every "
    "save holds"
)


def _replicated_counters(ctx: CheckContext, words: Wording) -> str:
    """Why replicas may part where the class counts in Python: one object's number, changed by every
    replica's call of the update (a TensorFlow strategy runs it once per replica). Torch's ranks each
    own their optimizer, so a Python counter there is no cause."""
    if ctx.target.style == "torch":
        return ""
    counters = python_counters(ctx)
    if not counters:
        return ""
    return (
        f"the class keeps {', '.join(counters)}, a Python number its step changes: under {words.setup} "
        "each replica's update changes it (and a traced graph sees only its value when traced)"
    )


# Keras 3's TensorFlow optimizer merges the replicas' update in these (maybe_merge_call): a class's
# own version runs on each replica with its own gradient.
_MERGING_METHODS = ("_backend_update_step", "_distributed_tf_update_step")


def _bypassed_merge(ctx: CheckContext) -> str | None:
    """The Keras 3 method of the strategy's merge the class overrides (NoteDance's Lamb overrides
    `_backend_update_step`), or its apply() override that never runs the base's, which merges there
    (`clipping_bypassed`), or None."""
    if ctx.target.style != "keras":
        return None
    return next(
        (m for m in _MERGING_METHODS for k in user_classes(ctx.target.cls) if m in vars(k)),
        None,
    ) or clipping_bypassed(ctx)


def judge(
    ctx: CheckContext, words: Wording, outs: Mapping[str, Path], overrides: Mapping[str, Any]
) -> Outcome:
    single, first = load_run(outs[SINGLE]), load_run(outs[REPLICA_RUNS[0]])
    problem = first.problem or layout_difference(single, first)
    if problem:
        return failed(
            f"under {words.setup} the optimizer state is not what {words.single} has: {problem}",
            where=ctx.where(),
            fix=words.layout_fix,
        )
    for number, name in enumerate(REPLICA_RUNS[1:], start=1):
        other = load_run(outs[name])
        apart = first_difference(first, other)
        if apart and draws_randomly(ctx):
            return warned(
                f"under {words.setup}, {words.replica} {number} drifts away from {words.replica} 0 on the "
                f"same averaged gradients ({apart}): the class draws random numbers in its steps (by design) "
                f"and each {words.replica} has a random stream of its own, as dropout needs",
                where=ctx.where(),
                fix=f"seed the optimizer's draws alike on every {words.replica} (a generator of its own, "
                "seeded from the step) or broadcast what it draws",
                figure=max_abs_difference(first, other),
            )
        shared = state_shared_by_instances(ctx) if apart else []
        if shared:
            return failed(
                f"under {words.setup}, {words.replica} {number} holds other values than {words.replica} 0 "
                f"after {DISTRIBUTED_STEPS} steps on the same averaged gradients ({apart}): the class keeps "
                f"{', '.join(shared)} outside its instances, and its steps change it, so every "
                f"{words.replica}'s update moves the one value all of them read",
                where=ctx.where(),
                fix=COUNTER_FIX,
                figure=max_abs_difference(first, other),
            )
        merge = _bypassed_merge(ctx) if apart else None
        if merge is not None:
            return failed(
                f"under {words.setup}, {words.replica} {number} holds other values than {words.replica} 0 "
                f"after {DISTRIBUTED_STEPS} steps on the same averaged gradients ({apart}): the class "
                f"overrides {merge}, where Keras merges the {words.replica}s' update under a strategy, so "
                f"its version updates each {words.replica} on its own",
                where=method_location(ctx, merge),
                fix=f"put the class's math in update_step and leave {merge} to Keras (or end it with "
                f"super().{merge}(...))",
                figure=max_abs_difference(first, other),
            )
        if apart:
            counters = _replicated_counters(ctx, words)
            return failed(
                f"under {words.setup}, {words.replica} {number} holds other values than {words.replica} 0 "
                f"after {DISTRIBUTED_STEPS} steps on the same averaged gradients ({apart})"
                + (f"; {counters}" if counters else ""),
                where=ctx.where(),
                fix=COUNTER_FIX if counters else words.apart_fix,
                figure=max_abs_difference(first, other),
            )
    figure = max_abs_difference(single, first)
    initial = load_run(outs[INITIAL])
    unbounded = made_non_finite(initial.arrays, single.arrays, first.arrays)
    if unbounded:  # NaN against NaN is no difference of the replicas' (a per-replica gradient statistic)
        return non_finite_update(
            ctx,
            f"{words.setup} and {words.single} both end with non-finite values after {DISTRIBUTED_STEPS} "
            "steps",
            [single.label(key) for key in unbounded],
            regardless=f"on {words.single} too",
        )
    far = beyond_tolerance(single, first, initial)
    if far:
        counters = _replicated_counters(ctx, words)
        return failed(
            f"{words.setup} (half the batch each) differs from {words.reference} beyond rounding: {far}"
            + (f"; {counters}" if counters else ""),
            where=ctx.where(),
            fix=COUNTER_FIX if counters else words.beyond_fix,
            figure=figure,
        )
    return passed(
        f"{words.setup} equals {words.reference} after {DISTRIBUTED_STEPS} steps: "
        f"{len(single.optimizer_keys())} optimizer state array(s), laid out alike, {words.replica}s bitwise "
        f"equal, max abs difference to {words.single} {figure:.2g} (rounding){overrides_note(overrides)}",
        figure,
    )
