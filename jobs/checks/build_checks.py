"""construct, dense_step, descends, none_grads: written once over the drivers.

What passes, warns and fails, and the fix, read here; a fix sentence that must name the
framework's API comes from the driver's `advice`.
"""

from __future__ import annotations

import inspect
import linecache
import math
import re
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.foreign_methods import never_ran, suspects
from jobs.checks.rate_checks import dense_refusal
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.tools import (
    MOVES_NOTHING,
    SHAPES,
    WARMUP_STEPS,
    ZERO_GRAD_FIX,
    CheckFunction,
    arrays,
    fix_for_raised,
    fresh,
    isolated,
    line_computing_with,
    listed,
    max_diff,
    method_location,
    native,
    non_finite_update,
    own_code,
    raised_in,
    refuses_dense,
    same_draws,
    shape_text,
    still_steps,
    update_made_non_finite,
    updates_nothing,
    user_line,
    wrong_signature,
    zero_grad_keeps,
    zero_grad_said,
)
from jobs.frameworks.base import Gradient, source_files
from jobs.frameworks.foreign import counting_calls
from optimizers.hyperparams import Param

FROZEN_SHAPE = (7, 2)
LATER_FROZEN_SHAPE = (2, 6)
DESCENT_CHECKPOINTS = (20, 60, 200)  # steps after which the loss may first be below its start
# Words an error may use for an argument instead of its own name.
_ARGUMENT_WORDS: dict[str, tuple[str, ...]] = {
    "lr": ("learning rate", "learning_rate", "step size"),
    "learning_rate": ("learning rate", "lr"),
    "eps": ("epsilon",),
    "epsilon": ("eps",),
    "betas": ("beta",),
}


# -- construct ---------------------------------------------------------------------------------------


@isolated
def check_construct(ctx: CheckContext) -> Outcome:
    entry = ctx.target.entry
    if ctx.needs.model_argument is not None:
        ctx.mark_unbuildable()
        return skipped(
            f"inconclusive: the class is built over the model (its {ctx.needs.model_argument!r} argument), "
            "which a training job hands it; the checks build optimizers over plain parameters, so it was "
            "not checked"
        )
    # Arguments the user gave other values than their defaults: a class may refuse its own default
    # (CAME: `lr=None`, then `assert lr > 0.`; bitsandbytes' SGD8bit: `momentum=0`, then "SGD without
    # momentum is not supported!"), which makes them required in effect.
    supplied = {
        n: ctx.params[n]
        for n, p in entry.params.items()
        if not p.required and ctx.params.get(n) is not None and not p.is_default(ctx.params[n])
    }
    # A required argument has no default to build with: the user's value stands in for one.
    required = {n: ctx.params[n] for n, p in entry.params.items() if p.required and n in ctx.params}
    defaults_refused = ""
    for label, params, defaults in (
        (
            "the default hyperparameters" + (f" and the given {', '.join(required)}" if required else ""),
            required,
            True,
        ),
        (f"the given hyperparameters {ctx.params}", ctx.params, False),
    ):
        exc = _build_error(ctx, params)
        if exc is not None:
            if defaults and supplied and _build_error(ctx, {**required, **supplied}) is None:
                # The defaults fail only for want of the values given for those arguments.
                defaults_refused = (
                    f" (its defaults alone raise {ctx.describe_error(exc)}: {', '.join(supplied)} "
                    "must be given)"
                )
                continue
            ctx.mark_unbuildable()
            need = ctx.driver.unmet_need(exc) or _more_than_one_worker(ctx, exc)
            if need is not None:
                return skipped(f"inconclusive: the class builds only with {need}: {ctx.describe_error(exc)}")
            base_call = _base_call_refused(ctx, exc) if defaults else None
            if base_call is not None:
                return _base_call_failure(
                    f"building with {label} raised {ctx.describe_error(exc)}", base_call
                )
            refused = None if defaults else _given_value_refused(ctx, exc, supplied)
            if refused is not None:
                return skipped(
                    f"inconclusive: the class builds with its defaults and refuses the given {refused} "
                    f"by name: {ctx.describe_error(exc)}; these values do not fit it (they are not a fault "
                    "of the class): check it with values it takes"
                )
            if _builds_over_named_parameters(ctx, params):
                return skipped(
                    f"inconclusive: building over a list of parameters with {label} raised "
                    f"{ctx.describe_error(exc)}, and over (name, parameter) pairs, as "
                    "model.named_parameters() gives them, it builds: the class takes named parameters only, "
                    "and the checks build over plain ones, so it was not checked"
                )
            if _builds_over_a_matrix_alone(ctx, params):
                matrix = shape_text(SHAPES[0])
                return skipped(
                    f"inconclusive: building over the checks' variables (a {matrix} matrix and two vectors) "
                    f"with {label} raised {ctx.describe_error(exc)}, and over the matrix alone it builds: "
                    "the class refuses parameters of some shapes (as Muon takes only matrices), so optlab's "
                    "problems cannot judge it"
                )
            if not _refuses_its_own_values(ctx, exc):
                return skipped(
                    f"inconclusive: building over a list of parameters with {label} raised "
                    f"{ctx.describe_error(exc)}; the class needs what the checks cannot guess (a "
                    "param-group recipe: --param-groups; a model instead of parameters; a base optimizer; a "
                    "package that is not installed), so it was not checked"
                )
            return failed(
                f"building with {label} raised {ctx.describe_error(exc)}",
                where=user_line(ctx, exc),
                fix="the constructor must accept every declared hyperparameter at its default and in range",
            )
    probed: list[str] = []
    problems: list[_Unvalidated] = []
    for param in entry.params.values():
        values = _invalid_values(ctx, param, none_refused=bool(defaults_refused) and param.name in supplied)
        if values:
            probed.append(param.name)
        for value in values:
            problem, at = _probe_invalid(ctx, param, value)
            if problem:
                problems.append(_Unvalidated(problem, at, declared=_declares_range(ctx, param)))
    if problems:
        return _unvalidated_outcome(problems, defaults_refused)
    builds = (
        "builds with the given params" + defaults_refused
        if defaults_refused
        else "builds with the defaults and the given params"
    )
    if not probed:
        return passed(f"{builds}; it declares no ranges to probe", 0.0)
    return passed(
        f"{builds}; values just outside the ranges of {len(probed)} "
        f"arguments ({', '.join(probed)}) were rejected with errors naming the argument or the value "
        "(figure: arguments probed)",
        float(len(probed)),
    )


