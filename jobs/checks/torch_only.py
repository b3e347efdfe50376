"""The checks only PyTorch has: graph_mode (torch.compile), param_groups, closure,
mixed_precision (bf16 autocast, GradScaler).

Every check that means the same in all frameworks is in the tables of `jobs.checks.common`, written
once over the drivers; these drive torch directly, on a tiny MLP with fixed seeds (CPU
unless the check is about a device). The fresh-process checks (`resume_exact`,
`distributed`) are written once in `jobs.checks.fresh`.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import logging
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed, passed, skipped, warned
from jobs.checks.tools import (
    MOVES_NOTHING,
    SHAPES,
    WARMUP_STEPS,
    CheckFunction,
    arrays,
    clear_refusal,
    draws_randomly,
    fresh,
    inconclusive_random,
    isolated,
    line_computing_with,
    listed,
    made_non_finite,
    method_location,
    native,
    non_finite_update,
    raised_in,
    refusal_files,
    same_draws,
    same_value,
    takes_a_rate,
    update_made_non_finite,
    updates_nothing,
    user_line,
    user_method_lines,
)
from jobs.frameworks.base import raising_frame
from jobs.frameworks.torch_driver import closure_result, state_tensors
from optimizers.loop_needs import PLAIN, LoopNeeds, user_classes

SEED = 0


def _tiny_model() -> nn.Sequential:
    # tanh, not ReLU: no dead units, so every parameter gets a nonzero gradient.
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _batch(step: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1 + step)
    return torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator)


def _build(ctx: CheckContext, model_params: Iterable[Any], **overrides: Any) -> Any:
    """A new optimizer as a job steps it: in training mode where the class has modes (a job calls
    `optimizer.train()` before every step, and these checks never evaluate in between; the classes of
    facebookresearch/schedulefree start in eval mode and refuse to step before it)."""
    optimizer = ctx.build(model_params, **overrides)
    ctx.driver.to_training(optimizer, ctx.needs)
    return optimizer


def _backward(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    extra: Tensor | None = None,
    *,
    needs: LoopNeeds = PLAIN,
    backward: bool = True,
) -> Tensor:
    """Fresh gradients (old ones set to None) of the mean squared error on `batch`, plus the squared
    norm of `extra` (a parameter outside the model) when given: its gradient is fresh too, or a
    closure called again by step() would add to it. As the loop's closure ends (`closure_result`):
    a class that runs backward itself, or asks for the loss alone (`backward=False`, the gradients
    left be), gets the loss with its graph instead."""
    params = [*model.parameters(), *([] if extra is None else [extra])]
    for p in params if backward else ():
        p.grad = None
    inputs, targets = batch
    loss = nn.functional.mse_loss(model(inputs), targets)
    if extra is not None:
        loss = loss + (extra**2).sum()
    return closure_result(loss, needs, backward=backward)


def _closure(
    ctx: CheckContext,
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    extra: Tensor | None = None,
) -> Callable[..., Tensor]:
    """The loss and fresh gradients, with a graph when the class needs Hessian-vector products."""

    def closure(backward: bool = True) -> Tensor:
        with torch.enable_grad():  # step(closure) may run it under torch.no_grad()
            return _backward(model, batch, extra, needs=ctx.needs, backward=backward)

    return closure


def _step(ctx: CheckContext, step: Callable[..., Any], closure: Callable[..., Tensor]) -> None:
    """`step` the way the entry says the class is stepped: `step(closure)` only when it needs one."""
    if ctx.needs.closure:
        step(closure)
    else:
        step()


def _twin(model: nn.Module) -> nn.Sequential:
    """A second model with bitwise the same parameters (built, not deep-copied)."""
    twin = _tiny_model()
    twin.load_state_dict(model.state_dict())
    return twin


def _snapshot(tensors: Iterable[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


def _nonfinite(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _numpy_parameters(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().double().numpy() for name, p in model.named_parameters()}


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# --- graph_mode -----------------------------------------------------------------------------------


_COMPILE_BACKEND = "aot_eager"


@isolated
def check_graph_mode(ctx: CheckContext) -> Outcome:
    """torch.compile the step with dynamo (backend aot_eager: tracing and AOTAutograd, no inductor
    code generation, which costs tens of seconds on a small CPU) and compare with eager."""
    import torch._dynamo

    if draws_randomly(ctx):
        # A compiled graph draws its random numbers its own way (and dynamo may break on them).
        return skipped(inconclusive_random("comparing compiled steps with eager ones"))
    if _compiled_by_the_class(ctx.target.cls.step):  # type: ignore[attr-defined]
        return skipped(
            "inconclusive: the class compiles its whole step itself (@torch.compile on step), which torch "
            "cannot compile again; its compiled step is the one every job and the other checks run"
        )
    batch = _batch()
    eager_model = _tiny_model()
    compiled_model, start = _twin(eager_model), _twin(eager_model)
    eager = _build(ctx, eager_model.parameters())
    compiled = _build(ctx, compiled_model.parameters())
    torch._dynamo.reset()
    breaks_before = _graph_breaks()
    quiet = logging.getLogger("torch._dynamo"), logging.getLogger("torch._logging")
    levels = [logger.level for logger in quiet]
    try:
        for logger in quiet:
            logger.setLevel(logging.ERROR)
        step = torch.compile(compiled.step, backend=_COMPILE_BACKEND)
        eager_closure, compiled_closure = (
            _closure(ctx, eager_model, batch),
            _closure(ctx, compiled_model, batch),
        )
        compiled_by_the_class = 0  # graphs dynamo made during eager steps: the class's own torch.compile
        for _ in range(3):
            eager_closure()
            graphs_before = _graphs_compiled()
            _step(ctx, eager.step, eager_closure)
            compiled_by_the_class += _graphs_compiled() - graphs_before
            compiled_closure()
            _step(ctx, step, compiled_closure)
        breaks = _graph_breaks() - breaks_before
    except Exception as exc:
        if _torch_says_it_is_its_bug(exc):
            return skipped(_compiler_bug(ctx, exc))
        return warned(
            f"torch.compile(optimizer.step, backend={_COMPILE_BACKEND!r}) raised {ctx.describe_error(exc)}",
            where=user_line(ctx, exc),
            fix="keep step() traceable: no Python control flow on tensor values (.item(), if tensor), "
            "no data-dependent shapes",
        )
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
        torch._dynamo.reset()
    unbounded = made_non_finite(*(_numpy_parameters(m) for m in (start, eager_model, compiled_model)))
    # NaN against NaN says nothing of compiling: the update's, where dense_step saw it too (a warn had
    # blamed dynamo); otherwise the warn below stands.
    if unbounded and update_made_non_finite(ctx):
        return non_finite_update(
            ctx,
            "3 eager steps and 3 compiled steps both end with non-finite values",
            unbounded,
            regardless="compiled or not",
        )
    difference = max(
        _max_abs(a.detach(), b.detach())
        for a, b in zip(eager_model.parameters(), compiled_model.parameters(), strict=True)
    )
    scale = max(float(p.detach().abs().max()) for p in eager_model.parameters())
    own_compile_note = ""
    if not difference <= 1e-5 * max(1.0, scale) and compiled_by_the_class:
        # The class compiles part of its step itself (the reference Muon's Newton-Schulz iteration):
        # its eager steps ran that part compiled (inductor by default), which rounds otherwise than
        # the trace of the whole step. Eager steps with that compile made eager are the comparison.
        plain = _eager_with_its_compile_off(ctx, start, batch)
        if plain is None:
            return skipped(
                f"inconclusive: 3 compiled steps differ from 3 eager steps by {difference:.3g}, but the "
                "class compiles part of its step itself, and its eager steps with that compile made eager "
                "raised, so compiled and eager steps cannot be told apart by their results"
            )
        difference = max(
            _max_abs(a, b.detach()) for a, b in zip(plain, compiled_model.parameters(), strict=True)
        )
        own_compile_note = (
            " (the class compiles part of its step itself: its eager steps ran with that torch.compile made "
            "eager, as the trace of the whole step runs it)"
        )
    if not difference <= 1e-5 * max(1.0, scale):
        sensitivity, computed_in = _rounding_sensitivity(ctx, start, batch)
        if difference <= _SENSITIVITY_FACTOR * sensitivity:  # False for NaN: a non-finite compiled step warns
            low = _named(computed_in)
            rounding = (
                "3 eager steps from a start one rounding step away (each parameter times 1 + float32 eps) "
                f"differ by {sensitivity:.3g} already: the step amplifies rounding (a line search's "
                "branches on the loss)"
                if computed_in == torch.float32
                else f"3 eager steps from a start one rounding step away, or with their {low} made float32, "
                f"differ by {sensitivity:.3g} already: the step computes in {low}, whose rounding the "
                "compiled graph's other order of operations changes"
            )
            return skipped(
                f"inconclusive: 3 compiled steps differ from 3 eager steps by {difference:.3g}, and "
                f"{rounding}, so compiled and eager cannot be told apart by their results"
            )
        return warned(
            f"3 compiled steps differ from 3 eager steps by {difference:.3g}{own_compile_note}",
            where=method_location(ctx),
            figure=difference,
            fix="avoid state changes dynamo cannot see (Python attributes updated in step, random numbers) "
            "and math that branches on torch.compiler.is_compiling()",
        )
    breaks_note = f", {breaks} graph break(s)" if breaks else ", no graph breaks"
    return passed(
        f"torch.compile(step, backend={_COMPILE_BACKEND!r}) matches eager over 3 steps{breaks_note}"
        f"{own_compile_note} (figure: max abs difference)",
        difference,
    )


def _compiled_by_the_class(step: Any) -> bool:
    """Whether `step`, through its wrappers (torch's profiling hook, no_grad), is a function
    torch.compile made: compiling it again raises in torch's own code. Not one dynamo was told to
    leave alone (`_torchdynamo_disable`), a wrapper torch itself puts on a step it has compiled."""
    while step is not None:
        if hasattr(step, "_torchdynamo_orig_callable") and not getattr(step, "_torchdynamo_disable", False):
            return True
        step = getattr(step, "__wrapped__", None)
    return False


def _eager_with_its_compile_off(
    ctx: CheckContext, start: nn.Module, batch: tuple[Tensor, Tensor]
) -> list[Tensor] | None:
    """The parameters after 3 eager steps from `start` with every torch.compile the class's code
    makes run eagerly (torch's "force_eager" stance); None where they raise."""
    replica = _twin(start)
    try:
        optimizer = _build(ctx, replica.parameters())
        closure = _closure(ctx, replica, batch)
        with torch.compiler.set_stance("force_eager"):
            for _ in range(3):
                closure()
                _step(ctx, optimizer.step, closure)
    except Exception:
        return None
    return _snapshot(replica.parameters())


# torch's compiler saying that an error is its own bug ("Guard failed on the same frame it was created.
# This is a bug - please create an issue.", "report a bug to PyTorch"): nothing the class can fix.
_TORCH_BUG = re.compile(
    r"\bthis is a bug\b|\b(?:report|file) a bug to pytorch\b|\bbug in pytorch\b", re.IGNORECASE
)


def _torch_says_it_is_its_bug(error: Exception) -> bool:
    """Whether torch raised `error` in its own code (not the class, in whatever words) calling it a
    bug of torch's."""
    frame = raising_frame(error)
    torch_dir = Path(torch.__file__).parent
    return (
        frame is not None
        and Path(frame.filename).is_relative_to(torch_dir)
        and bool(_TORCH_BUG.search(str(error)))
    )


def _compiler_bug(ctx: CheckContext, error: Exception) -> str:
    """The skip of a compile that failed in torch's own compiler, by its own words."""
    where = user_line(ctx, error)
    tracing = f" while tracing {where}" if where != ctx.target.class_location() else ""
    return (
        f"inconclusive: torch's compiler failed on step(){tracing}, and its message says the fault is "
        f"torch's, not the class's: torch.compile(optimizer.step, backend={_COMPILE_BACKEND!r}) raised "
        f"{ctx.describe_error(error)}; the compiled step was not judged (the other checks judge the eager "
        "one)"
    )


# A compiled step that differs from eager by no more than this many times what a rounding-level nudge
# of the start does to eager steps differs by rounding, not by what dynamo saw.
_SENSITIVITY_FACTOR = 10.0


def _rounding_sensitivity(
    ctx: CheckContext, start: nn.Module, batch: tuple[Tensor, Tensor]
) -> tuple[float, torch.dtype]:
    """What rounding alone does to 3 eager steps from `start`, beside the least precise floating-point
    dtype they compute in: how far 3 eager steps from `start` nudged by one float32 rounding step
    (every parameter times 1 + eps) end from 3 eager steps from `start` itself (torch's LBFGS with a
    strong-Wolfe line search turns such a nudge into 1e-3 in one step, where a plain update keeps it
    near 1e-7); and, where the step computes in bfloat16 or float16, how far the same steps with those
    made float32 end from it (timm's AdaMuon runs its Newton-Schulz iteration in bfloat16, whose
    rounding the compiled graph's other order of operations changes: this bounds what that can do,
    where a bfloat16-sized nudge of every parameter would excuse a 3% difference). 0 where a run
    raises: nothing then excuses the difference."""
    computed_in = _FloatingDtypes()
    runs = []
    for nudge, mode in ((0.0, computed_in), (1.0, None), (0.0, _InFloat32())):
        if isinstance(mode, _InFloat32) and computed_in.least_precise == torch.float32:
            break
        replica = _twin(start)
        with torch.no_grad():
            for p in replica.parameters():
                p.mul_(1.0 + nudge * torch.finfo(p.dtype).eps)
        try:
            optimizer = _build(ctx, replica.parameters())
            closure = _closure(ctx, replica, batch)
            for _ in range(3):
                closure()
                with mode if mode is not None else contextlib.nullcontext():
                    _step(ctx, optimizer.step, closure)
        except Exception:
            return 0.0, computed_in.least_precise
        runs.append(_snapshot(replica.parameters()))
    return max(_max_difference([runs[0]], [run]) for run in runs[1:]), computed_in.least_precise


# What a step computes in below float32: made float32 by `_InFloat32`.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class _InFloat32(TorchFunctionMode):
    """Every bfloat16 or float16 a torch function is asked for made float32 (a dtype argument,
    `.bfloat16()`, `.half()`): the step without its low-precision rounding."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if getattr(func, "__name__", "") in ("bfloat16", "half") and isinstance(args[0], Tensor):
            return args[0].float() if args[0].dtype != torch.float64 else args[0]
        kwargs = {
            key: torch.float32 if value in _LOW_PRECISION else value for key, value in (kwargs or {}).items()
        }
        args = [torch.float32 if isinstance(a, torch.dtype) and a in _LOW_PRECISION else a for a in args]
        return func(*args, **kwargs)


class _FloatingDtypes(TorchFunctionMode):
    """The floating-point dtypes of what torch functions return while it is entered: what a step
    computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.least_precise = torch.float32

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, tuple | list) else (result,):
            if isinstance(value, Tensor) and value.is_floating_point():
                if torch.finfo(value.dtype).eps > torch.finfo(self.least_precise).eps:
                    self.least_precise = value.dtype
        return result


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


# --- param_groups, closure ------------------------------------------------------------------------


@isolated
def check_param_groups(ctx: CheckContext) -> Outcome:
    """Two groups, the second with every hyperparameter that lives in the groups halved, against
    one single-group optimizer per setting (or, where the update couples the groups by design,
    against the same two groups with equal settings); then a group added after two steps, against
    a fresh optimizer over it and against the same group present, idle, from the start. Where that
    finds no fault, a value a step keeps in the group and bumps once per parameter (a step count
    counting parameters) is a warn."""
    outcome = _param_groups_compared(ctx)
    if outcome.status == "fail":
        return outcome
    return _group_counts_parameters(ctx) or outcome


# Steps after which the groups' numbers are read: each of the last two must add one per parameter.
COUNTED_STEPS = 3


def _group_counts_parameters(ctx: CheckContext) -> Outcome | None:
    """A warn where a numeric group value rises, step after step, by exactly the number of the
    group's parameters (more than one): `group['step'] += 1` inside the loop over parameters, so
    bias correction runs that many times too fast and differs from parameter to parameter. A group
    counter rising by one a step (Distributed Shampoo's) is right; None then, and where the steps
    raise."""
    driver = ctx.driver
    try:
        with same_draws(ctx):
            optimizer, variables = fresh(ctx)
            seen = []
            for step in range(COUNTED_STEPS):
                driver.step(optimizer, variables, arrays(SHAPES, seed=1 + step), ctx.needs)
                seen.append([_numbers(group) for group in optimizer.param_groups])
    except Exception:  # the checks before have judged the steps' errors
        return None
    for index, group in enumerate(optimizer.param_groups):
        count = len(group["params"])
        counting = _rising_by(count, [numbers[index] for numbers in seen]) if count > 1 else []
        if counting:
            key = counting[0]
            where, code = line_computing_with(ctx, key, _BUMPS)
            quoted = f" (`{code}`)" if code else ""
            return warned(
                f"param group {index}'s {key!r} rises by {count} a step, once per parameter of the group's "
                f"{count}{quoted}: a step count kept in the group and bumped inside the loop over parameters "
                "counts parameters, not steps (bias correction then runs that many times too fast, and "
                "differs from parameter to parameter)",
                where=where or method_location(ctx),
                figure=float(count),
                fix="count steps once per group, before the loop over its parameters, or keep the count "
                "per parameter in self.state[p]['step'] as torch's Adam does",
            )
    return None


def _rising_by(count: int, history: Sequence[Mapping[str, float]]) -> list[str]:
    """The keys whose value rises by exactly `count` from each step of `history` to the next."""
    rises = [
        {key: after[key] - before[key] for key in after.keys() & before.keys()}
        for before, after in itertools.pairwise(history)
    ]
    return sorted(key for key in rises[0] if all(rise.get(key) == count for rise in rises))


# What a line that bumps a counter does.
_BUMPS = re.compile(r"\+=|\+\s*1\b")


def _numbers(group: Mapping[str, Any]) -> dict[str, float]:
    """A param group's numeric values (a one-element tensor as its number; flags aside)."""
    found: dict[str, float] = {}
    for key, value in group.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[str(key)] = float(value)
    return found


def _param_groups_compared(ctx: CheckContext) -> Outcome:
    if draws_randomly(ctx):
        return skipped(inconclusive_random("comparing two groups with separately built optimizers"))
    probe = ctx.build(_tiny_model().parameters())
    halved = _halved_settings(ctx, _group_keys(probe))
    fix = (
        "read every hyperparameter from the group being updated (group['beta']), not from "
        "self.defaults or attributes"
    )
    lr_refused = ""
    try:
        two_groups, alone = _two_groups(ctx, halved)
    except Exception as exc:
        refusal = _group_refusal(ctx, exc)
        if "lr" not in halved or len(halved) == 1:
            return skipped(refusal)
        # D-Adaptation and Prodigy refuse a group lr other than the first group's (or 0) by design,
        # and take every other value from each group: those are still compared, the lr left alike.
        lr_refused = f" (lr left alike: the class refuses a group lr of its own: {ctx.describe_error(exc)})"
        halved = {k: v for k, v in halved.items() if k != "lr"}
        try:
            two_groups, alone = _two_groups(ctx, halved)
        except Exception as again:
            return skipped(_group_refusal(ctx, again))
    settings = (
        ", ".join(f"{native(ctx, k)}={_shown(v)}" for k, v in halved.items()) or "the optimizer's own values"
    )
    settings += lr_refused
    # The first group keeps the optimizer's own values: if even it differs (at all) from a single-group
    # optimizer over it, the class couples its groups by design (a global step size or statistics
    # over all parameters: D-Adaptation's `d`, Adai's mean second moment, AliG's global step), so
    # no single-group optimizer is a reference and a group's own values must reach its update.
    coupled = _max_difference(two_groups[:SECOND], alone[:SECOND]) > 0
    if not coupled and halved and _max_difference(two_groups, alone) > 1e-6:
        # Coupled under the halved values only (AdaGC clips by the norm of every group's gradients
        # once its lambda_abs is small enough): the same two groups built with them for all show
        # it, in the first group. Built with them, not given them per group: a class that reads
        # self.defaults is then alike in both, and is not taken for one that couples its groups.
        both, both_alone = _two_groups(ctx, halved, as_defaults=True)
        coupled = _max_difference(both[:SECOND], both_alone[:SECOND]) > 0
    if coupled:
        same_settings, _ = _two_groups(ctx, {})
        if halved and _max_difference(two_groups[SECOND:], same_settings[SECOND:]) == 0:
            read, at = _read_outside_the_group(ctx)
            return failed(
                f"a second param group with {settings} stepped bitwise like one with the optimizer's own "
                f"values: the group's values are ignored{read}",
                where=at or method_location(ctx),
                fix=fix,
            )
    else:
        difference = _max_difference(two_groups, alone)
        dropped = _dropped_by_add_param_group(ctx, halved) if difference > 1e-6 else ""
        if dropped:
            return failed(
                f"a second param group with {settings} does not step like a single-group optimizer built "
                f"with those values (max abs difference {difference:.3g} after 2 steps): {dropped}",
                where=method_location(ctx, "add_param_group"),
                figure=difference,
                fix="pass the group given on whole, super().add_param_group(param_group), after filling "
                "what it lacks with param_group.setdefault(key, value); never a new dict of some of its keys",
            )
        if difference > 1e-6:
            transformed = _stored_transformed(ctx, halved)
            derived = None if transformed else _derived_at_construction(ctx, halved)
            if derived is not None:
                key, said = derived
                return failed(
                    f"a second param group with {settings} does not step like a single-group optimizer built "
                    f"with those values (max abs difference {difference:.3g} after 2 steps){said}",
                    where=_where_init_sets(ctx, key),
                    figure=difference,
                    fix=f"derive {key} in step() from the group being updated (store None, or nothing, until "
                    "a value is given), so a group given its own values derives its own from them",
                )
            read, at = ("", "") if transformed else _read_outside_the_group(ctx)
            return failed(
                f"a second param group with {settings} does not step like a single-group optimizer built "
                f"with those values (max abs difference {difference:.3g} after 2 steps){transformed}{read}",
                where=at or method_location(ctx, "__init__" if transformed else None),
                figure=difference,
                fix=_TRANSFORMED_FIX if transformed else fix,
            )
    added = _added_group_problem(ctx, halved, coupled=coupled, own_lr=not lr_refused)
    if added is not None:
        return added
    judged = (
        "changes its own update (the class couples its groups by design: a group's update depends on the "
        "other groups, so no single-group optimizer is a reference)"
        if coupled
        else "steps like a single-group optimizer with those values"
    )
    return passed(
        f"a second group with {settings} {judged}, and a group added by add_param_group after 2 steps "
        "steps like a fresh optimizer over it or like the same group present, idle, from the start"
    )


def _group_refusal(ctx: CheckContext, error: Exception) -> str:
    """Why the check does not apply, where `error` is a clear refusal of param groups: a ValueError
    about groups (torch's own, of a group it cannot take), or any error about groups the class's code
    raises with a `raise` statement (D-Adaptation's RuntimeError for a group lr of its own).
    Anything else is raised again: the check reports it."""
    # torch's documentation calls param groups "per-parameter options", and so do classes refusing them.
    about_groups = any(words in str(error).lower() for words in ("group", "per-parameter"))
    clear = isinstance(error, ValueError) or raised_in(error, refusal_files(ctx), by="raise")
    if not (about_groups and clear):
        raise error
    return f"not applicable: the class refuses param groups with a clear error ({ctx.describe_error(error)})"


_TRANSFORMED_FIX = (
    "store each hyperparameter in the param groups as given and apply any transformation in step(), so a "
    "value means the same in a group of its own as in the constructor"
)


def _stored_transformed(ctx: CheckContext, settings: Mapping[str, Any]) -> str:
    """Where the constructor stores some of `settings` in its group as other values (GrokFastAdamW
    divides lr by 1 + grokfast_lamb): the same value given in a group dict is used as given, so a
    group's value and the constructor's mean different things. A sentence to add, or ''."""
    group = _build(ctx, _tiny_model().parameters(), **settings).param_groups[0]
    changed = [
        f"{native(ctx, k)}={v!r} as {group[native(ctx, k)]!r}"
        for k, v in settings.items()
        if native(ctx, k) in group and not same_value(group[native(ctx, k)], v)
    ]
    if not changed:
        return ""
    return (
        f": the constructor stores {', '.join(changed)} in its group, while a group given its own values "
        "keeps them as given, so the same value means a different setting there"
    )


def _derived_at_construction(ctx: CheckContext, halved: Mapping[str, Any]) -> tuple[str, str] | None:
    """A group value the constructor derives from others (timm's Mars: `betas_1d=betas_1d or betas`;
    AdamWLegacy: `max_lr_snapshot` from lr): built with `halved`, a single-group optimizer's group
    holds another value for it than one built with the class's own values, while a group given
    `halved` as its own inherits the constructor's. Named (key, sentence) only where giving the
    second group the derived values too makes it step alike: then they are the cause. Else None."""
    try:
        own = _build(ctx, _tiny_model().parameters()).param_groups[0]
        given = _build(ctx, _tiny_model().parameters(), **halved).param_groups[0]
        settings = {native(ctx, k) for k in halved}
        derived = {
            key: value
            for key, value in given.items()
            if key != "params" and key not in settings and key in own and not same_value(own[key], value)
        }
        if not derived or _max_difference(*_two_groups(ctx, dict(halved), second_group=derived)) > 1e-6:
            return None
    except Exception:
        return None  # a group the class refuses with those values: no cause shown, the fail stands as it was
    key = next(iter(derived))
    others = f" (and {', '.join(list(derived)[1:])})" if len(derived) > 1 else ""
    return key, (
        f": the constructor derives {key}{others} from the values it is given ({_shown(derived[key])} when "
        f"built with those values, {_shown(own[key])} with its own), and a group given its own values "
        f"inherits the constructor's {key}; given the derived value as well, the group steps alike"
    )


def _where_init_sets(ctx: CheckContext, key: str) -> str:
    """`file:line` where a constructor of the class's names `key` in its body (`betas_1d=...` in the
    defaults it builds, `defaults["key"]`), else its `def __init__`."""
    for klass in user_classes(ctx.target.cls):
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        try:
            lines, first = inspect.getsourcelines(init)
            path = inspect.getsourcefile(init)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        function = tree.body[0]
        if not isinstance(function, ast.FunctionDef):
            continue
        # The body only: the signature (`betas_1d=None`) names the argument too.
        body = [node for statement in function.body for node in ast.walk(statement)]
        named = [
            node.lineno
            for node in body
            if (isinstance(node, ast.keyword) and node.arg == key)
            or (isinstance(node, ast.Constant) and node.value == key)
        ]
        if named:
            return f"{path}:{first + min(named) - 1}"
    return method_location(ctx, "__init__")


_ADDED_GROUP_FIX = "keep no per-group bookkeeping outside param_groups (e.g. lists built in __init__)"
_ADDED_STATE_FIX = (
    "create a parameter's state in step() when it has none (`if not state: ...`), not only in __init__: "
    "parameters added by add_param_group (or loaded without that key) have none"
)
_BASE_INIT_FIX = (
    "call super().__init__(params, defaults) in __init__ (a wrapper: with its base's param groups), or "
    "define add_param_group of its own (a wrapper: hand the group to its base, and create the wrapper's "
    "own state for the group's parameters)"
)
SECOND = 1  # the index of the second group's parameters in `_two_groups`' results


def _two_groups(
    ctx: CheckContext,
    halved: dict[str, Any],
    *,
    as_defaults: bool = False,
    second_group: Mapping[str, Any] | None = None,
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Two steps of one optimizer over two groups (the second with `halved`, and `second_group`'s
    group values as they are; both, given to the constructor, if `as_defaults`), and of one
    single-group optimizer per group: each group's parameters afterwards, from both. More, up to
    `WARMUP_STEPS`, until the parameters have moved: a warm-up that builds state only (RAdam_4step's
    first four steps) compares nothing."""
    model = _tiny_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    if as_defaults:
        optimizer = _build(ctx, [{"params": first}, {"params": second}], **halved)
    else:
        settings = {**{native(ctx, k): v for k, v in halved.items()}, **(second_group or {})}
        optimizer = _build(ctx, [{"params": first}, {"params": second, **settings}])
    # One model per reference optimizer, given the two-group model's parameters of the other group
    # before every step: each then sees the gradients the two-group model sees for its group, from a
    # graph of its own (a Hessian-vector product frees the graph it uses).
    first_model, second_model = _twin(model), _twin(model)
    references = [
        (first_model, _build(ctx, first_model[0].parameters(), **(halved if as_defaults else {}))),
        (second_model, _build(ctx, second_model[2].parameters(), **halved)),
    ]
    start = _snapshot(model.parameters())
    # A batch of its own each step: with the same gradient twice, Adam's step does not depend on its
    # betas, and a class reading them from self.defaults would pass.
    for step in range(WARMUP_STEPS):
        if step >= 2 and _max_difference([_snapshot(model.parameters())], [start]) > 0:
            break
        batch = _batch(step)
        with torch.no_grad():
            for mine, theirs in zip(first_model[2].parameters(), model[2].parameters(), strict=True):
                mine.copy_(theirs)
            for mine, theirs in zip(second_model[0].parameters(), model[0].parameters(), strict=True):
                mine.copy_(theirs)
        for stepped_model, stepped in ((model, optimizer), *references):
            closure = _closure(ctx, stepped_model, batch)
            closure()
            _step(ctx, stepped.step, closure)
    together = [_snapshot(model[0].parameters()), _snapshot(model[2].parameters())]
    return together, [_snapshot(first_model[0].parameters()), _snapshot(second_model[2].parameters())]


def _max_difference(a: Sequence[Sequence[Tensor]], b: Sequence[Sequence[Tensor]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return max(_max_abs(x, y) for x, y in pairs)


def _added_group_problem(
    ctx: CheckContext, halved: dict[str, Any], *, coupled: bool, own_lr: bool = True
) -> Outcome | None:
    """The failure of a group added after two steps, or None. It may start afresh (its own step
    count) or as if it had been there, idle, all along (a global step count): either is the class's
    own semantics. Anything else is bookkeeping outside param_groups. Where the groups are coupled
    neither is a reference: the step must then run and stay finite. The added group has an lr of its
    own unless the class refuses one (`own_lr`)."""
    lr = {native(ctx, "lr"): ctx.lr * 0.25} if takes_a_rate(ctx) and own_lr else {}
    given = ", ".join(f"{k}={v:g}" for k, v in lr.items())
    with same_draws(ctx, seed=3):
        try:
            added = _added_group_run(ctx, halved, lr, from_start=False)
        except Exception as exc:
            return _added_group_raised(ctx, f"add_param_group({given}) after 2 steps, then a step", exc)
    extra = added[-1][0]
    if not bool(torch.isfinite(extra).all()) and update_made_non_finite(ctx):  # not the added group's
        return non_finite_update(
            ctx,
            f"a param group added with add_param_group({given}) after 2 steps ends non-finite",
            ["the added group's parameter"],
            regardless="whatever the groups",
        )
    if not bool(torch.isfinite(extra).all()):
        return failed(
            f"a param group added with add_param_group({given}) after 2 steps is not finite after a step",
            where=method_location(ctx),
            fix=_ADDED_GROUP_FIX,
        )
    if coupled:
        return None
    afresh = _fresh_group_step(ctx, lr)
    from_fresh, from_idle = _max_abs(extra, afresh), math.inf
    if from_fresh > 1e-6:
        try:
            with same_draws(ctx, seed=3):
                idle = _added_group_run(ctx, halved, lr, from_start=True)
            from_idle = _max_difference(added, idle)
        except Exception:  # an idle group has no gradient, which a class may not take (none_grads says so)
            pass
    if min(from_idle, from_fresh) > 1e-6:
        return failed(
            f"a param group added with add_param_group({given}) after 2 steps steps neither like a fresh "
            f"optimizer over it (max abs difference {from_fresh:.3g}) nor like the same group given at "
            f"construction and idle until then ({from_idle:.3g})",
            where=method_location(ctx),
            fix=_ADDED_GROUP_FIX,
        )
    return None


def _lacks_defaults(ctx: CheckContext, error: Exception) -> bool:
    """Whether the optimizer had no self.defaults, which torch's add_param_group fills a new group
    from and only torch's Optimizer.__init__ sets: a wrapper that lends its base's groups and never
    runs it (michaelrzhang's Lookahead) breaks there."""
    if not isinstance(error, AttributeError) or error.name != "defaults":
        return False
    return isinstance(error.obj, ctx.target.cls)


def _added_group_raised(ctx: CheckContext, what: str, error: Exception) -> Outcome:
    """The failure of adding a group that raised, with the fix its error points to."""
    raised = f"{what}, raised {ctx.describe_error(error)}"
    if _lacks_defaults(ctx, error):
        return failed(
            f"{raised}: the class never ran torch.optim.Optimizer.__init__, which sets the self.defaults "
            "that torch's add_param_group fills a new group from",
            where=method_location(ctx, "__init__"),
            fix=_BASE_INIT_FIX,
        )
    skipped_init = ctx.driver.base_init_skipped(error)
    if skipped_init is not None:  # a hook dict torch's methods read, which Optimizer.__init__ sets
        said, fix = skipped_init
        return failed(f"{raised}: {said}", where=method_location(ctx, "__init__"), fix=fix)
    key = _group_key_added_groups_lack(ctx, error)
    if key is not None:  # a key of the groups, not of a parameter's state
        own = _defines(ctx, "add_param_group")
        return failed(
            f"{raised}: {key!r} is a key of the constructor's param groups that a group added later lacks ("
            + (
                "the class's own add_param_group() does not set it"
                if own
                else "torch's add_param_group fills a new group from self.defaults, which do not hold it"
            )
            + ")",
            where=method_location(ctx, "add_param_group" if own else "__init__"),
            fix=f"set the key in add_param_group (param_group.setdefault({key!r}, ...)) or in defaults "
            "(the dict given to super().__init__(params, defaults)), so a group added later has it",
        )
    # A KeyError on the added group's parameters: their state was made in __init__, for the first.
    fix = _ADDED_STATE_FIX if isinstance(error, KeyError) else _ADDED_GROUP_FIX
    return failed(raised, where=method_location(ctx), fix=fix)


def _dropped_by_add_param_group(ctx: CheckContext, halved: Mapping[str, Any]) -> str:
    """What the class's own add_param_group() (which torch's Optimizer.__init__ calls for every group)
    leaves out of a group given `halved`: the keys of self.defaults the group then lacks, and the
    values given that it does not hold; "" where it keeps them, or the class does not override it."""
    if not _defines(ctx, "add_param_group"):
        return ""
    model = _tiny_model()
    settings = {native(ctx, k): v for k, v in halved.items()}
    try:
        optimizer = _build(
            ctx,
            [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), **settings}],
        )
    except Exception:  # the groups refused: the comparison above said so
        return ""
    group = optimizer.param_groups[-1]
    defaults = getattr(optimizer, "defaults", None)
    lacking = [key for key in defaults if key not in group] if isinstance(defaults, Mapping) else []
    lost = [key for key, value in settings.items() if key in group and not same_value(group[key], value)]
    if not lacking and not lost:
        return ""
    said = [f"lacks {listed(lacking, 4)} (read then from elsewhere)"] if lacking else []
    said += [f"holds other values of {listed(lost, 4)} than given"] if lost else []
    return (
        "the class's own add_param_group(), through which torch's Optimizer.__init__ adds every group, "
        f"keeps only part of the group: the second group {' and '.join(said)}"
    )


def _defines(ctx: CheckContext, method: str) -> bool:
    """Whether the class's own code (its package's, not torch's) defines `method`."""
    return any(method in vars(klass) for klass in user_classes(ctx.target.cls))


def _group_key_added_groups_lack(ctx: CheckContext, error: Exception) -> str | None:
    """The key of a KeyError where it is a group key: held by the groups the constructor made (or by
    self.defaults) and missing from a group add_param_group adds (Lookahead's `lookahead_alpha`,
    set for the constructor's groups only). None otherwise (a parameter's state, as a rule)."""
    key = error.args[0] if isinstance(error, KeyError) and error.args else None
    if not isinstance(key, str):
        return None
    try:
        with same_draws(ctx, seed=3):
            model = _tiny_model()
            optimizer = _build(ctx, list(model[0].parameters()))
            optimizer.add_param_group({"params": [nn.Parameter(_EXTRA_START.clone())]})
    except Exception:  # the add itself raised: not a key the added group lacks
        return None
    *built, added = optimizer.param_groups
    defaults = getattr(optimizer, "defaults", None)
    held = any(key in group for group in built) or (isinstance(defaults, Mapping) and key in defaults)
    return key if held and key not in added else None


_EXTRA_START = torch.linspace(-1.0, 1.0, 5)


def _added_group_run(
    ctx: CheckContext, halved: dict[str, Any], lr: dict[str, float], *, from_start: bool
) -> list[list[Tensor]]:
    """Every parameter after 2 steps over two groups and a third step with an extra group, added by
    add_param_group before it or (`from_start`) given at construction and idle until then."""
    model, batch = _tiny_model(), _batch()
    extra = nn.Parameter(_EXTRA_START.clone())
    groups: list[dict[str, Any]] = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), **{native(ctx, k): v for k, v in halved.items()}},
    ]
    optimizer = _build(ctx, [*groups, {"params": [extra], **lr}] if from_start else groups)
    for _ in range(2):
        closure = _closure(ctx, model, batch)
        closure()
        _step(ctx, optimizer.step, closure)
    if not from_start:
        optimizer.add_param_group({"params": [extra], **lr})
        ctx.driver.to_training(optimizer, ctx.needs)  # as a job before every step: the new group too
    closure = _closure(ctx, model, batch, extra=extra)
    closure()
    _step(ctx, optimizer.step, closure)
    return [_snapshot(model.parameters()), [extra.detach().clone()]]


