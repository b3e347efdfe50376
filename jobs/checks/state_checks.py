"""config_roundtrip, state_roundtrip, device_placement, state_untrainable: what an optimizer
keeps and how it survives a save, written once over the drivers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import pickle
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext, overrides_note, with_defaults
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.tools import (
    ALIASING_FIX,
    CHANGED_DEFAULT_FIX,
    LEFT_OUT_FIX,
    RANDOM_GENERATORS,
    SHAPES,
    WARMUP_STEPS,
    CheckFunction,
    aliasing_location,
    arrays,
    attributes_written_by_the_user,
    changed_defaults,
    changed_defaults_said,
    draws_randomly,
    fresh,
    generator_kind,
    isolated,
    left_out_said,
    listed,
    max_diff,
    method_location,
    missing_key_left_out,
    native,
    plain_numbers,
    refused_rate,
    same_arrays,
    same_draws,
    same_value,
    shape_text,
    state_aliasing,
    takes_a_rate,
    user_method_lines,
)
from jobs.frameworks.base import (
    CHANGED_BY_SAVE_FIX,
    ConfigNotSerialized,
    Driver,
    StateNotRestored,
    changed_by_save_explains,
    changed_by_save_said,
)
from optimizers.hyperparams import FRAMEWORK_SWITCHES, is_number
from optimizers.loop_needs import user_classes

# -- config_roundtrip --------------------------------------------------------------------------------


@isolated
def check_config_roundtrip(ctx: CheckContext) -> Outcome:
    """Every hyperparameter is where the style serializes it, with the value it was built with
    (the learning rate halved, so a stored default cannot pass for it), and comes back from the
    style's round trip into an optimizer built with other values; with a schedule object too
    where the style has them. Where a reload rebuilds from the constructor call (torch), what
    the constructor keeps elsewhere is noted, not failed: the reload does not lose it."""
    from_constructor = ctx.driver.capabilities.rebuilt_from_constructor
    unkept = [] if from_constructor else _unkept_switches(ctx)
    ignored = _ignored_arguments(ctx) if from_constructor else []
    outcome = _config_roundtrip(ctx, unkept, ignored)
    if outcome.status != "pass":
        return outcome
    bypass = clipping_bypassed(ctx)
    if bypass is not None:
        return _clipping_never_runs(ctx, bypass)
    defaults = changed_defaults(ctx)
    if defaults:  # the config a later optimizer is built with is not the one written
        return failed(
            changed_defaults_said(defaults),
            where=method_location(ctx, "__init__"),
            figure=float(len(defaults)),
            fix=CHANGED_DEFAULT_FIX,
        )
    if from_constructor:
        return _torch_arguments_act(ctx, ignored, outcome)
    if not unkept:
        return outcome
    names = ", ".join(repr(name) for name in unkept)
    return warned(
        f"{names} {'is' if len(unkept) == 1 else 'are'} not in {ctx.driver.config_name}, so a reloaded "
        f"optimizer takes the default whatever was given; built with other values, {UNKEPT_STEPS} steps are "
        "bitwise the same, so no update depends on it (a logging switch: adabelief-tf's print_change_log); "
        f"the rest of the config survives: {outcome.detail}",
        where=method_location(ctx, "get_config"),
        fix=ctx.driver.advice.keep_hyperparameters,
        figure=outcome.figure,
    )


# Steps an argument get_config leaves out is compared over, built with two values.
UNKEPT_STEPS = 3
# The framework's methods a class may override to apply the gradients itself.
APPLYING_METHODS = ("apply_gradients", "apply")


def clipping_bypassed(ctx: CheckContext) -> str | None:
    """The class's own override of the framework's apply method (apply, apply_gradients) that never
    runs the base's: built with the framework's clipping, its steps are bitwise those without, where
    the same gradients clipped by hand step otherwise (so a class whose update ignores the gradient's
    scale, a sign or a normalised update, is not taken for one); not a wrapper's, which holds another
    optimizer (`_a_wrapper`). Decided once per check run."""
    if "clipping_bypassed" not in ctx.notes:
        ctx.notes["clipping_bypassed"] = _clipping_bypassed(ctx)
    bypass: str | None = ctx.notes["clipping_bypassed"]
    return bypass


def _clipping_bypassed(ctx: CheckContext) -> str | None:
    clipping = ctx.driver.gradient_clipping
    own = user_classes(ctx.target.cls)
    override = next((m for m in APPLYING_METHODS if any(m in vars(k) for k in own)), None)
    if clipping is None or override is None or _hands_on_to_an_apply(ctx, override) or _a_wrapper(ctx):
        return None
    grads = [arrays(SHAPES, seed=40 + step) for step in range(UNKEPT_STEPS)]
    norm = clipping[1]
    by_hand = [[g * min(1.0, norm / float(np.linalg.norm(g))) for g in step] for step in grads]
    try:
        plain = _stepped(ctx, grads)
        if max_diff(_stepped(ctx, grads, clipping), plain) or not max_diff(_stepped(ctx, by_hand), plain):
            return None
    except (Exception, SystemExit):  # a class that refuses the setting, or a step that fails: not judged
        return None
    return override


# A call of an optimizer's apply method: super()'s, or an inner optimizer's (a wrapper shaped as Keras's
# LossScaleOptimizer, whose own clipnorm is never applied either: clipping is the inner's).
_APPLY_CALL = re.compile(r"\.(?:apply|apply_gradients)\(")


def _hands_on_to_an_apply(ctx: CheckContext, method: str) -> bool:
    """Whether the class's `method` override calls an optimizer's apply (its base's, a wrapped one's)."""
    return any(found.method == method and _APPLY_CALL.search(found.code) for found in user_method_lines(ctx))


def _a_wrapper(ctx: CheckContext) -> bool:
    """Whether the built optimizer holds another of its framework's optimizers (an attribute whose value
    is one, or a list, tuple, set or dict of them): a wrapper, which hands the step on to its inner
    optimizer's apply however deep in its helpers (Keras's LossScaleOptimizer: apply -> _common_apply ->
    inner_optimizer.apply), and whose own clipping setting is not applied, as Keras's own is not (the
    clipping is the inner optimizer's). A wrapper is not judged by this look."""
    try:
        optimizer, _ = fresh(ctx)
    except (Exception, SystemExit):  # a class that cannot be built: judged where the check builds it
        return False
    own = set(user_classes(ctx.target.cls))
    # The framework's root optimizer class: the most basic of the class's bases defining an apply method.
    roots = [
        k
        for k in type(optimizer).__mro__
        if k not in own and k is not object and any(m in vars(k) for m in APPLYING_METHODS)
    ]
    if not roots:
        return False
    try:
        values = list(vars(optimizer).values())
    except TypeError:  # no __dict__
        return False
    held: list[Any] = []
    for value in values:
        if isinstance(value, Mapping):
            held.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            held.extend(value)
        else:
            held.append(value)
    return any(isinstance(item, roots[-1]) and item is not optimizer for item in held)


def _stepped(
    ctx: CheckContext, grads: Sequence[Sequence[Any]], setting: tuple[str, float] | None = None
) -> list[Any]:
    """The variables and state after steps on `grads`, with the framework's `setting` set on the built
    optimizer (a user sets it in the constructor; the registry builds with the class's own params)."""
    with same_draws(ctx, seed=3):
        optimizer, variables = fresh(ctx)
        if setting is not None:
            setattr(optimizer, *setting)
        for step_grads in grads:
            ctx.driver.step(optimizer, variables, step_grads, ctx.needs)
    return ctx.driver.values(variables) + [value for _, value in ctx.driver.state(optimizer)]


def _clipping_never_runs(ctx: CheckContext, method: str) -> Outcome:
    name, norm = ctx.driver.gradient_clipping or ("", 0.0)
    return failed(
        f"built with {name}={norm:g}, {UNKEPT_STEPS} steps are bitwise those without it, where the same "
        f"gradients clipped by hand step otherwise: the class's {method}() override never runs the base "
        f"class's {method}(), so {ctx.driver.api_name}'s gradient clipping never runs (nor its weight_decay, "
        "use_ema and loss scaling)",
        where=method_location(ctx, method),
        fix=f"override update_step for the class's math and leave {method}() to the base class, or call "
        f"super().{method}(...) from the override with the gradients it changed",
    )