@dataclass(frozen=True)
class _Unvalidated:
    """A value outside a range that the constructor accepted, or refused in words naming nothing."""

    problem: str
    where: str
    declared: bool  # a range the class declares itself (optlab_hyperparameters), not torch's lr > 0


_VALIDATE_FIX = (
    "validate each argument in __init__ and raise ValueError naming it, the value and what is allowed "
    "(e.g. 'lr must be a number > 0; received -1')"
)


def _unvalidated_outcome(problems: Sequence[_Unvalidated], defaults_refused: str) -> Outcome:
    """A fail where a range the class declares is not enforced: it publishes that range, and a job is
    built on its word. Only a warning where the one probed rule is torch's lr > 0, which the class
    never stated: an unchecked rate is missing input validation, not a malfunction (KellerJordan's Muon
    and LiyuanLucasLiu's RAdam accept lr < 0, and train correctly with any rate a user means)."""
    observed = "; ".join(p.problem for p in problems) + defaults_refused
    where = next((p.where for p in problems if p.where), "")
    if any(p.declared for p in problems):
        return failed(observed, where=where, figure=float(len(problems)), fix=_VALIDATE_FIX)
    return warned(
        f"{observed}: input validation to add (torch's own optimizers refuse a negative rate in words "
        "naming it), not a fault of the update",
        where=where,
        figure=float(len(problems)),
        fix=_VALIDATE_FIX,
    )


def _declares_range(ctx: CheckContext, param: Param) -> bool:
    """Whether the class declares `param`'s range itself (`optlab_hyperparameters`)."""
    return native(ctx, param.name) in (getattr(ctx.target.cls, "optlab_hyperparameters", {}) or {})


def _given_value_refused(ctx: CheckContext, error: Exception, supplied: dict[str, Any]) -> str | None:
    """`name=value` of a given argument that the class's validation refused by name, where the class
    declares no range for it (pytorch-optimizer's FlashAdamW: `master_weight_bits` "has no effect
    when all parameters are fp32"): the values asked for, not the class, are wrong. A value inside
    a range the class declares (`optlab_hyperparameters`), refused all the same, stays a fault."""
    if not isinstance(error, ValueError | TypeError | AssertionError):
        return None
    declared = getattr(ctx.target.cls, "optlab_hyperparameters", {}) or {}
    for name, value in supplied.items():
        argument = native(ctx, name)
        if argument not in declared and names_argument(str(error), argument):
            return f"{argument}={value!r}"
    return None


def _refuses_its_own_values(ctx: CheckContext, error: Exception) -> bool:
    """The class's own code raised (its validation refuses the values it declares or was given, or
    its __init__ breaks): a fault. An error raised elsewhere (torch refusing group dicts it
    expected), an AttributeError on the argument (a model was expected) or an ImportError (a
    package is missing) says what it needs instead."""
    return raised_in(error, ctx.user_files()) and not isinstance(error, AttributeError | ImportError)


# A call that does not fit the signature it calls: `f() missing 1 required positional argument`.
_SIGNATURE_MISMATCH = re.compile(
    r"\(\) (missing \d+ required|got an unexpected keyword argument|takes \d+ positional|got multiple values)"
)


def _base_call_refused(ctx: CheckContext, error: Exception) -> str | None:
    """`file:line` of the class's own call to a base class's constructor, where building with the
    class's defaults failed in that call: a call that does not fit the constructor's signature, or,
    where the base constructor gets only what the class passes it (Keras), any ValueError or
    TypeError the bases' constructors raise. lion-tf (the tf.keras 2.11 optimizer) and adabelief-tf
    (OptimizerV2) under Keras 3 are such classes. Else None: an error in the class's own lines, or
    one about what the checks passed (torch's base takes the checks' parameters), is judged as before."""
    if not isinstance(error, TypeError | ValueError):
        return None
    source = ctx.target.source_file()
    frames = traceback.extract_tb(error.__traceback__)
    own = [index for index, frame in enumerate(frames) if frame.filename == source]
    if not own or "__init__(" not in (frames[own[-1]].line or ""):
        return None
    call, below = frames[own[-1]], frames[own[-1] + 1 :]
    bases = source_files(ctx.target.cls) - {source}
    if not all(frame.filename in bases and frame.name == "__init__" for frame in below):
        return None
    fits = _SIGNATURE_MISMATCH.search(str(error)) is None
    if fits and not (below and ctx.driver.capabilities.built_apart_from_variables):
        return None
    return f"{call.filename}:{call.lineno}"


def _base_call_failure(what: str, where: str) -> Outcome:
    return failed(
        f"{what} in the constructor of a base class, called by the class's own __init__: the installed "
        "framework's optimizer does not take what the class passes it (written for another version of its "
        "optimizer API?)",
        where=where,
        fix="call the base class's constructor with the arguments the installed framework's optimizer takes "
        "(the error names the one it refuses); a class written for an older API (tf.keras's OptimizerV2, "
        "the tf.keras 2.11 optimizer) must be ported to it",
    )