def _fresh_group_step(ctx: CheckContext, lr: dict[str, float]) -> Tensor:
    """The extra parameter after one step of a fresh optimizer over it alone."""
    alone = nn.Parameter(_EXTRA_START.clone())
    reference = _build(ctx, [{"params": [alone], **lr}])

    def alone_closure(backward: bool = True) -> Tensor:
        if backward:
            alone.grad = None
        with torch.enable_grad():
            return closure_result((alone**2).sum(), ctx.needs, backward=backward)

    with same_draws(ctx, seed=3):
        alone_closure()
        _step(ctx, reference.step, alone_closure)
    return alone.detach().clone()


# A read of one value for every group: the constructor's (`self.defaults[...]`), the first group's.
_ONE_FOR_ALL_GROUPS = re.compile(r"self\.defaults\s*(?:\[|\.get\()|self\.param_groups\s*\[\s*0\s*\]")


# Methods a step never runs: a read there does not reach a group's update (AdamWLegacy's
# __setstate__ fills in `self.defaults` for old pickles, and runs only when loading).
_NOT_STEPPING = frozenset({"__init__", "__setstate__", "__getstate__", "state_dict", "load_state_dict"})


def _read_outside_the_group(ctx: CheckContext) -> tuple[str, str]:
    """Where a method of the class (not its constructor) reads a value for every group at once, and
    the words saying so; ("", "") where none does. The likely cause of a group's values not reaching
    its update, pointed at where the fix goes."""
    for found in user_method_lines(ctx, skip=_NOT_STEPPING):
        if _ONE_FOR_ALL_GROUPS.search(found.code):
            said = f"; `{found.line.strip()}` in {found.method}() reads one value for every group"
            return said, found.where
    return "", ""