def _unkept_switches(ctx: CheckContext) -> list[str]:
    """The arguments get_config leaves out whose value changes no step (each built with its value and
    another, `UNKEPT_STEPS` steps bitwise alike): a reload loses the setting, not the training."""
    driver = ctx.driver
    try:
        config = driver.config(fresh(ctx)[0])[0]
    except Exception:  # judged where the check builds it
        return []
    found = []
    for name, value in with_defaults(ctx.target, ctx.params).items():
        param = ctx.target.entry.params.get(name)
        if name == "lr" or value is None or param is None or native(ctx, name) in config:
            continue
        other = _other_value(param, value)
        if other is None or not _same_steps(ctx, {name: value}, {name: other}):
            continue
        # Not where a reload gives it back all the same (a wrapper's, in its serialized inner optimizer).
        built_other, _ = fresh(ctx, **{name: other})
        if not driver.reload_holds(built_other, name, other, is_rate=False):
            found.append(name)
    return found


def _same_steps(ctx: CheckContext, *builds: Mapping[str, Any], steps: int = UNKEPT_STEPS) -> bool:
    """Whether optimizers built with each of `builds` step bitwise alike (on the same draws)."""
    runs = []
    for overrides in builds:
        with same_draws(ctx, seed=3):
            try:
                optimizer, variables = fresh(ctx, **overrides)
                for step in range(steps):
                    ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=40 + step), ctx.needs)
            except (Exception, SystemExit):  # refused alone, a step that fails, an import that exits
                return False
            runs.append(ctx.driver.values(variables) + [value for _, value in ctx.driver.state(optimizer)])
    return all(max_diff(runs[0], run) == 0 for run in runs[1:])


# Steps an argument a torch class keeps in no param group is compared over, built with two values:
# enough for one that acts late (a warm-up, an update every few steps) to show.
IGNORED_STEPS = WARMUP_STEPS
# Arguments that may rightly change no step at the checks' settings: the framework's own switches
# (judged below where they have a definition to meet), logging, device and seed plumbing, and a
# switch to another implementation of the same update (lion-pytorch's `use_triton`).
_PLUMBING = re.compile(
    r"verbose|print|log|debug|device|seed|name|warn|triton|cuda|kernel|compile|fused|foreach", re.IGNORECASE
)


def _ignored_arguments(ctx: CheckContext) -> list[str]:
    """The constructor's arguments a torch class reads from its param groups by name but keeps in no
    group, whose value changes none of `IGNORED_STEPS` steps (built with it and with another, bitwise
    alike): accepted and never acting (QHAdam's `nus` stored as `nu`, read back as a default)."""
    try:
        built = fresh(ctx)[0]
        groups = ctx.driver.config(built)
    except Exception:  # judged where the check builds it
        return []
    # Only an argument the step reads from its group under its own name (`group.get("nus", ...)`) that
    # no group holds: one kept elsewhere and unseen in a few steps is likelier a mode not taken
    # (AdaBelief's `n_sma_threshold` without `rectify`, an argument for the save alone).
    read = ctx.target.entry.group_keys() or frozenset()
    found = []
    for name, value in with_defaults(ctx.target, ctx.params).items():
        param, key = ctx.target.entry.params.get(name), native(ctx, name)
        if name == "lr" or value is None or param is None or key not in read:
            continue
        if any(key in group for group in groups):
            continue
        if key in FRAMEWORK_SWITCHES or _PLUMBING.search(key):
            continue
        # Kept as an attribute under its own name, it is the fallback a group may override
        # (`group.get("max_grad_norm", self.max_grad_norm)`): it acts, maybe only past the checks' scale.
        if same_value(getattr(built, key, None), value):
            continue
        other = _other_value(param, value)
        if other is not None and all(
            _same_steps(ctx, {**modes, name: value}, {**modes, name: other}, steps=IGNORED_STEPS)
            for modes in _modes_on(ctx, name)
        ):
            found.append(name)
    return found


def _modes_on(ctx: CheckContext, name: str) -> list[dict[str, Any]]:
    """The settings an argument is tried under besides `name`: the other number arguments given as 0
    each made `_changed` (weight_decay 0.01: a switch for a mode they turn off, as lion-pytorch's
    `decoupled_weight_decay` with no decay, acts only with them on), alone and with each other value
    of a choice or flag (A2Grad keeps `rho` in its groups only for `variant='exp'`)."""
    values = with_defaults(ctx.target, ctx.params)
    params = ctx.target.entry.params
    woken: dict[str, Any] = {}
    modes: list[dict[str, Any]] = []
    for other, value in values.items():
        param = params.get(other)
        if other in (name, "lr") or param is None:
            continue
        if is_number(value) and value == 0 and (changed := _changed(param, value)) is not None:
            woken[other] = changed
        elif isinstance(value, bool):
            modes.append({other: not value})
        elif param.type == "choice":
            modes += [{other: choice} for choice in param.choices if choice != value]
    return [woken] + [{**woken, **mode} for mode in modes]


def _torch_arguments_act(ctx: CheckContext, ignored: Sequence[str], outcome: Outcome) -> Outcome:
    """config_roundtrip's pass, or a warn naming the arguments that are accepted but do not act as
    given: those in no group that change no step, a `maximize` or `foreach` that does not meet torch's
    definition (see `_switch_problems`)."""
    said, fixes, where = [], [], None
    if ignored:
        values = with_defaults(ctx.target, ctx.params)
        params = ctx.target.entry.params
        tried = "; ".join(
            f"{name}={values[name]!r} and {_other_value(params[name], values[name])!r}" for name in ignored
        )
        names = ", ".join(repr(name) for name in ignored)
        said.append(
            f"{names} {'is' if len(ignored) == 1 else 'are'} accepted but kept in no param group, though the "
            f"step reads the groups for {'it' if len(ignored) == 1 else 'them'}, and built with another "
            f"value ({tried}) did not change any of {IGNORED_STEPS} steps: the value given never acts "
            "(stored under another name, read back as a default)"
        )
        fixes.append(
            "pass each argument into the defaults given to Optimizer.__init__ under its own name and read it "
            "from the group in step(); drop an argument the update does not use"
        )
        where = method_location(ctx, "__init__")
    for problem, fix in _switch_problems(ctx):
        said.append(problem)
        fixes.append(fix)
        where = where or method_location(ctx, "step")
    if not said:
        return outcome
    return warned(
        "; ".join(said) + f"; the rest of the config: {outcome.detail}",
        where=where or ctx.where(),
        fix="; ".join(fixes),
        figure=outcome.figure,
    )


# Steps a torch switch's two settings are compared over, and how far apart (relative to the variables'
# size, at least 1) they may end: float rounding (torch's ASGD's foreach path is 1.2e-7 from its loop),
# not another update.
SWITCH_STEPS = 3
SWITCH_TOLERANCE = 1e-5


def _switch_problems(ctx: CheckContext) -> list[tuple[str, str]]:
    """Where the torch class's constructor takes them, `maximize=True` on gradients g must step like
    `maximize=False` on -g (torch's definition), and `foreach=True` like `foreach=False`: jobs leave
    both at their defaults, but a user's own loop sets them. Each problem with its fix."""
    entry = ctx.entry
    if (
        ctx.target.style != "torch"
        or entry.needs.base_optimizer is not None
        or entry.needs.model_argument is not None
        or ctx.setup.param_groups
    ):
        return []
    try:
        takes = inspect.signature(entry.cls).parameters
    except (TypeError, ValueError):
        return []
    problems = []
    if "maximize" in takes:
        apart = _switch_apart(ctx, ({"maximize": True}, 1.0), ({"maximize": False}, -1.0))
        if apart is not None:
            problems.append(
                (
                    f"built with maximize=True, {SWITCH_STEPS} steps on gradients g end up to {apart:.3g} "
                    "from maximize=False on -g, which torch defines them to equal: maximize is accepted but "
                    "not honoured",
                    "negate the gradient where group['maximize'] is set (`grad = -p.grad if maximize else "
                    "p.grad`), as torch's optimizers do",
                )
            )
    if "foreach" in takes:
        apart = _switch_apart(ctx, ({"foreach": True}, 1.0), ({"foreach": False}, 1.0))
        if apart is not None:
            problems.append(
                (
                    f"built with foreach=True, {SWITCH_STEPS} steps end up to {apart:.3g} from foreach=False "
                    "on the same gradients: the foreach path computes another update than the per-parameter "
                    "loop",
                    "make the foreach path compute the update the loop does (run both on the same gradients)",
                )
            )
    return problems