def _builds_over_a_matrix_alone(ctx: CheckContext, params: Mapping[str, Any]) -> bool:
    """Whether the class, which refused the checks' variables, builds over their matrix alone: it
    refuses parameters by shape (GefenMuon, as torch's Muon: "only supports 2D parameters")."""
    return _build_error(ctx, params, shapes=SHAPES[:1]) is None


def _builds_over_named_parameters(ctx: CheckContext, params: Mapping[str, Any]) -> bool:
    """Whether the class, which refused the checks' variables, builds over them named (torch's
    optimizers take `model.named_parameters()` as well as parameters; a class may take only names)."""
    if ctx.target.entry.style != "torch":
        return False
    return _build_error(ctx, params, named=True) is None


def _build_error(
    ctx: CheckContext,
    params: Mapping[str, Any],
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    *,
    named: bool = False,
) -> Exception | None:
    """What building with exactly `params` over plain parameters (or over them named as
    `model.named_parameters()` names them) raised, or None when it built."""
    variables = ctx.driver.variables(arrays(shapes, seed=0))
    try:
        ctx.create(
            params, model_params=[(f"param{i}", v) for i, v in enumerate(variables)] if named else variables
        )
    except Exception as exc:
        return exc
    return None


# "does not support a single worker" (fairscale's AdaScale, without gradient accumulation), "requires
# more than one process": a refusal of the one process the checks run a class in.
_ONE_WORKER = re.compile(r"\b(?:single|one|1)[ -](?:worker|process|rank|replica|node|gpu)s?\b", re.IGNORECASE)
_REFUSES = re.compile(
    r"\b(?:not support|unsupported|cannot|can't|requires?|needs?|at least)\b", re.IGNORECASE
)


def _more_than_one_worker(ctx: CheckContext, error: BaseException) -> str | None:
    """A refusal the class raises itself because it was built for one worker: it is written for
    data-parallel training, which the checks of a single process cannot judge."""
    message = str(error)
    refused = raised_in(error, own_code(ctx), by="raise")
    if refused and _ONE_WORKER.search(message) and _REFUSES.search(message):
        return (
            "more than one worker (it is written for data-parallel training, and the checks run it in "
            "one process)"
        )
    return None


def _native_kwargs(ctx: CheckContext, params: Mapping[str, Any]) -> dict[str, Any]:
    declared = ctx.target.entry.params
    return {native(ctx, k): declared[k].native(v) if k in declared else v for k, v in params.items()}


def _invalid_values(ctx: CheckContext, param: Param, *, none_refused: bool = False) -> list[Any]:
    """Values just outside `param`'s range: the ranges the class declares (the exclusive bound
    itself too), and the learning rate's `> 0` only where the framework's own optimizers refuse
    a negative rate (torch; Keras accepts one by design), unless the class builds with `lr=None`
    (`none_refused`: it does not)."""
    if param.type not in ("float", "number", "int", "float_pair"):
        return []
    declared = _declares_range(ctx, param)
    if not declared and not (param.name == "lr" and ctx.driver.capabilities.refuses_negative_lr):
        return []
    if not declared and param.default is None and not param.required and not none_refused:
        # `lr=None` that the class accepts: one that computes its own step may take an lr only to fit
        # the common signature and never read it (torch_optimizer's A2Grad says so): no fault.
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
    name = native(ctx, param.name)
    try:
        ctx.driver.construct(ctx.target.cls, _native_kwargs(ctx, {**ctx.params, param.name: value}))
    except Exception as exc:
        if names_argument(str(exc), name) or _quotes_value(str(exc), value):
            return "", ""
        return (
            f"{name}={value!r} was rejected with {ctx.describe_error(exc)}, which names neither {name} nor "
            "the value",
            user_line(ctx, exc),
        )
    return (
        f"{name}={value!r} was accepted although {name} must be {param.allowed()}",
        method_location(ctx, "__init__"),
    )


def _quotes_value(message: str, value: Any) -> bool:
    """The error quotes the rejected number itself, in any notation (`-0.001`, `-1.0e-03`): whoever
    passed it sees which argument was refused, in whatever words (Atiny's `Invalid 学习速率: -0.001`,
    Chinese for the learning rate). 0 and 1 are too common in messages to tell."""
    if isinstance(value, tuple):  # a pair probed on its first element
        value = value[0]
    if not isinstance(value, int | float) or isinstance(value, bool) or value in (0, 1):
        return False
    return any(math.isclose(float(number), value, rel_tol=1e-9) for number in _NUMBER.findall(message))


# A number as messages write it, sign and exponent included, not inside a word (`beta2`, `x86`).
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?!\w|\.\d)")


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
    """Every variable with a gradient moves, and values and state stay finite. A first step that only
    builds state (a warm-up) is allowed: movement is required by step WARMUP_STEPS. A method of
    another optimizer API the class defines and the steps never call is told (foreign_methods.py)."""
    uncalled = suspects(ctx)
    if not uncalled:
        return _dense_step(ctx)
    with counting_calls(ctx.target.cls, [f.name for f in uncalled]) as calls:
        outcome = _dense_step(ctx)
    return never_ran(ctx, [f for f in uncalled if not calls[f.name]], outcome)