# Hyperparameters of several numbers: each is halved.
_HALVED_EACH = ("float_pair", "float_tuple", "float_list")


def _shown(value: Any) -> str:
    """A setting as a message shows it: a float to 6 significant digits (half a float32 tensor's rate
    is 0.0005000000237487257 as a Python float), a tuple or list of them likewise."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple | list):
        inner = ", ".join(_shown(item) for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return str(value)


def _group_keys(optimizer: Any) -> set[str]:
    """The settings an optimizer keeps in its param groups: its `defaults`, which torch's
    Optimizer.__init__ sets, else (a wrapper that never runs it and lends its base's groups, as
    michaelrzhang's Lookahead does) the keys its groups hold."""
    defaults = getattr(optimizer, "defaults", None)
    if isinstance(defaults, Mapping):
        return set(defaults)
    return {key for group in optimizer.param_groups for key in group if key != "params"}


def _halved_settings(ctx: CheckContext, group_keys: set[str]) -> dict[str, Any]:
    """Declared numeric hyperparameters kept in the groups, halved where that stays valid."""
    halved: dict[str, Any] = {}
    for name, param in ctx.target.entry.params.items():
        value = ctx.params.get(name, param.default)
        if native(ctx, name) not in group_keys or param.type not in ("float", "number", *_HALVED_EACH):
            continue
        candidate: Any
        if param.type in _HALVED_EACH:  # betas as a pair, Adan's three, a list
            candidate = [v * 0.5 for v in value]
        elif isinstance(value, bool) or not isinstance(value, int | float) or value == 0:
            continue
        elif isinstance(value, int) and param.type == "number":
            # An unannotated int default may be a count or a stride (Prodigy's slice_p slices a
            # tensor with it): halved as an int, and left out where that would reach 0.
            if value < 2:
                continue
            candidate = value // 2
        else:
            candidate = value * 0.5
        try:
            candidate = param.check(candidate)
        except (ValueError, TypeError):
            continue
        if _steps_alone(ctx, {name: candidate}):
            halved[name] = candidate
    return halved


def _steps_alone(ctx: CheckContext, settings: dict[str, Any]) -> bool:
    """Whether a single-group optimizer with `settings` builds and takes two steps. Undeclared
    constraints are the class's to state: torch's Rprop wants etas (<1, >1) in its constructor,
    adam-atan2's AdamAtan2ClipGrok asserts max_norm > 1 in its step. A value even one group alone
    cannot take is not one to compare groups with."""
    model, batch = _tiny_model(), _batch()
    try:
        optimizer = _build(ctx, model.parameters(), **settings)
        with same_draws(ctx, seed=3):
            for _ in range(2):
                closure = _closure(ctx, model, batch)
                closure()
                _step(ctx, optimizer.step, closure)
    except Exception:  # whatever the class raises for it: the value is not one it takes
        return False
    return True


@isolated
def check_closure(ctx: CheckContext) -> Outcome:
    """step(closure) as a training loop calls it: the step's own backward first, then a closure that
    recomputes the loss and gradients (with a graph when the class needs Hessian-vector products, and
    with gradients enabled even when step() runs it under no_grad, as AliG does); step() must call it
    and return its loss."""
    model, batch = _tiny_model(), _batch()
    optimizer = _build(ctx, model.parameters())
    fix = (
        "in step(closure=None): `loss = None; if closure is not None: with torch.enable_grad(): "
        "loss = closure()` and `return loss`"
    )
    if not _takes_an_argument(optimizer.step):
        return failed(
            "step() takes no closure: torch.optim.Optimizer declares step(closure=None), and loops that "
            "re-evaluate the loss (Lightning's, LBFGS-style ones) call step(closure), which raises "
            "TypeError here",
            where=method_location(ctx),
            fix=fix,
        )
    recompute = _closure(ctx, model, batch)
    calls: list[Tensor] = []
    grad_enabled: list[bool] = []
    called_without_grad: list[str] = []  # where the class's code called it so: the line to change

    def closure(backward: bool = True) -> Tensor:
        # Whether the class enabled grad for its closure: optlab's closure re-enables it itself, so
        # such classes still run, but a user's plain closure would not.
        grad_enabled.append(torch.is_grad_enabled())
        if not grad_enabled[-1] and not called_without_grad:
            called_without_grad.extend(_user_caller(ctx))
        loss = recompute(backward=backward)
        calls.append(loss)
        return loss

    recompute()  # the gradients a loop's backward leaves before step(closure) (SAM needs them)
    returned = optimizer.step(closure)
    if not calls:
        return failed("step(closure) never called the closure", where=method_location(ctx), fix=fix)
    # The loss of any of its calls: SAM returns the first (at the weights given), BSAM the one at
    # the point it perturbed to; either is the closure's loss.
    losses = [float(loss) for loss in calls]
    given = ", ".join(f"{loss:.4g}" for loss in losses)
    if returned is not None and not (isinstance(returned, Tensor | float) and float(returned) in losses):
        return failed(
            f"step(closure) returned {returned!r} instead of the closure's loss ({given} from its "
            f"{len(calls)} call(s))",
            where=method_location(ctx),
            fix=fix,
        )
    # A class that requires its closure sets its own contract (AliG: `lambda: float(loss)`, the loss
    # alone, which needs no grad); one taking torch's optional closure gets torch's, which runs backward.
    grad_enabled = grad_enabled if not ctx.needs.closure else []
    facts = _closure_facts(returned, given, len(calls), grad_enabled)
    if facts or returned is None:
        fix_text = _closure_fixes(returned, grad_enabled)
        where = called_without_grad[0] if called_without_grad and grad_enabled else method_location(ctx)
        return warned("; ".join(facts), where=where, fix=fix_text)
    which = losses.index(float(returned)) + 1
    return passed(
        f"step(closure) called the closure {len(calls)} time(s) and returned its loss (of call {which})",
        float(returned),
    )


def _user_caller(ctx: CheckContext) -> list[str]:
    """`file:line` of the innermost frame of the user's files on the stack (the line calling the
    closure), or nothing where none is."""
    frame: FrameType | None = sys._getframe(2)
    files = ctx.user_files()
    while frame is not None:
        if frame.f_code.co_filename in files:
            return [f"{frame.f_code.co_filename}:{frame.f_lineno}"]
        frame = frame.f_back
    return []


_ENABLE_GRAD_FIX = "call it as torch's optimizers do: `with torch.enable_grad(): loss = closure()`"
_RETURN_LOSS_FIX = "return the closure's loss from step(closure), as torch's optimizers do"


def _closure_facts(returned: Any, given: str, count: int, grad_enabled: Sequence[bool]) -> list[str]:
    """What a loop meets with this step(closure) though the class works in optlab's loops (whose
    closure enables grad itself, and which ignore what step() returns): warns, not faults."""
    facts = []
    if returned is None:
        facts.append(
            f"step(closure) returned None, not the closure's loss ({given} from its {count} call(s)): "
            "torch declares step() -> float | None and optlab's jobs ignore it, but torch's own "
            "optimizers return the loss, and a loop written `loss = opt.step(closure)` (as for LBFGS) "
            "gets None"
        )
    if not all(grad_enabled):
        facts.append(
            "step() called the closure with grad disabled (the step runs under torch.no_grad() and "
            "does not enable grad around the closure): torch's optimizers call it under "
            "torch.enable_grad(), and a plain closure (`loss = loss_fn(model(x), y); loss.backward()`) "
            'then raises "element 0 of tensors does not require grad"'
        )
    return facts


def _closure_fixes(returned: Any, grad_enabled: Sequence[bool]) -> str:
    fixes = [] if all(grad_enabled) else [_ENABLE_GRAD_FIX]
    return "; ".join(fixes + ([_RETURN_LOSS_FIX] if returned is None else []))


def _takes_an_argument(step: Callable[..., Any]) -> bool:
    """Whether step() can be called with one argument; True where its signature cannot be read."""
    try:
        inspect.signature(step).bind(None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


# --- mixed_precision ------------------------------------------------------------------------------


@isolated
def check_mixed_precision(ctx: CheckContext) -> Outcome:
    """bf16 autocast, then bf16 parameters, each stepped the way the entry declares (closure, graph),
    then on CUDA a float16 GradScaler step where GradScaler can drive the class's step.
    A warm-up that only builds state is allowed: a parameter must have moved by step WARMUP_STEPS."""
    if updates_nothing(ctx):
        return skipped(MOVES_NOTHING)
    batch = _batch()
    parts = []
    # bf16 autocast: the forward runs in bf16, parameters and gradients stay float32.
    model = _tiny_model()
    before = _snapshot(model.parameters())
    optimizer = _build(ctx, model.parameters())
    closure = _precision_closure(ctx, model, batch, autocast=True)
    for _ in range(WARMUP_STEPS):
        closure()
        _step(ctx, optimizer.step, closure)
        problem = _precision_problem(model, optimizer, before, torch.float32)
        if problem != _NO_CHANGE:
            break
    if problem:
        when = f"after {WARMUP_STEPS if problem == _NO_CHANGE else 'a'} step(s) under bf16 autocast"
        return _precision_failed(ctx, model, optimizer, when, problem)
    parts.append("a step under CPU bf16 autocast")
    # bfloat16 parameters: gradients and (for torch's own optimizers) state in bf16 too.
    model = _tiny_model().to(torch.bfloat16)
    before = _snapshot(model.parameters())
    try:
        optimizer = _build(ctx, model.parameters())
        closure = _precision_closure(ctx, model, batch, autocast=False)
        closure()
        _step(ctx, optimizer.step, closure)
    except Exception as exc:
        # A class written for float32 training may refuse low precision in words, as `sparse` accepts
        # a clear refusal of sparse gradients; a crash inside a torch op stays the class's fault.
        kernel = _NO_LOW_PRECISION_KERNEL.search(str(exc))
        if kernel and not clear_refusal(ctx, exc, _LOW_PRECISION_WORDS):
            return failed(
                f"{parts[0]} passed, but a step on bfloat16 parameters raised {ctx.describe_error(exc)}: "
                f"torch has no bfloat16 kernel of `{kernel.group(1)}`, so bfloat16 training stops there",
                where=user_line(ctx, exc),
                fix="compute that op in float32 (`x.float()`) and cast the result back (`.to(x.dtype)`)",
            )
        if not clear_refusal(ctx, exc, _LOW_PRECISION_WORDS):
            raise
        return passed(
            f"{parts[0]}; the class refuses bfloat16 parameters with a clear error "
            f"({ctx.describe_error(exc)}): it is written for higher precision, and says so"
        )
    problem = _precision_problem(model, optimizer, before, torch.bfloat16, require_change=False)
    if problem:
        return _precision_failed(ctx, model, optimizer, "after a step on bfloat16 parameters", problem)
    # A bf16 step may rightly round a small update away; not one that float32 makes many bf16 ulps long.
    if all(torch.equal(p.detach(), old) for p, old in zip(model.parameters(), before, strict=True)):
        unwritten = _moves_past_bfloat16(ctx, before, batch)
        if unwritten:
            return failed(
                "a step on bfloat16 parameters moved none of them, where the same step on float32 "
                f"parameters with the same values moves {unwritten} by more than {_BF16_ULPS} bfloat16 "
                "spacings at their values, which no rounding takes away: the update never reaches the "
                "bfloat16 parameters (a float32 copy such as `param.detach().float()` updated and never "
                "written back; on float32 parameters `.float()` returns the parameter itself, so float32 "
                "training hides it)",
                where=method_location(ctx),
                figure=float(unwritten),
                fix="write the updated copy back into the parameter (`param.copy_(param_fp32)`), or update "
                "the parameter in place",
            )
    parts.append("a step on bfloat16 parameters")
    parts.append(_grad_scaler_part(ctx))
    return passed("; ".join(parts) + ": finite, parameters keep their dtype")


# How many bfloat16 spacings (ulps at a value) a float32 step must move a value by before a bfloat16
# step that leaves it alone is no longer rounding: round to nearest moves it past half of one.
_BF16_ULPS = 4


def _moves_past_bfloat16(ctx: CheckContext, start: list[Tensor], batch: tuple[Tensor, Tensor]) -> int:
    """How many of the values `start` (bfloat16) the class's same step, on float32 parameters with
    those values, moves by more than _BF16_ULPS bfloat16 spacings; 0 where that step cannot be taken."""
    model = _tiny_model()
    with torch.no_grad():
        for param, value in zip(model.parameters(), start, strict=True):
            param.copy_(value.float())
    try:
        optimizer = _build(ctx, model.parameters())
        closure = _precision_closure(ctx, model, batch, autocast=False)
        closure()
        _step(ctx, optimizer.step, closure)
    except Exception:
        return 0
    moved = 0
    for param, value in zip(model.parameters(), start, strict=True):
        wide = value.float()
        exponent = torch.floor(torch.log2(wide.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
        spacing = torch.exp2(exponent - 7)  # bfloat16 keeps 7 explicit bits of mantissa
        moved += int(((param.detach() - wide).abs() > _BF16_ULPS * spacing).sum())
    return moved


def _precision_closure(
    ctx: CheckContext, model: nn.Module, batch: tuple[Tensor, Tensor], *, autocast: bool
) -> Callable[..., Tensor]:
    """Fresh gradients of the loss in reduced precision: the forward under bf16 autocast, or on a
    bf16 model (inputs cast to its dtype); with a graph when the class needs Hessian products."""
    inputs, targets = batch
    dtype = next(model.parameters()).dtype

    def closure(backward: bool = True) -> Tensor:
        for p in model.parameters() if backward else ():
            p.grad = None
        with torch.enable_grad():  # step(closure) may run it under torch.no_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                output = model(inputs.to(dtype))
            loss = nn.functional.mse_loss(output.float(), targets)
            return closure_result(loss, ctx.needs, backward=backward)

    return closure


# torch's words for an op with no kernel for a dtype: `"linalg_eigh_cpu" not implemented for 'BFloat16'`.
_NO_LOW_PRECISION_KERNEL = re.compile(r"""["']?([\w.]+)["']? not implemented for 'BFloat16'""")
# Words with which a refusal names the dtype or precision it refuses (torch's dtype names included).
_LOW_PRECISION_WORDS = (
    *("bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32"),
    *("dtype", "precision"),
)
_NO_CHANGE = "no parameter changed"
_NOT_FINITE = "not finite: "
_PRECISION_FIX = (
    "create state with torch.zeros_like(p) (same dtype and device) or keep an explicit float32 copy, and "
    "update parameters in place (p.add_) so their dtype never changes"
)


def _not_finite(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameters and optimizer state holding a NaN or an infinity, by name."""
    return _nonfinite((n, p.detach()) for n, p in model.named_parameters()) + _nonfinite(
        state_tensors(optimizer)
    )


def _precision_failed(
    ctx: CheckContext, model: nn.Module, optimizer: torch.optim.Optimizer, when: str, problem: str
) -> Outcome:
    """The fail for `problem` seen `when`; where it is values gone non-finite and plain float32
    steps made them so too (dense_step), the update's, not bfloat16's (whose fix had been given)."""
    unbounded = _not_finite(model, optimizer)
    if problem.startswith(_NOT_FINITE) and unbounded and update_made_non_finite(ctx):
        return non_finite_update(
            ctx, f"{when} values end non-finite", unbounded, regardless="whatever the precision"
        )
    return failed(f"{when}: {problem}", where=method_location(ctx), fix=_PRECISION_FIX)


def _precision_problem(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    before: list[Tensor],
    dtype: torch.dtype,
    *,
    require_change: bool = True,
) -> str:
    params = list(model.named_parameters())
    wrong = [f"{n} is {p.dtype}" for n, p in params if p.dtype != dtype]
    if wrong:
        return f"parameters changed dtype from {dtype}: {', '.join(wrong)}"
    bad = _not_finite(model, optimizer)
    if bad:
        return f"{_NOT_FINITE}{', '.join(bad)}"
    if require_change and all(
        torch.equal(p.detach(), old) for (_, p), old in zip(params, before, strict=True)
    ):
        return _NO_CHANGE
    return ""


def _grad_scaler_part(ctx: CheckContext) -> str:
    """A float16 GradScaler step on CUDA, where a job's float16 training would take it; skipped, saying
    why, where torch's GradScaler cannot drive the class's step at all: that limit is torch's, and a
    raise from it would be blamed on the class."""
    refused = _grad_scaler_refuses(ctx.needs)
    if refused:
        return f"GradScaler skipped ({refused})"
    if not torch.cuda.is_available():
        return "GradScaler skipped (needs CUDA)"
    return _grad_scaler_step(ctx, "cuda")


def _grad_scaler_refuses(needs: LoopNeeds) -> str | None:
    """Why torch's GradScaler cannot drive a step with `needs` by its own contract, else None.

    `scaler.step(optimizer)` calls `optimizer.step()` once, on the gradients it unscaled: it raises
    "Closure use is not currently supported if GradScaler is enabled" for a closure (SAM, LBFGS, and
    `backward_in_step`, which implies one), and it unscales only `.grad`, so Hessian-vector products a
    `create_graph` class takes from the scaled gradients (AdaHessian) come out multiplied by the loss
    scale, silently (torch's AMP notes unscale such second gradients by hand)."""
    if needs.closure:
        return "torch's GradScaler does not support step(closure)"
    if needs.create_graph:
        return (
            "torch's GradScaler unscales only .grad, and Hessian-vector products taken from the scaled "
            "gradients (backward(create_graph=True)) would stay multiplied by the loss scale"
        )
    return None


def _grad_scaler_step(ctx: CheckContext, device: str) -> str:
    """One float16 autocast step through GradScaler on `device` ('cuda' in the check; torch runs the
    same path on 'cpu', which is how the tests take it). A raise is the class's fault."""
    model = _tiny_model().to(device)
    inputs, targets = (t.to(device) for t in _batch())
    optimizer = _build(ctx, model.parameters())
    scaler = torch.amp.GradScaler(device)
    with torch.autocast(device, dtype=torch.float16):
        loss = nn.functional.mse_loss(model(inputs).float(), targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if _nonfinite((n, p.detach()) for n, p in model.named_parameters()):
        raise RuntimeError("parameters not finite after a GradScaler step")
    return f"a float16 GradScaler step on {'CUDA' if device == 'cuda' else device}"


CHECKS: Mapping[str, CheckFunction] = {
    "graph_mode": check_graph_mode,
    "param_groups": check_param_groups,
    "closure": check_closure,
    "mixed_precision": check_mixed_precision,
}


def _named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