def _switch_apart(ctx: CheckContext, *runs: tuple[Mapping[str, Any], float]) -> float | None:
    """How far the variables end after `SWITCH_STEPS` steps of each run (switches given to the
    constructor, a sign the gradients take), where more than `SWITCH_TOLERANCE` allows; None where
    they are close, or a run cannot be made (a switch refused: nothing shown)."""
    ends = []
    for switches, sign in runs:
        kwargs = {**ctx.entry.kwargs(ctx.params), **switches}
        with same_draws(ctx, seed=5):
            try:
                variables = ctx.driver.variables(arrays(SHAPES, 0, mean=1.0))
                optimizer = ctx.driver.optimizer_over(functools.partial(ctx.entry.cls, **kwargs), variables)
                for step in range(SWITCH_STEPS):
                    grads = [sign * g for g in arrays(SHAPES, seed=50 + step)]
                    ctx.driver.step(optimizer, variables, grads, ctx.needs)
                ends.append(ctx.driver.values(variables))
            except Exception:  # refused, or a step that fails: judged by the other checks
                return None
    apart = max_diff(*ends)
    size = max([1.0] + [float(np.max(np.abs(end))) for end in ends[0] if end.size])
    return apart if apart > SWITCH_TOLERANCE * size else None


def _config_roundtrip(ctx: CheckContext, unkept: Collection[str], ignored: Collection[str] = ()) -> Outcome:
    """config_roundtrip, `unkept` (arguments no step depends on) left out of what must be kept;
    `ignored` (torch: arguments in no group that change no step) said apart from those a reload
    gives back."""
    driver = ctx.driver
    problem, elsewhere, caches = _config_problem(ctx, schedule=False, unkept=unkept)
    if problem is not None:
        return problem
    count = len(ctx.target.entry.params) - len(unkept)
    if driver.capabilities.rebuilt_from_constructor:
        kept = [note for name, note in elsewhere.items() if name not in ignored]
        said = _groups_survive(ctx, count - len(ignored), kept, caches)
        return passed(said, float(count - len(elsewhere)))
    problem = _stored_as_a_fixed_value(ctx)
    if problem is not None:
        return problem
    where_kept = f"{driver.config_name} carries all {count} hyperparameters with their values and survives"
    if not driver.capabilities.schedule_objects:
        return passed(f"{where_kept} {driver.config_roundtrip_name}", float(count))
    if not ctx.has_lr:  # it fixes its own rate (A2Grad, COCOB): no schedule to give it
        return passed(
            f"{where_kept} {driver.config_roundtrip_name} (the class takes no learning rate, so none was "
            f"tried with {driver.schedule_name})",
            float(count),
        )
    refused = refused_rate(ctx)
    if refused is not None:  # it sets its own step size with these values (Adafactor's relative step)
        return passed(
            f"{where_kept} {driver.config_roundtrip_name} (not tried with {driver.schedule_name}: with these "
            f"hyperparameters the class refuses a learning rate, {ctx.describe_error(refused)})",
            float(count),
        )
    try:
        problem, _, _ = _config_problem(ctx, schedule=True, unkept=unkept)
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


def _stored_as_a_fixed_value(ctx: CheckContext) -> Outcome | None:
    """A config that writes a number as a fixed value (`"beta": 0.001` for `"beta": self.beta`) looks
    right at the defaults, where the rest of the check builds. So each number left at its default
    is built changed, alone, and must be in the config as the optimizer holds it. Only where the
    optimizer's own attribute holds the value given: a class may clamp or derive a value, and then
    its config rightly stores what it uses."""
    driver = ctx.driver
    built_with = with_defaults(ctx.target, ctx.params)
    for name, param in ctx.target.entry.params.items():
        if name == "lr":
            continue  # compared halved at the build above
        value = _other_value(param, built_with.get(name))  # a switch flipped too (amsgrad=True)
        if value is None:
            continue
        key = native(ctx, name)
        try:
            optimizer, _ = fresh(ctx, **{name: value})
            config = driver.config(optimizer)[0]
        except Exception:  # refused alone (a rule between arguments): nothing to compare
            continue
        held = getattr(optimizer, key, None)
        try:
            fixed = key in config and same_value(held, value) and not same_value(config[key], value)
        except Exception:  # a value the optimizer holds in a form that cannot take it: not compared
            continue
        if fixed:
            return failed(
                f"{driver.config_name}[{key!r}] is {config[key]!r} for an optimizer built with "
                f"{key}={value!r} (and holding it as self.{key}): the config stores a fixed value, so a "
                f"reloaded optimizer would use {config[key]!r}",
                where=method_location(ctx, "get_config"),
                fix=f"store the value the optimizer was built with ({key!r}: self.{key})",
            )
        if key in config and same_value(held, value):
            dropped = _dropped_by_from_config(ctx, optimizer, key, value)
            if dropped is not None:
                return dropped
    return None


def _dropped_by_from_config(ctx: CheckContext, optimizer: Any, key: str, value: Any) -> Outcome | None:
    """A `from_config` of the class's own that loses `key` (a whitelist of keys written before a
    switch was added): the config holds the value built, the optimizer it rebuilds holds another, so
    every reload silently falls back to the default. None where the rebuild cannot be made (the
    round trip itself judges that) or holds the value."""
    driver = ctx.driver
    try:
        reloaded = driver.config_roundtrip(optimizer, lambda: fresh(ctx)[0])[0]
    except Exception:
        return None
    if key not in reloaded or same_value(reloaded[key], value):
        return None
    if driver.reload_holds(optimizer, key, value, is_rate=False):
        return None
    return failed(
        f"{key} built as {value!r} comes back from {driver.config_roundtrip_name} as {reloaded[key]!r}, "
        f"though {driver.config_name} holds {value!r}: from_config drops it, so every reload (load_model, a "
        "job's checkpoints) silently uses the default",
        where=method_location(ctx, "from_config"),
        fix="pass every key of the config on to the constructor in from_config (convert what needs it, "
        "then cls(**config)), or leave from_config to the base class",
    )


def _other_value(param: Any, value: Any) -> Any:
    """A value to build with instead of `value`: a flag flipped, a number `_changed`, a tuple or list
    of numbers (betas, QHAdam's nus) each halved; else None."""
    if isinstance(value, bool):
        return not value
    if (
        param.type in _HALVED_EACH
        and isinstance(value, list | tuple)
        and value
        and all(is_number(v) for v in value)
    ):
        return type(value)(item * 0.5 for item in value)
    return _changed(param, value)


# Hyperparameter kinds that hold several numbers, each changed alone where one is tried other.
_HALVED_EACH = ("float_pair", "float_tuple", "float_list")


# A number this small is an epsilon (or a decay) whose half the step may not see: AdaBelief's 1e-16
# added to a second moment of 1e-5 is below float32's resolution, halved or not. It is built with
# a value orders of magnitude larger instead, at most `SEEN_VALUE` (but never less than twice it).
TINY = 1e-3
SEEN_VALUE = 1e-3