def _dense_step(ctx: CheckContext) -> Outcome:
    driver = ctx.driver
    try:
        optimizer, variables = fresh(ctx)
    except Exception as exc:  # Keras's `build`, as its first apply runs it: one fail, not one a check
        ctx.mark_step_raises()
        return _first_step_raised(ctx, exc)
    before = driver.values(variables)
    built = _non_finite_as_built(driver, optimizer)
    first_seen: dict[str, FirstSeen] = {}
    unchanged: list[int] = []
    bad: list[str] = []
    waiting: list[str] = []
    moved_by: int | None = None
    for step in range(WARMUP_STEPS):
        try:
            driver.step(optimizer, variables, arrays(SHAPES, seed=1 + step), ctx.needs)
        except Exception as exc:
            if step:
                raise
            ctx.mark_step_raises()
            return _first_step_raised(ctx, exc)
        after = driver.values(variables)
        unchanged = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if np.array_equal(a, b)]
        moved_by = moved_by or (None if unchanged else step + 1)
        bad = _non_finite_variables(after)
        made, waiting = _state_made_non_finite_by_steps(driver, optimizer, built, first_seen, step)
        bad += made
        # Non-finite state a step has just set is watched for SENTINEL_STEPS more steps first.
        if bad or (not unchanged and not waiting):
            break
    bad += waiting  # set too late to be watched: judged as made by the steps, as before
    steps = step + 1
    after_steps = "one step" if steps == 1 else f"{steps} steps"
    ctx.notes["moves_nothing"] = len(unchanged) == len(variables)
    ctx.notes["non_finite_update"] = bool(bad)
    if bad:
        return failed(
            f"after {after_steps} these are not finite: {', '.join(bad[:6])}",
            where=method_location(ctx),
            figure=float(len(bad)),
            fix=driver.advice.finite_state,
        )
    if len(unchanged) == len(variables) and _moves_small_variables(ctx):
        return skipped(
            f"inconclusive: {after_steps} changed none of the variables (magnitude about 1), but the same "
            "steps move variables of magnitude 1e-4: its steps are too small to change the larger ones in "
            "their precision (a class that starts from a tiny step and grows it, as Mechanic does from "
            "s_init=1e-8, or one that updates only small weights by design, as SaRA's magnitude threshold "
            "does), so optlab's problems cannot judge it"
        )
    if unchanged:
        shapes = ", ".join(shape_text(SHAPES[i]) for i in unchanged)
        return failed(
            f"{len(unchanged)} of {len(variables)} variables with a nonzero gradient did not change after "
            f"{after_steps}: left unchanged (shapes {shapes})",
            where=method_location(ctx),
            figure=float(len(unchanged)),
            fix=driver.advice.in_place_update,
        )
    steps = moved_by or steps
    after_steps = "one step" if steps == 1 else f"{steps} steps"
    smallest = min(float(np.max(np.abs(a - b))) for a, b in zip(before, after, strict=True))
    zero = _not_finite_after_a_zero_gradient(ctx)
    if zero:
        return failed(
            "a gradient of zeros for one variable (an unused parameter under zero_grad(set_to_none=False), "
            f"a masked layer) made these not finite within {ZERO_GRADIENT_STEPS} steps: "
            + ", ".join(zero[:6]),
            where=method_location(ctx),
            figure=float(len(zero)),
            fix="guard what divides by a gradient or by state built from it (its norm, its second moment): "
            "add an epsilon, or leave a variable whose gradient norm is 0 as it is",
        )
    warmup = f" (the first {steps - 1} step(s) only built state: a warm-up)" if steps > 1 else ""
    sentinels = [name for name, seen in first_seen.items() if seen.left_alone]
    sentinel = (
        f" but for {listed(sentinels, 3)}, "
        "non-finite as a step set it and no step since wrote it: a sentinel (a 'lowest loss seen' kept at "
        "+inf until a loss comes), not a step gone wrong"
        if sentinels
        else ""
    )
    # Read after the steps above, whose last gradients the variables still hold.
    aliases = driver.state_sharing_gradients(optimizer, variables)
    if aliases:
        return warned(
            f"{', '.join(aliases[:6])}: the parameter's gradient itself (its memory), not a copy: "
            "step() changes the caller's gradient as it updates that state, and "
            "zero_grad(set_to_none=False) or gradient accumulation changes the state (it is right only "
            "while gradients are set to None between steps, zero_grad's default)",
            where=method_location(ctx),
            fix="store a copy: `state[key] = p.grad.clone()` (or `torch.clone(grad).detach()`, as torch's "
            "SGD does for its first momentum buffer)",
        )
    if _zero_variable_stuck(ctx):
        return warned(
            f"a variable of zeros ({shape_text(SHAPES[ZERO_VARIABLE])}, as a bias or a LayerNorm shift "
            f"starts) did not move in {WARMUP_STEPS} steps with a nonzero gradient, while the others did: "
            "an update scaled by the weight's norm (LAMB's or LARS's trust ratio ||w|| / ||u||) never "
            "trains a zero-initialised weight; a multiplicative update (Madam) keeps zeros by design",
            where=method_location(ctx),
            fix="where the weight's norm is 0, take a trust ratio of 1 (as LAMB's reference code and "
            "torch-optimizer's do), or say in the class's documentation that zero weights stay zero",
        )
    second_look = _decay_grows_weights(ctx) or _state_keeps_growing(ctx)
    if second_look is not None:
        return second_look
    return passed(
        f"{after_steps} changed all {len(variables)} variables{warmup}; values and state finite{sentinel}; "
        "a gradient of zeros too (figure: smallest largest change)",
        smallest,
    )


# -- dense_step's second looks: which way weight decay acts, state that grows with the steps -------

