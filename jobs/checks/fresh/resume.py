"""`resume_exact`: N steps straight against k steps, save, and a fresh process running N - k.

A fresh process because state an optimizer keeps in a class attribute or a module global
survives every in-process round trip (all instances share it) and only a new process
shows that it was never saved. The straight run and the save happen here, in the checking
process, while the fresh child imports its framework.
"""

from __future__ import annotations

from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.fresh.plan import RESUME_SPLIT, RESUME_STEPS, runs_for
from jobs.checks.fresh.results import first_difference, largest_difference, load_run
from jobs.checks.fresh.spawner import ChildFailed, child_for, failed_in_child, run_fresh
from jobs.checks.report import Outcome, failed, passed
from jobs.checks.tools import (
    ALIASING_FIX,
    CHANGED_DEFAULT_FIX,
    LEFT_OUT_FIX,
    VARIES_WITHOUT_DRAWING,
    VARIES_WITHOUT_DRAWING_FIX,
    ZERO_GRAD_FIX,
    aliasing_location,
    changed_defaults,
    changed_defaults_said,
    left_out_said,
    method_location,
    missing_key_left_out,
    save_faults,
    state_aliasing,
    varies_without_drawing,
    zero_grad_keeps,
    zero_grad_said,
)
from jobs.frameworks.base import CHANGED_BY_SAVE_FIX, changed_by_save_explains, changed_by_save_said


def resume_exact(ctx: CheckContext) -> Outcome:
    runs = runs_for(ctx.target.style)
    words = runs.WORDING
    overrides = ctx.stateful_overrides()
    checkpoint, out = ctx.workdir / "resume-checkpoint", ctx.workdir / "resume-final.npz"
    child_for(ctx)  # started first: its imports overlap the runs here
    straight = runs.run_and_save(ctx, overrides, checkpoint)
    request = {
        "overrides": overrides,
        "settings": runs.settings(),
        "checkpoint": str(checkpoint),
        "out": str(out),
    }
    try:
        run_fresh(ctx, "resume", request)
    except ChildFailed as exc:
        # A KeyError after the reload for a key the save left out: named, with its fix.
        changed: list[str] = []
        left: list[str] = []
        if not exc.timed_out and "KeyError" in exc.observed:
            dropped = runs.load_difference(ctx, overrides, checkpoint)
            if (
                dropped is not None
                and dropped.method is not None
                and _key_named(exc.observed, dropped.detail)
            ):
                return failed(  # a key the class's own load dropped, wanted by the next step
                    f"the resumed run failed: {exc.observed}; loading the checkpoint changed its state: "
                    f"{dropped.detail}",
                    where=method_location(ctx, dropped.method),
                    fix=dropped.fix or words.resume_child_fix,
                )
            changed, left = save_faults(ctx, overrides)
        if missing_key_left_out(exc.observed, left):
            if _key_named(exc.observed, "; ".join(changed)):  # the key the save took from the live state
                said = f"the resumed run failed: {exc.observed}; {changed_by_save_said(changed)}"
                return failed(said, where=method_location(ctx, "state_dict"), fix=CHANGED_BY_SAVE_FIX)
            said = f"the resumed run failed: {exc.observed}; {left_out_said(left)}"
            return failed(said, where=exc.where or ctx.where(), fix=LEFT_OUT_FIX)
        return failed_in_child(exc, "the resumed run", where=ctx.where(), fix=words.resume_child_fix)
    resumed = load_run(out)
    rest = RESUME_STEPS - RESUME_SPLIT
    steps = (
        f"{RESUME_STEPS} steps straight vs {RESUME_SPLIT} + {words.checkpoint} + {rest} in a fresh process"
    )
    if ctx.needs.train_eval and words.evaluation:
        steps += f", both saved and compared after {words.evaluation}"
    difference = first_difference(straight, resumed)
    if not difference:
        return passed(
            f"{steps}: parameters and optimizer state bitwise equal{overrides_note(overrides)}", 0.0
        )
    # A cause the load itself shows, named with its own fix; else state the save never saw.
    cause = runs.load_difference(ctx, overrides, checkpoint)
    changed, left = ([], []) if cause else save_faults(ctx, overrides)
    ours = changed_by_save_explains(changed, left)  # else said beside what the save leaves out
    most, figure = largest_difference(straight, resumed)
    # Nothing the save shows, and steps that differ from run to run without a drawn number: the order
    # is at fault, not state kept outside the save (which the fix below would otherwise say).
    varies = not (cause or changed or left) and varies_without_drawing(ctx)
    defaults = [] if cause or changed or left else changed_defaults(ctx)
    if defaults:  # the resumed run's optimizer is built from the default as written, the straight one's not
        return failed(
            f"{steps} differ: {difference}; {changed_defaults_said(defaults)}",
            where=method_location(ctx, "__init__"),
            fix=CHANGED_DEFAULT_FIX,
            figure=figure,
        )
    kept = [] if cause or changed or left else zero_grad_keeps(ctx)
    if kept:  # the resumed run starts from cleared gradients, the straight one from every one so far
        return failed(
            f"{steps} differ: {difference}; {zero_grad_said(kept)}, and the resumed run starts without them",
            where=method_location(ctx, "zero_grad"),
            fix=ZERO_GRAD_FIX,
            figure=figure,
        )
    # State one tensor with a parameter, which the save writes as a copy of its own: the cause.
    aliasing = None if cause or changed or left else state_aliasing(ctx)
    if aliasing is not None:
        return failed(
            f"{steps} differ: {difference}; {aliasing.said()}, and a reload gives it a copy of its own",
            where=aliasing_location(ctx),
            fix=ALIASING_FIX,
            figure=figure,
        )
    return failed(
        f"{steps} differ: {difference}"
        + (f"; the largest difference, {figure:.3g}, is in {most}" if most and most not in difference else "")
        + (f"; loading the checkpoint changed its state: {cause.detail}" if cause else "")
        + (f"; {left_out_said(left)}" if left and not ours else "")
        + (f"; {changed_by_save_said(changed)}" if changed else "")
        + (f"; {VARIES_WITHOUT_DRAWING}" if varies else ""),
        where=method_location(ctx, "state_dict")
        if ours
        else method_location(ctx, cause.method)
        if cause and cause.method
        else ctx.where(),
        fix=(cause.fix if cause and cause.fix else None)
        or (CHANGED_BY_SAVE_FIX if ours else None)
        or (LEFT_OUT_FIX if left else None)
        or (VARIES_WITHOUT_DRAWING_FIX if varies else None)
        or f"keep {words.state_home} (never in a class attribute, module global or other Python "
        f"attribute), so {words.saver} saves it",
        figure=figure,
    )


def _key_named(observed: str, detail: str) -> bool:
    """Whether a KeyError (`KeyError: 'exp_avg_sq'`) is for a key `detail` names (`[...]['exp_avg_sq']`)."""
    key = observed.rpartition("KeyError: ")[2].split()[0] if "KeyError: " in observed else ""
    return bool(key) and f"[{key}]" in detail