def _changed(param: Any, default: Any) -> float | int | None:
    """A value of a number hyperparameter other than `default` (the one the check builds with),
    within its allowed range, and one the step can see: a small positive one (below `TINY`, an
    epsilon) made 1e6 times larger, at most `SEEN_VALUE` but at least twice the default (halving
    1e-16 changed no bit of a step, so a get_config that lost AdaBelief's epsilon was taken for one
    losing a logging switch); where that is out of range, doubled or halved; else
    halved in (0, 1) (a beta), doubled, or 0.01 for a default of 0; None for other kinds."""
    if param.type not in ("float", "int", "number") or isinstance(default, bool):
        return None
    if not isinstance(default, int | float):
        return None
    if param.type == "int" or (param.type == "number" and isinstance(default, int)):
        # A count written as an integer stays one (adabelief-tf's `total_steps=0` in an int32 variable).
        candidates: list[float | int] = [default + 1, default - 1]
    elif default == 0:
        candidates = [0.01]
    elif 0 < default < TINY:
        # At least twice the default: capped at SEEN_VALUE alone, 9e-4 had been built as 1e-3, a change
        # smaller than the halving it replaced, and a lost value there likelier read as changing no step.
        candidates = [max(min(default * 1e6, SEEN_VALUE), default * 2), default * 2, default * 0.5]
    else:
        candidates = [default * 0.5, default * 2] if 0 < abs(default) < 1 else [default * 2, default * 0.5]
    return next((value for value in candidates if param.in_range(value)), None)


def _groups_survive(ctx: CheckContext, count: int, elsewhere: Sequence[str], caches: str) -> str:
    driver = ctx.driver
    survives = f"{driver.config_name} survives {driver.config_roundtrip_name} unchanged"
    if not elsewhere:
        return f"{survives}, carrying all {count} hyperparameters with their values{caches}"
    return (
        f"{survives}; {len(elsewhere)} of {count} hyperparameters are not there as given ("
        + "; ".join(elsewhere[:4])
        + (f"; {len(elsewhere) - 4} more" if len(elsewhere) > 4 else "")
        + "): a reload takes those from the constructor call, so none is lost (per-group values and "
        f"schedulers cannot reach them){caches}"
    )


def _config_problem(
    ctx: CheckContext, *, schedule: bool, unkept: Collection[str] = ()
) -> tuple[Outcome | None, dict[str, str], str]:
    """The first fault of the config (None if none), the hyperparameters kept outside it or
    transformed, where the style's reload rebuilds from the constructor call, and what the pass
    says of the private group keys the class's save leaves out (`_caches_left_out`); `unkept`
    (arguments no step depends on) are left out of what must be kept."""
    driver = ctx.driver
    lr_arg = ctx.target.entry.lr_arg
    # A None left to the class (`beta3: float | None = None`) may be stored as the value the class
    # derives from it, and a reload that passes that value on builds the same optimizer: nothing to
    # compare.
    expected = {
        native(ctx, k): v
        for k, v in with_defaults(ctx.target, ctx.params).items()
        if v is not None and k not in unkept
    }
    # The rate halved, so a stored default cannot pass (unless the class refuses one: Adafactor).
    halved: dict[str, Any] = {"lr": ctx.lr * 0.5} if takes_a_rate(ctx) else {}
    if halved:
        expected[lr_arg] = ctx.lr * 0.5
    learning_rate = driver.learning_rate_schedule(ctx.lr * 0.5) if schedule else None
    with_what = f" (built with {driver.schedule_name})" if schedule else ""
    optimizer, variables = fresh(ctx, learning_rate=learning_rate, **halved)
    try:
        configs = driver.config(optimizer)
    except ConfigNotSerialized as exc:  # a get_config that returns None
        return failed(f"{exc}{with_what}", where=method_location(ctx, exc.method), fix=exc.fix), {}, ""
    rate_key = _rate_key(configs, lr_arg)
    if rate_key != lr_arg and lr_arg in expected:
        expected[rate_key] = expected.pop(lr_arg)
    from_constructor = driver.capabilities.rebuilt_from_constructor
    # As constructed: a class may adapt its groups' values in training by design (an adaptive lr).
    elsewhere = (
        _kept_elsewhere(configs, expected, _recipe_values(ctx, len(configs))) if from_constructor else {}
    )
    driver.step(
        optimizer, variables, arrays(SHAPES, seed=30), ctx.needs
    )  # legacy: hyperparameters now variables
    if schedule:
        expected.pop(rate_key, None)  # serialized as the schedule, compared with the round trip below
    where = method_location(ctx, "__init__")
    required = {native(ctx, name) for name, param in ctx.target.entry.params.items() if param.required}
    # The optimizer the round trip loads into (torch builds one, Keras's from_config another way),
    # kept so that a next step can show what a cache the class's save leaves out does to it.
    reload_targets: list[tuple[Any, list[Any]]] = []

    def reload_target() -> Any:
        reload_targets.append(fresh(ctx, seed=1))
        return reload_targets[-1][0]

    def held_on_reload(name: str, value: Any) -> bool:
        """Whether a reload holds `value` where no key of the config holds it as given (a wrapper's rate
        in its serialized inner optimizer). A value no key holds is read back built changed (the
        rate is, halved): a reload that drops it falls back to the default it was built with."""
        is_rate = name == rate_key
        if is_rate or name in configs[0]:
            return driver.reload_holds(optimizer, name, value, is_rate=is_rate)
        param = ctx.target.entry.params.get(name)
        other = None if param is None else _other_value(param, value)
        if other is None:  # a value no other can stand for (a name, a list): not shown to be kept
            return False
        try:
            changed, _ = fresh(ctx, **{name: other})
        except Exception:  # refused alone (a rule between arguments): not shown to be kept
            return False
        return driver.reload_holds(changed, name, other, is_rate=False)

    try:
        built = driver.config(optimizer)
        problems = (
            []
            if from_constructor
            else _missing(
                driver.config_name,
                built,
                expected,
                f"after construction{with_what}",
                held_on_reload,
                required,
            )
        )
        if problems:
            return (
                failed("; ".join(problems), where=where, fix=driver.advice.keep_hyperparameters),
                elsewhere,
                "",
            )
        # A copy: the next step that `_caches_left_out` runs on the reloaded optimizer changes a group's
        # tensors in place (a per-group step count), which the comparison below must not see.
        reloaded = _copied(driver.config_roundtrip(optimizer, reload_target))
    except ConfigNotSerialized as exc:
        return failed(f"{exc}{with_what}", where=method_location(ctx, exc.method), fix=exc.fix), elsewhere, ""
    when = f"after {driver.config_roundtrip_name}{with_what}"
    problems = (
        []
        if from_constructor
        else _missing(driver.config_name, reloaded, expected, when, held_on_reload, required)
    )
    if problems:
        return failed("; ".join(problems), where=where, fix=driver.advice.keep_hyperparameters), elsewhere, ""
    left_out = driver.config_left_out_of_save(optimizer)
    caches, step_error = _caches_left_out(ctx, left_out, reload_targets)
    for index, (first, again) in enumerate(zip(built, reloaded, strict=True)):
        differing = sorted(
            k
            for k in first.keys() | again.keys()
            if (index, k) not in caches and not same_value(first.get(k), again.get(k))
        )
        if differing:
            saved_without = (index, differing[0]) in left_out
            lost = _lost_group_value(
                ctx, optimizer, index, differing, (first, again), when, saved_without, step_error
            )
            return lost, elsewhere, ""
    return None, elsewhere, _caches_said(driver.config_name, caches)