# The argument names a weight decay goes by (catalogue names).
DECAY_ARGUMENTS = ("weight_decay", "wd")
# Decay values tried, the first the class accepts: large enough that AdamW's lr * wd shrink shows
# in float32 within DECAY_STEPS steps even at a learning rate of 1e-4.
DECAY_VALUES = (0.5, 0.1)
# Odd: a right decay so large that it overshoots (1 - lr * wd below -1) flips the weights' sign an
# odd number of times, which `_grew_from_decay` tells from growth.
DECAY_STEPS = 5
# Relative growth of a variable's norm beyond rounding (float32's epsilon is 1.2e-7; a norm-preserving
# update rounds back to its norm within a few of those).
DECAY_GROWTH = 1e-5


def _decay_grows_weights(ctx: CheckContext) -> Outcome | None:
    """A warn where weight decay inflates the weights (`p.mul_(1 + lr * wd)`): from the same start,
    DECAY_STEPS steps of zero gradients with decay end with every variable's norm larger than the
    same steps without it, pointing the same way (a shrink so large it overshoots flips the sign and
    is no growth of this kind). Nothing to say where the steps raise or end non-finite, or where
    decay leaves zero-gradient steps alone (decay toward the initial weights, cautious decay), or
    keeps the norm (Nero). Torch only: Keras's base class applies `weight_decay` itself."""
    if ctx.target.style != "torch":
        return None
    found = _decay_argument(ctx)
    if found is None:
        return None
    name, value = found
    try:
        decayed = _after_zero_gradients(ctx, {name: value})
        plain = _after_zero_gradients(ctx, {name: 0.0})
    except Exception:  # a class that refuses zero gradients or these values says so elsewhere
        return None
    if not all(np.all(np.isfinite(a)) for a in decayed + plain):
        return None
    grown = [_grew_from_decay(d, p) for d, p in zip(decayed, plain, strict=True)]
    if not all(ratio is not None for ratio in grown):
        return None
    smallest = min(ratio for ratio in grown if ratio is not None)
    where, code = line_computing_with(ctx, name, _DECAYS)
    quoted = f" (`{code}`)" if code else ""
    return warned(
        f"weight decay makes the weights larger: {DECAY_STEPS} steps of zero gradients with "
        f"{native(ctx, name)}={value} end with every variable's norm larger than the same steps with "
        f"{native(ctx, name)}=0 (by a factor of at least {smallest:.6g}){quoted}: the decay has the "
        "wrong sign",
        where=where or method_location(ctx),
        figure=smallest,
        fix="decay must shrink the weights: `p.mul_(1 - lr * weight_decay)` (decoupled, as AdamW) or "
        "`grad = grad.add(p, alpha=weight_decay)` (L2, as Adam)",
    )


def _decay_argument(ctx: CheckContext) -> tuple[str, float] | None:
    """(the class's weight-decay argument, a positive value to try) where it takes one as a number
    and accepts both that value and 0; else None."""
    for name in DECAY_ARGUMENTS:
        param = ctx.target.entry.params.get(name)
        if param is None or param.type not in ("float", "number"):
            continue
        for value in DECAY_VALUES:
            try:
                param.check(0.0)
                param.check(value)
            except ValueError:
                continue
            return name, value
    return None


def _after_zero_gradients(ctx: CheckContext, overrides: Mapping[str, Any]) -> list[np.ndarray]:
    """The variables after DECAY_STEPS steps of zero gradients from a fresh optimizer built with
    `overrides`, every random draw as in any other such run."""
    with same_draws(ctx):
        optimizer, variables = fresh(ctx, **overrides)
        for _ in range(DECAY_STEPS):
            ctx.driver.step(optimizer, variables, [np.zeros(s, dtype=np.float32) for s in SHAPES], ctx.needs)
    return ctx.driver.values(variables)


def _grew_from_decay(decayed: np.ndarray, plain: np.ndarray) -> float | None:
    """How many times larger `decayed`'s norm is than `plain`'s, where it is larger beyond rounding
    and points the same way; else None."""
    a, b = decayed.astype(np.float64).ravel(), plain.astype(np.float64).ravel()
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if norm_b == 0 or norm_a <= norm_b * (1 + DECAY_GROWTH) or float(a @ b) <= 0:
        return None
    return norm_a / norm_b


# Windows of steps (after, after) over which the optimizer's state bytes are compared, one after
# another while they grow: most classes hold all their state by the first, and hold no more after;
# a bounded history (torch's LBFGS keeps history_size=100 pairs, AdaShift a queue of keep_num
# gradients) stops growing in a later one; the last is well past any usual bound.
GROWTH_WINDOWS = ((8, 16), (64, 72), (128, 136), (240, 256))


def _state_keeps_growing(ctx: CheckContext) -> Outcome | None:
    """A warn where the optimizer's state bytes grow in every one of GROWTH_WINDOWS: a history kept
    forever (a list appended every step), whose memory and step time grow with the job until it
    runs out of memory. Cheap for most classes: the steps stop at the first window without growth.
    Torch only: Keras builds an optimizer's variables once, in `build()`, and a step cannot add any."""
    if ctx.target.style != "torch":
        return None
    driver = ctx.driver
    try:
        optimizer, variables = fresh(ctx)
        step = 0
        for first, last in GROWTH_WINDOWS:
            sizes: dict[int, tuple[int, dict[str, int]]] = {}
            while step < last:
                step += 1
                driver.step(optimizer, variables, arrays(SHAPES, seed=300 + step % 7), ctx.needs)
                if step in (first, last):
                    names = {name: value.size for name, value in driver.state(optimizer)}
                    sizes[step] = (driver.optimizer_state_bytes(optimizer), names)
            if sizes[last][0] <= sizes[first][0]:
                return None
    except Exception:  # a class that cannot take so many steps says so in its own checks
        return None
    (before, before_names), (after, after_names) = sizes[first], sizes[last]
    growing = _growing_containers(before_names, after_names)
    return warned(
        f"the optimizer's state keeps growing: {before} bytes after {first} steps, {after} after {last} "
        f"({listed(growing, 4) or 'its tensors'} grow): memory and step time grow with the job until it "
        "runs out of memory",
        where=method_location(ctx),
        figure=float(after - before),
        fix="bound what is kept: `collections.deque(maxlen=...)` for a history, or keep a running "
        "statistic (a sum or an exponential average) instead of every past value",
    )


def _growing_containers(before: Mapping[str, int], after: Mapping[str, int]) -> list[str]:
    """The state entries that are new or larger in `after`, an entry of a list named by the list
    (`state[param 0]['history']`, not each `[n]` of it)."""
    grown = [name for name, size in after.items() if size > before.get(name, -1)]
    return list(dict.fromkeys(re.sub(r"(\[\d+\])+$", "", name) for name in grown))


# What a line that applies a decay does: a multiplication or an in-place update.
_DECAYS = re.compile(r"\*|\.(mul|add|sub|addcmul|lerp)_?\(")


# Steps with one variable's gradient all zeros, after one ordinary step: an unused parameter keeps a
# zero gradient under zero_grad(set_to_none=False), step after step.
ZERO_GRADIENT_STEPS = 2
# The variable started at zeros, as biases and LayerNorm shifts are: the vector of SHAPES.
ZERO_VARIABLE = 1


def _zero_variable_stuck(ctx: CheckContext) -> bool:
    """Whether a variable that starts at zeros stays there through WARMUP_STEPS steps with nonzero
    gradients while the others move (an update scaled by the weight's own norm)."""
    driver = ctx.driver
    values = arrays(SHAPES, seed=0, mean=1.0)
    values[ZERO_VARIABLE] = np.zeros_like(values[ZERO_VARIABLE])
    variables = driver.variables(values)
    try:
        optimizer = driver.optimizer_over(lambda params: ctx.build(params), variables)
        for step in range(WARMUP_STEPS):
            driver.step(optimizer, variables, arrays(SHAPES, seed=60 + step), ctx.needs)
    except Exception:  # a class that refuses zeros or this start says so in its own checks
        return False
    after = driver.values(variables)
    others_moved = all(
        not np.array_equal(a, b)
        for i, (a, b) in enumerate(zip(values, after, strict=True))
        if i != ZERO_VARIABLE
    )
    return others_moved and not np.any(after[ZERO_VARIABLE])


def _not_finite_after_a_zero_gradient(ctx: CheckContext) -> list[str]:
    """What is not finite (variables, state) once the first variable's gradient has been zeros for
    ZERO_GRADIENT_STEPS steps; empty where all is, or where such a step raises (the steps before
    have judged the class's errors)."""
    driver = ctx.driver
    optimizer, variables = fresh(ctx)
    built = _non_finite_as_built(driver, optimizer)
    try:
        driver.step(optimizer, variables, arrays(SHAPES, seed=1), ctx.needs)
        # What the ordinary first step left non-finite, dense_step's own steps have judged: a sentinel
        # there stays one here while no zero-gradient step writes it.
        non_finite_now = {name for name, value in driver.state(optimizer) if not _finite(value)}
        set_by_first = {
            name: writes for name, writes in driver.state_writes(optimizer).items() if name in non_finite_now
        }
        for seed in range(2, 2 + ZERO_GRADIENT_STEPS):
            grads = arrays(SHAPES, seed=seed)
            grads[0] = np.zeros_like(grads[0])
            driver.step(optimizer, variables, grads, ctx.needs)
    except Exception:
        return []
    bad = _non_finite_variables(driver.values(variables))
    writes = driver.state_writes(optimizer)
    return bad + [
        name
        for name in _state_made_non_finite(driver, optimizer, built)
        if not (name in set_by_first and _same_writes(set_by_first[name], writes.get(name)))
    ]


def _first_step_raised(ctx: CheckContext, error: Exception) -> Outcome:
    """A refusal the class raises itself with a clear error (`ValueError: only supports 2D
    parameters`) is a limit of what it takes, so the checks' variables cannot judge it; any other
    error in the first step (a crash inside torch, an IndexError) is a fault a user's model meets."""
    if refuses_dense(ctx, error) and dense_refusal(ctx) is not None:
        ctx.mark_takes_only_sparse()
        return skipped(
            "inconclusive: the class takes only sparse gradients: it refuses a dense one with a clear error "
            f"({ctx.describe_error(error)}), so the checks that step with dense gradients are not run and "
            "`sparse` judges it"
        )
    need = ctx.driver.unmet_need(error) or _step_contract_of_its_own(ctx, error)
    if need is not None:
        return skipped(f"inconclusive: the class steps only with {need}: {ctx.describe_error(error)}")
    raised = raised_in(error, own_code(ctx), by="raise")
    refused = raised and isinstance(error, ValueError | TypeError | NotImplementedError)
    if refused or _asserted_in_words(ctx, error):
        return skipped(
            f"inconclusive: the class refuses the checks' variables (a {shape_text(SHAPES[0])} matrix and "
            f"two vectors) with a clear error ({ctx.describe_error(error)}), so optlab's problems cannot "
            "judge it"
        )
    wrong = wrong_signature(ctx, error)  # the class's update, called as the framework calls it
    if wrong is not None:
        return wrong.failed(ctx.describe_error(error))
    if _raised_switching_to_training(error):
        # Handed on to an object without the method (heavyball's SAMWrapper to a base that has none): a
        # switch the class may not need. Anything else is a broken switch of a schedule-free class, where
        # turning it off would train at the wrong point.
        handed_on = isinstance(error, AttributeError) and _NO_SWITCH.search(str(error)) is not None
        return failed(
            f"optimizer.train(), which a job calls before each training step, raised "
            f"{ctx.describe_error(error)}: the class defines train() and eval(), which optlab takes for a "
            "schedule-free mode switch",
            where=ctx.where(error),
            fix="make train() and eval() work for every optimizer the class may hold (a wrapper's base "
            "without them too), or, where they are no mode switch of the update, declare "
            'optlab_needs = {"train_eval": False} on the class (--needs \'{"train_eval": false}\')'
            if handed_on
            else "make train() work: a job calls it before every training step, and eval() before "
            "evaluating and saving",
        )
    return failed(
        f"the first step on a {shape_text(SHAPES[0])} matrix and two vectors raised "
        f"{ctx.describe_error(error)}",
        where=ctx.where(error),
        fix=fix_for_raised(error),
    )