def _copied(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`configs` with their values copied (as they stand), where they can be; else as given."""
    try:
        return copy.deepcopy(configs)
    except Exception:  # a value that cannot be copied (a lock, a module): compared as it is
        return configs


def _caches_left_out(
    ctx: CheckContext, left_out: Sequence[tuple[int, str]], reloads: Sequence[tuple[Any, list[Any]]]
) -> tuple[dict[tuple[int, str], bool], str | None]:
    """The private group keys (a leading underscore) the class's own save leaves out on purpose, each
    with whether the next step after the reload put it back, where that step runs; else what the step
    raised. heavyball keeps per-step caches so (`_sf_step`) and its state_dict() drops every `_` key:
    its next step rebuilds them, and a resume is exact. Not a config fault then; whether a resumed run
    matches is resume_exact's to judge. A key a user could set per group (no underscore) is a
    hyperparameter: a lost one stays a fault, as does a cache a next step cannot run without."""
    private = [(index, key) for index, key in left_out if key.startswith("_")]
    if not private or not reloads:
        return {}, None
    reloaded, variables = reloads[-1]
    try:
        ctx.driver.step(reloaded, variables, arrays(SHAPES, seed=31), ctx.needs)
    except Exception as exc:
        return {}, ctx.describe_error(exc)
    after = ctx.driver.config(reloaded)
    return {(index, key): index < len(after) and key in after[index] for index, key in private}, None


def _caches_said(config_name: str, caches: Mapping[tuple[int, str], bool]) -> str:
    """What the pass adds for the caches `_caches_left_out` found ('' for none)."""
    if not caches:
        return ""
    named = [f"{config_name}[{index}][{key!r}]" for index, key in sorted(caches)]
    shown = listed(named, 4)
    if all(caches.values()):
        after = "rebuilt by the next step"
    elif not any(caches.values()):
        after = "not rebuilt by the next step, which ran without it (resume_exact judges a resumed run)"
    else:
        after = "rebuilt or done without by the next step (resume_exact judges a resumed run)"
    return (
        f"; {shown}, left out by the class's own save on purpose, private by the leading underscore: a "
        f"cache, not a hyperparameter, {after}"
    )


def _lost_group_value(
    ctx: CheckContext,
    optimizer: Any,
    index: int,
    differing: Sequence[str],
    configs: tuple[Mapping[str, Any], Mapping[str, Any]],
    when: str,
    saved_without: bool,
    step_error: str | None,
) -> Outcome:
    """The fail for group `index`'s values `differing` after the round trip: the first, said with its
    cause where it shows (the class's save leaves it out; per-parameter state kept in a group) and
    pointed at the code that causes it."""
    driver = ctx.driver
    first, again = configs
    key = differing[0]
    name = f"{driver.config_name}[{index}][{key!r}]"
    more = f" ({len(differing) - 1} more keys)" if len(differing) > 1 else ""
    if key not in again:
        change = f"was {_shown(first[key])} and is missing {when}{more}"
    elif key not in first:
        change = f"was missing and is {_shown(again[key])} {when}{more}"
    else:
        change = f"was {_shown(first[key])} and is {_shown(again[key])} {when}{more}"
    if saved_without and key not in again:  # only a torch state_dict() override leaves a group key out
        why = "the class's own state_dict() leaves it out of the groups it saves"
        if step_error is not None:
            why += f", and the next step after the reload raised {step_error}"
        return failed(
            f"{name} {change}: {why}",
            where=method_location(ctx, "state_dict"),
            fix="save every param-group key in state_dict() (or leave the save to torch's): "
            "load_state_dict() restores the groups as saved, so a key left out is lost; only a private "
            "cache ('_' key) that a step can do without, or rebuilds, may be left out",
        )
    if _keyed_by_arrays(first.get(key)):  # per-parameter state: grokadamw's group['state'][p]
        return failed(
            f"{name} holds per-parameter state keyed by the parameters themselves ({_shown(first[key])}) and "
            f"is not the same {when}{more}: torch saves self.state per parameter and maps it onto the "
            "reloaded optimizer's parameters, but restores a group's values as saved",
            where=method_location(ctx),
            fix=driver.advice.state_in_checkpoint,
        )
    overrides = driver.save_overrides(optimizer)
    fix = driver.advice.keep_hyperparameters
    if overrides:
        fix += f" (the class's own {', '.join(f'{m}()' for m in overrides)} must not drop or rewrite them)"
    return failed(
        f"{name} {change}",
        where=method_location(ctx, overrides[0] if overrides else "__init__"),
        fix=fix,
    )


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _keyed_by_arrays(value: Any) -> bool:
    return isinstance(value, Mapping) and any(_is_array(key) for key in value)


def _shown(value: Any, limit: int = 120) -> str:
    """A group value as a message shows it: an array of more than one element, and any array used as
    a key, by its kind and shape (a repr prints every element, and a key is there by identity); a
    mapping or sequence holding such arrays by its first item and size; anything else by its repr,
    cut at `limit`."""
    if _is_array(value) and _elements(value) > 1:
        return _array_name(value)
    if isinstance(value, Mapping) and value and _holds_arrays(value):
        key, item = next(iter(value.items()))
        first = f"{_array_name(key) if _is_array(key) else _shown(key, 40)}: {_shown(item, 60)}"
        return "{" + first + (f", ... {len(value)} entries" if len(value) > 1 else "") + "}"
    if isinstance(value, list | tuple) and value and _holds_arrays(value):
        return "[" + _shown(value[0], 60) + (f", ... {len(value)} items" if len(value) > 1 else "") + "]"
    return _cut(" ".join(repr(value).split()), limit)


def _holds_arrays(value: Any) -> bool:
    if _is_array(value):
        return True
    if isinstance(value, Mapping):
        return any(_is_array(key) or _holds_arrays(item) for key, item in value.items())
    return isinstance(value, list | tuple) and any(_holds_arrays(item) for item in value)


def _elements(value: Any) -> int:
    try:
        return int(np.prod(tuple(value.shape)))
    except (TypeError, ValueError):  # a dimension not known yet (a symbolic shape): not one element
        return 2


def _array_name(value: Any) -> str:
    return f"<{type(value).__name__} of shape {tuple(value.shape)}>"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rate_key(configs: Sequence[Mapping[str, Any]], lr_arg: str) -> str:
    """Where the config holds the rate: under the constructor's name for it, or under `lr` where a
    torch class takes `learning_rate` and stores it as torch's schedulers expect it."""
    if lr_arg != "lr" and not any(lr_arg in config for config in configs) and any("lr" in c for c in configs):
        return "lr"
    return lr_arg


def _kept_elsewhere(
    configs: Sequence[Mapping[str, Any]], expected: Mapping[str, Any], recipe: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Each hyperparameter not in every group as given, in a few words, by name. A group the recipe
    gave a value of its own (`weight_decay: 0.0` for biases) is compared with that value."""
    notes = {}
    for name, value in expected.items():
        absent = [config for config in configs if name not in config]
        if absent:
            notes[name] = f"{name!r} not in {'any' if len(absent) == len(configs) else 'every'} group"
            continue
        given = [
            recipe[index].get(name, value) if index < len(recipe) else value for index in range(len(configs))
        ]
        stored = next(
            (
                (config[name], was)
                for config, was in zip(configs, given, strict=True)
                if not same_value(config[name], was)
            ),
            None,
        )
        if stored is not None:
            notes[name] = f"{name!r} stored as {stored[0]!r}, given {stored[1]!r}"
    return notes


def _recipe_values(ctx: CheckContext, count: int) -> list[dict[str, Any]]:
    """The values the param-group recipe gives each of the `count` groups a check's optimizer has
    (none without a recipe, or where its groups do not line up with them)."""
    if not ctx.setup.param_groups:
        return []
    try:
        # The recipe's groups over the check's variables, as `ctx.build` makes them.
        groups = ctx._grouped(ctx.driver.variables(arrays(SHAPES, 0)))
    except Exception:  # a recipe the check's variables cannot take: compared with the constructor's
        return []
    if len(groups) != count:
        return []
    return [{key: value for key, value in group.items() if key != "params"} for group in groups]


def _missing(
    config_name: str,
    configs: Sequence[Mapping[str, Any]],
    expected: Mapping[str, Any],
    when: str,
    reloads: Callable[[str, Any], bool] | None = None,
    required: Collection[str] = (),
) -> list[str]:
    """Comparing a config with its reload cannot see an argument missing from both: a reloaded
    optimizer would silently use its default. So each built value is looked for by name, and where
    no key holds it as given, in what `reloads` says an optimizer rebuilt from the config holds (a
    wrapper's rate inside its serialized inner optimizer). An argument in `required` has no default
    to fall back on: the reload raises instead."""
    problems = []
    for name, value in expected.items():
        if (
            reloads is not None
            and any(not same_value(c.get(name), value) for c in configs)
            and reloads(name, value)
        ):
            continue
        for index, config in enumerate(configs):
            # One config (a Keras get_config(), a single param group) is named without an index.
            where = f"{config_name}[{index}]" if len(configs) > 1 else config_name
            if name not in config:
                problems.append(
                    f"hyperparameter {name!r} is not in {where} {when}; "
                    + (
                        "the constructor requires it (no default), so a reload raises TypeError for the "
                        "missing argument"
                        if name in required
                        else "a reloaded optimizer would silently use its default"
                    )
                )
                break
            if not same_value(config[name], value):
                problems.append(f"{where}[{name!r}] is {config[name]!r} {when}, expected {value!r}")
                break
    return problems


# -- state_roundtrip ---------------------------------------------------------------------------------


def _unsaved_attributes(stepped: Any, restored: Any) -> list[str]:
    """The plain numbers the optimizer keeps as attributes of its own that differ between the
    uninterrupted optimizer and the restored one, and its random number generators that would draw
    differently: state the save never saw (`self.t += 1` in the step, SGLD's private generator),
    named so the user knows which. Only read once a next step has differed."""
    theirs = getattr(restored, "__dict__", {})
    written = attributes_written_by_the_user(type(stepped))
    mine = {name: value for name, value in getattr(stepped, "__dict__", {}).items() if name in written}
    numbers = [
        f"self.{name} is {value!r} in the uninterrupted optimizer and {theirs.get(name)!r} in the "
        "restored one"
        for name, value in plain_numbers(stepped).items()
        if name in written
        and value == value  # a NaN differs from itself, and says nothing here
        and theirs.get(name) != value
    ]
    generators = _unsaved_generators(stepped, restored)
    arrays_kept = [
        f"self.{name} holds {len(kept)} array(s) ({type(value).__name__}) that differ in the restored "
        "optimizer: the save does not see them; keep them in the optimizer's saved state"
        for name, value in mine.items()
        if (kept := _arrays_in(value)) and not same_arrays(kept, _arrays_in(theirs.get(name)))
    ]
    inner = [
        f"self.{name} is an optimizer of its own ({type(value).__name__}) whose state the save does not "
        f"hold: put its state_dict() in yours and load it back, or share its state (`self.state = "
        f"self.{name}.state`)"
        for name, value in mine.items()
        if (kept := _inner_state(value)) and not same_arrays(kept, _inner_state(theirs.get(name)))
    ]
    return numbers + generators + arrays_kept + inner


def _generator_states(optimizer: Any) -> dict[str, Any]:
    """The state of each random number generator the optimizer keeps as an attribute of its own."""
    written = attributes_written_by_the_user(type(optimizer))
    return {
        name: state
        for name, value in getattr(optimizer, "__dict__", {}).items()
        if name in written and (state := _random_state(value)) is not None
    }


def _unsaved_generators(stepped: Any, restored: Any, only: Collection[str] | None = None) -> list[str]:
    """The random number generators the optimizer keeps as attributes of its own that would draw
    differently in the restored optimizer: state the save never saw (SGLD's, a Hutchinson probe's);
    `only` those named, where given (the ones the steps drew from)."""
    said = []
    for name in _unsaved_generator_names(stepped, restored, only):
        value = getattr(stepped, name)
        said.append(
            f"self.{name} is a random number generator ({'.'.join(generator_kind(value))}) the save does "
            f"not hold, so the restored one draws other numbers: {_generator_advice(name, value)}"
        )
    return said


def _unsaved_generator_names(stepped: Any, restored: Any, only: Collection[str] | None = None) -> list[str]:
    theirs = getattr(restored, "__dict__", {})
    written = attributes_written_by_the_user(type(stepped))
    if only is not None:
        written &= set(only)
    return [
        name
        for name, value in getattr(stepped, "__dict__", {}).items()
        if name in written
        and (state := _random_state(value)) is not None
        and state != _random_state(theirs.get(name))
    ]


def _inner_state(value: Any) -> list[np.ndarray]:
    """The arrays a torch optimizer held in an attribute keeps as state (a wrapper's base: SAM's
    `self.base_optimizer`); nothing for anything else."""
    if not hasattr(value, "param_groups") or not isinstance(getattr(value, "state", None), Mapping):
        return []
    return [array for entry in value.state.values() for array in _arrays_in(entry)]


def _arrays_in(value: Any) -> list[np.ndarray]:
    """The arrays (tensors) an attribute holds itself, or as the values of a dict or list: state a
    class keeps beside the framework's (`self.momenta[p] = torch.zeros_like(p)`)."""
    if isinstance(value, Mapping):
        items = list(value.values())
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        items = [value]
    found = []
    for item in items:
        if hasattr(item, "shape") and hasattr(item, "dtype") and not isinstance(item, type):
            try:
                found.append(np.asarray(item.detach().cpu() if hasattr(item, "detach") else item))
            except (TypeError, ValueError, RuntimeError):
                return []  # not readable as numbers here: say nothing of it
    return found


# Keras 3's generator, which keeps its state in a variable of its own.
_KERAS_SEED_GENERATOR = ("keras", "SeedGenerator")


def _generator_advice(name: str, value: Any) -> str:
    """How to make a save hold the generator kept as `self.<name>`."""
    if generator_kind(value) == _KERAS_SEED_GENERATOR:
        return _keras_seed_fix(name)
    return (
        "save its state in state_dict() (get_state() gives it as a tensor) or draw from torch's global "
        "generator, which a job's checkpoint saves"
    )


def _unsaved_seed_generator_fix(stepped: Any, restored: Any) -> str | None:
    """The fix for the first Keras SeedGenerator the save does not hold, if there is one."""
    return next(
        (
            _keras_seed_fix(name)
            for name in _unsaved_generator_names(stepped, restored)
            if generator_kind(getattr(stepped, name)) == _KERAS_SEED_GENERATOR
        ),
        None,
    )


def _keras_seed_fix(name: str) -> str:
    return (
        f"its state is a variable that is not among optimizer.variables, which every checkpoint and "
        f"whole-model save holds; register it in build(): self._track_variable(self.{name}.state)"
    )


def _random_state(value: Any) -> bytes | None:
    """A random number generator's state as bytes (None for anything else)."""
    if generator_kind(value) not in RANDOM_GENERATORS:
        return None
    if generator_kind(value) == _KERAS_SEED_GENERATOR:
        return bytes(np.asarray(value.state.numpy()).tobytes())
    if hasattr(value, "bit_generator"):  # numpy's Generator
        state: Any = value.bit_generator.state
    else:
        state = value.get_state() if hasattr(value, "get_state") else value.getstate()
    if hasattr(state, "numpy"):  # torch's, a byte tensor: a pickle of two equal ones may differ
        return bytes(state.numpy().tobytes())
    return pickle.dumps(state)


@isolated
def check_state_roundtrip(ctx: CheckContext) -> Outcome:
    """Save after 3 steps, restore into a never-stepped optimizer over equal variables: the state
    must come back equal, and the next step bitwise equal to the uninterrupted one (which catches
    state the save never sees, since both copies would lack it alike). A class with an evaluation
    mode (schedule-free) is saved in it, as a job saves, and must evaluate the same variables
    after the restore."""
    driver = ctx.driver
    overrides = ctx.stateful_overrides()
    optimizer, variables = fresh(ctx, **overrides)
    unstepped = _generator_states(optimizer)
    for seed in (40, 41, 42):
        driver.step(optimizer, variables, arrays(SHAPES, seed), ctx.needs)
    # First: what the save call took from the live state is put back, so what follows sees the save.
    changed = driver.state_changed_by_save(optimizer)
    left = driver.state_left_out_of_save(optimizer)
    evaluation = driver.to_evaluation(optimizer, ctx.needs)
    saved = driver.save_state(optimizer, variables, ctx.workdir / "state_roundtrip")
    # A never-stepped optimizer over variables equal to the saved ones, as a resumed job builds it:
    # the saved values loaded after it is built (a constructor that changes the parameters, as
    # Nero's projects them, had read as state the save does not see).
    restored_variables = driver.variables(driver.values(variables))
    restored = driver.optimizer_over(lambda params: ctx.build(params, **overrides), restored_variables)
    driver.load_values(restored_variables, driver.values(variables))
    try:
        driver.restore_state(restored, restored_variables, saved)
    except StateNotRestored as exc:
        return failed(str(exc), where=method_location(ctx), fix=exc.fix)
    fix = LEFT_OUT_FIX if left else driver.advice.state_in_checkpoint
    left_out = f"; {left_out_said(left)}" if left else ""
    where = method_location(ctx)
    if changed_by_save_explains(changed, left):  # the cause, and its line: the override that edits
        fix, left_out = CHANGED_BY_SAVE_FIX, f"; {changed_by_save_said(changed)}"  # the live state
        where = method_location(ctx, "state_dict")
    elif changed:  # said beside what the save leaves out of copies, which keeps its line and fix
        left_out += f"; {changed_by_save_said(changed)}"
    found = driver.state_difference(optimizer, restored)
    if found:
        # A cause the difference shows itself (a load override that drops a key, a cast) keeps its own
        # line and fix; the save's change of the live state is then only said beside it.
        if found.method or found.fix:
            where, fix = method_location(ctx, found.method), found.fix or fix
        return failed(
            f"the restored optimizer's state differs: {found.detail}{left_out}", where=where, fix=fix
        )
    if evaluation is not None:
        driver.to_evaluation(restored, ctx.needs)  # what a user does before evaluating the reloaded model
        diff = max_diff(driver.values(variables), driver.values(restored_variables))
        if diff > 0:
            return failed(
                f"saved after {evaluation} and restored, {evaluation} on the restored optimizer gives other "
                f"variables than the saved ones (by up to {diff:.3g}): a reloaded model is evaluated at "
                "another point, and training continues from another one; the mode or what the switch "
                "reads is kept where the save does not see it",
                where=method_location(ctx, "eval"),
                figure=diff,
                fix=f"{fix}, the current mode included",
            )
    grads = arrays(SHAPES, seed=43)
    for stepped, stepped_variables in ((optimizer, variables), (restored, restored_variables)):
        with same_draws(ctx, seed=9):  # a class that draws by design draws alike in both next steps
            try:
                driver.step(stepped, stepped_variables, grads, ctx.needs)
            except Exception as exc:
                if stepped is optimizer or not missing_key_left_out(f"{type(exc).__name__}: {exc}", left):
                    raise
                # A KeyError, as a rule: the step wants a key the save left out; the save's change of
                # the live state is its cause only where it removed that key.
                if not any(_key_of_error(exc) in change for change in changed):
                    where, fix = ctx.where(exc), LEFT_OUT_FIX
                return failed(
                    f"the next step after reloading raised {ctx.describe_error(exc)}{left_out}",
                    where=where,
                    fix=fix,
                )
    state = driver.state(optimizer)
    diff = max_diff(
        driver.values(variables) + [v for _, v in state],
        driver.values(restored_variables) + [v for _, v in driver.state(restored)],
    )
    keyed_off = driver.state_keyed_off_variables(optimizer)
    if diff > 0 and keyed_off:
        return failed(
            f"the next step after reloading differs from the uninterrupted one: the optimizer keeps state "
            f"under keys that are none of its parameters ({listed(keyed_off, 3)}), and the save names state "
            "by each parameter's place, so the reloaded optimizer, over other parameter objects, finds none "
            "of it and starts afresh",
            where=method_location(ctx),
            figure=float(len(keyed_off)),
            fix="key per-parameter state by the parameter itself, `self.state[p]`, never by `id(p)` or an "
            "index",
        )
    aliasing = state_aliasing(ctx) if diff > 0 and not changed else None
    if aliasing is not None:  # the save writes a copy of its own, the straight run keeps the one tensor
        return failed(
            f"the restored state matched, but the next step after reloading differs from the uninterrupted "
            f"one by up to {diff:.3g}: {aliasing.said()}, and a reload gives it a "
            f"copy of its own{left_out}",
            where=aliasing_location(ctx),
            figure=diff,
            fix=ALIASING_FIX,
        )
    if diff > 0:
        unsaved = _unsaved_attributes(optimizer, restored)
        named = f"; here {'; '.join(unsaved)}" if unsaved else ""
        fix = _unsaved_seed_generator_fix(optimizer, restored) or fix
        return failed(
            f"the restored state matched, but the next step after reloading differs from the uninterrupted "
            f"one by up to {diff:.3g}"
            + (
                f"{left_out}"
                if changed
                else ": with equal saved state, a next step differs only when the optimizer keeps state the "
                "save does not see (a Python attribute, a dict of tensors it does not track)"
                f"{named}{left_out}"
            ),
            where=where,
            figure=diff,
            fix=fix,
        )
    drawn = {name for name, state in _generator_states(optimizer).items() if state != unstepped.get(name)}
    generators = _unsaved_generators(optimizer, restored, only=drawn)
    if generators:
        # The next step matched: what the generator draws did not show on the checks' quadratic loss
        # (a Hutchinson probe's z * Hz is 1 under its identity Hessian), and shows on a real model.
        return warned(
            f"the next step after reloading matched the uninterrupted one, but {'; '.join(generators)}; "
            "the checks' loss does not show what it draws, a model's does (resume_exact)",
            where=method_location(ctx),
            fix=_unsaved_seed_generator_fix(optimizer, restored)
            or "save the generator's state in state_dict() and load it back (get_state() and set_state()), "
            "or draw from torch's global generator, which a job's checkpoint saves",
        )
    evaluated = ""
    if evaluation is not None:
        evaluated = f" (saved after {evaluation}, which gives the same variables after the restore)"
    memory = _memory(driver.optimizer_state_bytes(optimizer), driver.values(variables))
    # Left out but rebuilt alike for one step: whether it matters over a run is resume_exact's to say.
    rebuilt = f"; {left_out_said(left)} (rebuilt alike for the next step)" if left else ""
    seen = [change for change in changed if ": the next step then " in change]
    if seen:  # a value swapped for another kind that the class's own next step cannot take
        return failed(
            f"the round trip is exact, but {changed_by_save_said(seen)}; optlab put it back, a training "
            "loop of a user's own does not",
            where=method_location(ctx, "state_dict"),
            fix=CHANGED_BY_SAVE_FIX,
        )
    if changed:
        rebuilt = f"; {changed_by_save_said(changed)} (rebuilt alike for the next step)"
    return passed(
        f"{driver.state_format} into a fresh optimizer: {len(state)} state tensors ({memory}) identical"
        f"{evaluated} and the next step bitwise equal{overrides_note(overrides)}{rebuilt}",
        0.0,
    )


def _key_of_error(exc: BaseException) -> str:
    """The key a KeyError names, quoted as a change names it (`['momentum']`); else a string no change
    holds."""
    return f"[{exc.args[0]!r}]" if isinstance(exc, KeyError) and exc.args else "\0"


def _memory(state_bytes: int, params: Sequence[Any]) -> str:
    """What the state costs next to the parameters, as a job's `optim/state_to_param_ratio` shows it."""
    param_bytes = sum(a.nbytes for a in params)
    ratio = f", {state_bytes / param_bytes:.2f}x the parameters' {param_bytes}" if param_bytes else ""
    return f"{state_bytes} bytes{ratio}"


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
        try:
            for seed in (70, 71):
                driver.step(optimizer, variables, arrays(SHAPES, seed), ctx.needs)
        except Exception as exc:
            crashed = _crashed_on_misplaced_state(
                ctx, optimizer, variables, exc, driver.advice.state_on_device
            )
            if crashed is None:
                raise
            return crashed
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
        try:
            driver.step(restored, restored_variables, arrays(SHAPES, seed=72), ctx.needs)
        except Exception as exc:
            fix = driver.advice.state_on_device_after_restore
            crashed = _crashed_on_misplaced_state(ctx, restored, restored_variables, exc, fix)
            if crashed is None:
                raise
            return crashed
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


def _crashed_on_misplaced_state(
    ctx: CheckContext, optimizer: Any, variables: Sequence[Any], exc: Exception, fix: str
) -> Outcome | None:
    """A step that raised with state already on another device than its variable: the fault this
    check names (torch refuses to mix a CPU state tensor with a CUDA gradient in one op), said so
    with its fix, not as a bare crash. None where all state sits right: the raise is another fault."""
    misplaced = ctx.driver.misplaced_state(optimizer, variables)
    if not misplaced:
        return None
    return failed(
        f"a step on the accelerator raised {ctx.describe_error(exc)}, with {len(misplaced)} state tensors "
        f"on the wrong device: {'; '.join(misplaced[:4])}",
        where=ctx.where(exc),
        figure=float(len(misplaced)),
        fix=fix,
    )


def _on_accelerator(driver: Driver) -> AbstractContextManager[Any]:
    """A new scope each time: a framework's device scope need not be re-entrant. The scope is what a
    job on the accelerator runs under, and no more: Keras jobs run in `tf.device` (KerasSession.scope),
    so the optimizer is built and stepped in it; torch jobs set no default device (`model.to(device)`),
    so torch's scope puts only the variables there, and state made without `device=`/`zeros_like`
    lands on the CPU, as in a job."""
    scope = driver.accelerator()
    assert scope is not None, "checked before"
    return scope


# -- state_untrainable -------------------------------------------------------------------------------


@isolated
def check_state_untrainable(ctx: CheckContext) -> Outcome:
    driver = ctx.driver
    overrides = ctx.stateful_overrides()
    optimizer, variables = fresh(ctx, **overrides)
    # Looked at after each step: state may alias a parameter only every k steps (Lookahead's
    # `p.data = slow`); in a style whose state cannot alias one (Keras: slots are variables of their
    # own), after two, as trainability is fixed when the state is made.
    can_alias = type(driver).state_sharing_variables is not Driver.state_sharing_variables
    for seed in range(90, 90 + (WARMUP_STEPS if can_alias else 2)):
        driver.step(optimizer, variables, arrays(SHAPES, seed), ctx.needs)
        count, offending, as_builtins_do = driver.trainable_state(optimizer, variables)
        if offending:
            break
    shared = driver.state_sharing_variables(optimizer, variables)
    if offending and len(shared) == len(offending):  # nothing trainable: only state aliasing a parameter
        aliasing = state_aliasing(ctx)
        if aliasing is not None:
            return failed(
                aliasing.said(),
                where=aliasing_location(ctx),
                figure=float(len(aliasing.names)),
                fix=ALIASING_FIX,
            )
        return passed(
            f"{'; '.join(offending[:4])}: harmless here, as with each a copy of its own the next "
            f"{WARMUP_STEPS} steps are bitwise the same (the state is rewritten before it is read, as SAM's "
            f"saved weights are after `p.data = old_p`); none of {count} optimizer state tensors is "
            f"trainable{overrides_note(overrides)}",
            0.0,
        )
    if offending:
        return failed(
            f"{len(offending)} of {count} optimizer state tensors are trainable or are the trained "
            f"variables: {'; '.join(offending[:4])}; a tape or autograd watches them and a model or "
            "strategy may treat them as weights",
            where=method_location(ctx),
            figure=float(len(offending)),
            fix=driver.advice.untrainable_state,
        )
    shared_by_two = _state_shared_by_equal_shapes(ctx, overrides)
    if shared_by_two is not None:
        return shared_by_two
    if as_builtins_do:
        return warned(
            f"{len(as_builtins_do)} of {count} optimizer state tensors are trainable scalars: "
            f"{'; '.join(as_builtins_do[:4])} (the framework's own Nadam keeps one so too; a strategy may "
            "treat it as a weight)",
            where=method_location(ctx),
            figure=float(len(as_builtins_do)),
            fix=driver.advice.untrainable_state,
        )
    if not count:
        return passed(f"the optimizer keeps no state tensors{overrides_note(overrides)}", 0.0)
    return passed(
        f"none of {count} optimizer state tensors is trainable or one of the trained variables"
        f"{overrides_note(overrides)}",
        0.0,
    )


# Two parameters of one shape: a class that keeps state per shape (one buffer "to save memory") hands
# them one tensor, which the checks' other variables, all of other shapes, cannot show.
EQUAL_SHAPES = ((4, 3), (4, 3))
# A third parameter, of another shape, stepped with them: a tensor it holds too is the group's (statistics
# of the whole group every parameter holds, shared by design), not a buffer kept per shape.
OTHER_SHAPE = (2, 5)  # two-dimensional as they are: a class for matrices steps it too
# How far apart two parameters stepped together may end from each stepped by an optimizer of its own
# before their shared state counts as acting: rounding of one order of summation against another.
SHARED_STATE_APART = 1e-6


def _state_shared_by_equal_shapes(ctx: CheckContext, overrides: Mapping[str, Any]) -> Outcome | None:
    """The fail where two parameters of one shape, given different gradients, hold one state tensor (of
    more than one element, of their shape) AND step otherwise than each does with an optimizer of its
    own: a buffer shared by shape mixes their updates. Scratch space shared on purpose steps alike, and
    a coupling by design (a global norm) shares no tensor of their shape, or one a third parameter of
    another shape holds too: all stay silent. None where nothing is shared."""
    driver = ctx.driver
    shapes = (*EQUAL_SHAPES, OTHER_SHAPE)
    grads = [arrays(shapes, seed=70 + step) for step in range(3)]
    start = arrays(shapes, seed=0, mean=1.0)
    try:
        with same_draws(ctx, seed=7):
            optimizer, variables = _over(ctx, start, overrides)
            for grad in grads:
                driver.step(optimizer, variables, grad, ctx.needs)
            shared = driver.state_shared_between(optimizer, variables)
        # Separately built optimizers cannot draw alike: a class that draws is not compared.
        if not shared or draws_randomly(ctx):
            return None
        together, alone = driver.values(variables[:2]), []
        for index in range(2):
            with same_draws(ctx, seed=7):
                single, single_variables = _over(ctx, [start[index]], overrides)
                for grad in grads:
                    driver.step(single, single_variables, [grad[index]], ctx.needs)
                alone += driver.values(single_variables)
    except Exception:  # steps the checks' other variables take are judged there
        return None
    apart = max_diff(together, alone)
    if apart <= SHARED_STATE_APART:
        return None
    key = shared[0]
    return failed(
        f"two parameters of one shape {shape_text(EQUAL_SHAPES[0])}, given different gradients, hold one "
        f"state tensor under {listed([repr(k) for k in shared], 3)}, and step otherwise than each does "
        f"with an optimizer of its own (by up to {apart:.3g} after 3 steps): each one's update moves the "
        "other's state (a buffer kept per shape, not per parameter)",
        where=_line_setting_state(ctx, key),
        figure=apart,
        fix=f"give each parameter a state tensor of its own: `self.state[p][{key!r}] = torch.zeros_like(p)`, "
        "never one looked up by shape or shared between parameters",
    )


def _over(
    ctx: CheckContext, values: Sequence[np.ndarray], overrides: Mapping[str, Any]
) -> tuple[Any, list[Any]]:
    """An optimizer with the user's params over new variables holding `values`."""
    variables = ctx.driver.variables(values)
    return ctx.driver.optimizer_over(lambda params: ctx.build(params, **overrides), variables), variables


def _line_setting_state(ctx: CheckContext, key: str) -> str:
    """`file:line` of the first line of the class's methods that sets state `key`; the update
    method's where none is found."""
    setting = re.compile(rf"""\[\s*['"]{re.escape(key)}['"]\s*\]\s*=[^=]""")
    for found in user_method_lines(ctx):
        if setting.search(found.line):  # the line as written: `code` blanks the key's string
            return found.where
    return method_location(ctx)


CHECKS: Mapping[str, CheckFunction] = {
    "config_roundtrip": check_config_roundtrip,
    "state_roundtrip": check_state_roundtrip,
    "device_placement": check_device_placement,
    "state_untrainable": check_state_untrainable,
}