# What an object without a mode switch says when one is handed on to it.
_NO_SWITCH = re.compile(r"no attribute '(?:train|eval)'")


def _raised_switching_to_training(error: Exception) -> bool:
    """The error came out of the driver's `to_training` (the class's own train(), called before a
    training step), not out of the step itself."""
    return any(frame.f_code.co_name == "to_training" for frame, _ in traceback.walk_tb(error.__traceback__))


def _asserted_in_words(ctx: CheckContext, error: Exception) -> bool:
    """`assert p.ndim == 2, "Muon optimizer only supports matrix parameters."` (Microsoft's Dion
    family) in the class's own file: a refusal that says what it refuses, though an assert. A bare
    assert says nothing, and stays a fault."""
    in_words = isinstance(error, AssertionError) and bool(str(error).strip())
    return in_words and raised_in(error, own_code(ctx), by="assert")


# A step that unpacks what its closure returns (`loss, output = closure()`, as Hessian-free
# optimizers written for a Gauss-Newton product do): the closure returns more than the loss.
_UNPACKS_THE_CLOSURE = re.compile(r"^\s*\w+(?:\s*,\s*\w+)+\s*=\s*[\w.]*closure\w*\(")


def _step_contract_of_its_own(ctx: CheckContext, error: Exception) -> str | None:
    """What a torch class's step() takes that torch's training loops never give, where the first
    step's error shows it: required arguments of its own (CurveBall's `step(model_output, loss_fn)`),
    or a closure returning more than the loss; else None. Not a fault: a contract of its own."""
    if ctx.target.style != "torch" or not isinstance(error, TypeError | ValueError):
        return None
    own = _own_step_arguments(ctx.target.cls)
    if own and isinstance(error, TypeError) and "required positional argument" in str(error):
        return (
            f"arguments of its own in step() ({', '.join(own)}), which torch's training loops, optlab's "
            "among them, never pass (they call step() or step(closure))"
        )
    file, _, line = ctx.where(error).rpartition(":")
    code = linecache.getline(file, int(line)) if line.isdigit() else ""
    if ctx.needs.closure and _UNPACKS_THE_CLOSURE.search(code):
        return (
            f"a closure that returns more than the loss (`{code.strip()}`), where torch's convention, "
            "which optlab's loops follow, has the closure return the loss"
        )
    return None


def _own_step_arguments(cls: type) -> list[str]:
    """The arguments step() requires besides its closure."""
    try:
        parameters = inspect.signature(inspect.unwrap(cls.step)).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return []
    return [
        name
        for name, p in list(parameters.items())[1:]  # after self
        if name != "closure"
        and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def _moves_small_variables(ctx: CheckContext) -> bool:
    """Whether WARMUP_STEPS steps move variables of magnitude 1e-4 (the checks' are about 1)."""
    driver = ctx.driver
    variables = driver.variables([a * 1e-4 for a in arrays(SHAPES, seed=0, mean=1.0)])
    optimizer = driver.optimizer_over(ctx.build, variables)
    start = driver.values(variables)
    for step in range(WARMUP_STEPS):
        driver.step(optimizer, variables, arrays(SHAPES, seed=1 + step), ctx.needs)
    return max_diff(driver.values(variables), start) > 0


def _non_finite_variables(values: Sequence[np.ndarray]) -> list[str]:
    """The checks' variables (of SHAPES) holding a NaN or an infinity, by shape."""
    return [f"variable {shape_text(SHAPES[i])}" for i, value in enumerate(values) if not _finite(value)]


def _non_finite_as_built(driver: Any, optimizer: Any) -> dict[str, np.ndarray]:
    """The optimizer's state that is not finite before any step (Keras builds it; torch's comes with
    the first step), by name."""
    return {name: value.copy() for name, value in driver.state(optimizer) if not _finite(value)}


def _state_made_non_finite(driver: Any, optimizer: Any, built: Mapping[str, np.ndarray]) -> list[str]:
    """The state not finite now, but what still holds exactly what it held as built: a sentinel, as a
    "lowest loss seen" kept at +inf until a loss comes, which the steps leave alone, is no step gone
    wrong (it had failed as "not finite")."""
    return [
        name
        for name, value in driver.state(optimizer)
        if not _finite(value) and not _as_built(built.get(name), value)
    ]


# Steps that must leave alone non-finite state a step has just set before it counts as a sentinel.
SENTINEL_STEPS = 2


@dataclass
class FirstSeen:
    """A state array as the step that made it non-finite left it: its object and its write count."""

    writes: tuple[Any, int]
    step: int
    left_alone: bool = False


def _state_made_non_finite_by_steps(
    driver: Any, optimizer: Any, built: Mapping[str, np.ndarray], first_seen: dict[str, FirstSeen], step: int
) -> tuple[list[str], list[str]]:
    """(state the steps made non-finite, state just made non-finite and still watched). torch makes
    its state in the first step, so a sentinel (a "lowest loss seen" set to +inf) cannot be told from
    a step gone wrong by what it was built as: it is the array a step set non-finite and the next
    SENTINEL_STEPS steps never wrote, neither in place nor replaced (a moment gone to inf is written
    by every step, and inf stays inf; it had failed as "not finite"). Where the framework counts no
    writes (Keras, whose state is built before any step), what `_state_made_non_finite` says."""
    names = _state_made_non_finite(driver, optimizer, built)
    writes = driver.state_writes(optimizer) if names else {}
    made, waiting = [], []
    for name in names:
        seen, now = first_seen.get(name), writes.get(name)
        if now is None:
            made.append(name)
        elif seen is None:
            first_seen[name] = FirstSeen(now, step)
            waiting.append(name)
        elif not _same_writes(seen.writes, now):
            seen.left_alone = False
            made.append(f"{name} (non-finite since step {seen.step + 1})")
        elif step - seen.step < SENTINEL_STEPS:
            waiting.append(name)
        else:
            seen.left_alone = True
    return made, waiting


def _same_writes(seen: tuple[Any, int] | None, now: tuple[Any, int] | None) -> bool:
    return seen is not None and now is not None and seen[0] is now[0] and seen[1] == now[1]


def _as_built(built: np.ndarray | None, value: np.ndarray) -> bool:
    """Whether `value` holds exactly what it held as built (NaN where it held NaN)."""
    return (
        built is not None
        and built.shape == value.shape
        and bool(np.array_equal(built, value, equal_nan=True))
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
    # Some designs rise first (a random initial velocity, D-Adaptation's growing step, a
    # rectified warm-up under Lookahead): the loss must be below its start by one of these.
    steps_taken, end = 0, start
    for checkpoint in DESCENT_CHECKPOINTS:
        for _ in range(checkpoint - steps_taken):
            grads = [v - t for v, t in zip(driver.values(variables), targets, strict=True)]
            driver.step(optimizer, variables, grads, ctx.needs)
        steps_taken, end = checkpoint, loss()
        if not math.isfinite(end) or end < start:
            break
    ratio = end / start
    non_finite = _non_finite_variables(driver.values(variables))
    if non_finite and update_made_non_finite(ctx):  # the fix is then no sign or rate (its own fail's)
        return non_finite_update(
            ctx,
            f"the loss went from {start:.4g} to {end:.4g} in {steps_taken} steps on a quadratic",
            non_finite,
            regardless="not a sign or a rate too large",
        )
    if not math.isfinite(end) or end >= start:
        return failed(
            f"the loss went from {start:.4g} to {end:.4g} in {steps_taken} steps on a well-conditioned "
            f"quadratic with lr={ctx.lr:g}",
            where=method_location(ctx),
            figure=ratio,
            fix=f"{driver.advice.sign_of_update}; check signs and that the learning rate is applied to the "
            "update and not far too large",
        )
    return passed(
        f"loss fell to {ratio:.3g} of its start in {steps_taken} steps on a quadratic (lr={ctx.lr:g}; "
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

    # Past any warm-up first (steps that only build state), so "the others were updated" can hold.
    warmup = still_steps(ctx, shapes, **overrides)
    try:
        for seed in range(3, 4 + warmup):
            driver.step(optimizer, variables, grads(seed, later_too=True), ctx.needs)
        saved = driver.values(variables)
        state = {i: driver.state_of(optimizer, variables, i) for i in (later, frozen)}
        for seed in (40, 41):
            driver.step(optimizer, variables, grads(seed, later_too=False), ctx.needs)
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
        override = _gradients_pass_through(ctx)
        return failed(
            "; ".join(problems)
            + (
                f" (the class's own {override}() override, which hands the gradients to the update it "
                "inherits, is where a None gradient is first seen: one replaced there, by zeros, steps the "
                "variable)"
                if override
                else ""
            ),
            where=method_location(ctx, override),
            figure=float(len(problems)),
            fix="leave a variable whose gradient is None alone: no weight decay, no momentum step, no state "
            "update for it"
            + (
                f"; your {override}() override must pass None gradients on as None, or drop them"
                if override
                else ""
            ),
        )
    kept = zero_grad_keeps(ctx)
    if kept:  # what makes a gradient None between steps in every torch loop
        return failed(
            f"gradients set to ones and a step taken, then {zero_grad_said(kept)}",
            where=method_location(ctx, "zero_grad"),
            figure=float(len(kept)),
            fix=ZERO_GRAD_FIX,
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


# Keras methods a class may override to change the gradients before its update method sees them.
GRADIENT_PASSING_METHODS = ("apply_gradients", "apply")


def _gradients_pass_through(ctx: CheckContext) -> str | None:
    """The Keras method (apply, apply_gradients) the user's class overrides in a class more derived
    than the one its update method comes from: the update is inherited, and the override is the
    class's own code on the gradients' way (ZeroFillAdam's apply() filling None with zeros)."""
    mro = ctx.target.cls.__mro__
    update = ctx.driver.advice.update_method

    def defined_at(method: str) -> int:
        return next((i for i, cls in enumerate(mro) if method in vars(cls)), len(mro))

    for method in GRADIENT_PASSING_METHODS:
        if defined_at(method) < defined_at(update) and method_location(ctx, method) != ctx.where():
            return method
    return None


CHECKS: Mapping[str, CheckFunction] = {
    "construct": check_construct,
    "dense_step": check_dense_step,
    "descends": check_descends,
    "none_grads": check_none_grads,
}
