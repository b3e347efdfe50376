"""What the checks written once over the drivers share: numpy problems, a fresh optimizer over
new variables, differences, and where in the user's file a fault is.

Each check makes variables from numpy arrays, builds the optimizer over them through the
catalogue (so the user's hyperparameters apply), feeds numpy gradients and reads values
and state back as numpy; `jobs.frameworks` says how for each style.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import enum
import functools
import inspect
import math
import random
import re
import sys
import textwrap
import tokenize
import traceback
from collections.abc import Callable, Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed
from jobs.frameworks.base import Driver, equal_only_to_itself, known_fix, raising_frame
from optimizers.loop_needs import FRAMEWORK_PACKAGES, user_classes

CheckFunction = Callable[[CheckContext], Outcome]

# Small shapes with distinct sizes, so an optimizer's state can be told apart by its shape.
SHAPES: tuple[tuple[int, ...], ...] = ((4, 3), (3,), (5,))
# A first step may only build state (ADOPT's second moment, a rectification or a preconditioner
# warm-up): checks that need movement allow this many steps before they require it.
WARMUP_STEPS = 12
MOVES_NOTHING = f"not meaningful: {WARMUP_STEPS} steps change no variable at all (see dense_step)"


def isolated(check: CheckFunction) -> CheckFunction:
    """Every random source seeded for the check, the caller's given back afterwards."""

    @functools.wraps(check)
    def run(ctx: CheckContext) -> Outcome:
        with same_draws(ctx):
            return check(ctx)

    return run


@contextlib.contextmanager
def same_draws(ctx: CheckContext, seed: int = 0) -> Iterator[None]:
    """The framework's RNG, numpy's global one and Python's seeded with `seed`, and given back
    afterwards. Optimizers that draw by design (Gravity's random velocity, Kron's
    `np.random.random()` preconditioner updates, Hutchinson probes) then draw the same numbers in
    every run a check compares, so their randomness is not mistaken for a fault."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with ctx.driver.isolated(seed):
        np.random.seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def draws_randomly(ctx: CheckContext) -> bool:
    """Whether the class's steps draw random numbers (by design: random state, random masks,
    Hutchinson probes); comparisons that cannot give both sides the same draws are then
    inconclusive. See `run_to_run`."""
    return run_to_run(ctx) == "draws"


def varies_without_drawing(ctx: CheckContext) -> bool:
    """Whether two runs on the same gradients step differently although the class draws no random
    numbers (torch): an order that changes from run to run (a set of parameters, a dict keyed by id)
    changes float rounding. See `run_to_run`."""
    return run_to_run(ctx) == "varies"


# How two fresh runs of the class on the same gradients compare: alike (or apart only through state
# every instance shares, a fault the callers' comparisons must still see), apart because the steps
# draw random numbers, or apart although nothing is drawn.
RunToRun = Literal["alike", "draws", "varies"]
# The seeds of the runs compared, until two differ: an order taken from ids is alike in two runs
# about one time in three, so a few more runs show it (a drawing class differs at the second).
RUN_SEEDS = (1, 2, 3, 4, 5)

# Why run-to-run differences without a drawn number are not called random.
VARIES_WITHOUT_DRAWING = (
    "two runs on the same gradients step differently although the class draws no random numbers (no "
    "random generator moved, none among its attributes or state, no random op ran): an order that "
    "changes from run to run (iterating a set of parameters, a dict keyed by id() or hash) sums the "
    "same numbers in another order, so float rounding differs"
)
VARIES_WITHOUT_DRAWING_FIX = (
    "iterate group['params'] (and the groups) in their given order, never a set() or a dict keyed by "
    "id(); keep a reduction's order fixed"
)


def run_to_run(ctx: CheckContext) -> RunToRun:
    """Up to five fresh runs from other seeds on the same gradients. Called random only with evidence: a step
    moved a global RNG (the framework's, numpy's, Python's), or, where the runs differ, a random
    generator sits in the class's attributes, state or module, or a random op ran in a step (torch;
    Keras's differences are taken for draws as before). Cached."""
    known = ctx.notes.get("run_to_run")
    if known in ("alike", "draws", "varies"):
        return known
    driver = ctx.driver
    runs, moved_a_generator, built = [], False, []
    # Keras's differences are taken for draws whatever shows them: two runs, as before, are enough.
    for seed in RUN_SEEDS if ctx.target.style == "torch" else RUN_SEEDS[:2]:
        with same_draws(ctx, seed):
            optimizer, variables = fresh(ctx)
            # Kept alive, so each run's tensors get new ids: an order taken from ids (a set of
            # parameters) then differs between runs as it does between processes.
            built.append((optimizer, variables))
            before = _global_random_states(ctx)
            for step in range(WARMUP_STEPS):
                driver.step(optimizer, variables, arrays(SHAPES, seed=60 + step), ctx.needs)
            moved_a_generator = moved_a_generator or _global_random_states(ctx) != before
            runs.append(driver.values(variables) + [value for _, value in driver.state(optimizer)])
        if moved_a_generator or max_diff(runs[0], runs[-1]) > 0:
            break
    answer: RunToRun
    if moved_a_generator:
        answer = "draws"
    # Runs that differ because an earlier one changed what every instance shares (a module-level
    # step counter, a default list a step writes) are not random: that is a fault, which the callers'
    # comparisons must still see.
    elif same_arrays(runs[0], runs[-1]) or state_shared_by_instances(ctx) or changed_defaults(ctx):
        answer = "alike"
    elif (
        ctx.target.style != "torch"
        or not _rounding_apart(runs[0], runs[-1])
        or _holds_a_generator(ctx, built[-1][0])
        or _random_op_ran(ctx)
    ):
        answer = "draws"
    else:
        answer = "varies"
    ctx.notes["run_to_run"] = answer
    return answer


# How far apart (relative to the values) runs whose sums only went in another order can end: float32
# rounding over WARMUP_STEPS steps. Anything further is taken for draws the search did not find (an
# unseeded numpy generator held by a helper object: it had been called an order fault).
ORDER_ROUNDING = 1e-5


def same_arrays(first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> bool:
    """Bitwise the same arrays, NaN where both hold NaN (an update that makes NaN makes it alike)."""
    return len(first) == len(second) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        for a, b in zip(first, second, strict=True)
    )


def _rounding_apart(first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> bool:
    scale = max((float(np.max(np.abs(a))) for a in first if a.size), default=1.0)
    return max_diff(first, second) <= ORDER_ROUNDING * max(1.0, scale)


# Random number generators by their type's module and name: their state is what they draw next.
RANDOM_GENERATORS = {
    ("torch", "Generator"),
    ("random", "Random"),
    ("numpy", "Generator"),
    ("numpy", "RandomState"),
    ("keras", "SeedGenerator"),
}


def generator_kind(value: Any) -> tuple[str, str]:
    return type(value).__module__.split(".")[0], type(value).__name__  # torch._C.Generator: torch's


def _holds_a_generator(ctx: CheckContext, optimizer: Any) -> bool:
    """Whether a random number generator sits in the optimizer's attributes or state (three levels
    down: `self.state[p]["gen"]`), or at the top of the user's classes or their modules."""
    holders: list[Any] = [optimizer]
    for cls in user_classes(ctx.target.entry.cls):
        holders += [cls, inspect.getmodule(cls)]
    return any(
        _generator_in(value, depth=3)
        for holder in holders
        if holder is not None
        for value in list(vars(holder).values())
    )


def _generator_in(value: Any, depth: int) -> bool:
    if generator_kind(value) in RANDOM_GENERATORS:
        return True
    if depth == 0 or isinstance(value, type) or inspect.ismodule(value):
        return False
    items = (
        list(value.values())
        if isinstance(value, Mapping)
        else list(value)
        if isinstance(value, list | tuple)
        else []
    )
    return any(_generator_in(item, depth - 1) for item in items[:64])


def _random_op_ran(ctx: CheckContext) -> bool:
    """Whether a random op (one torch tags nondeterministic_seeded: randn, normal_, bernoulli_,
    randperm ...) ran in the class's steps, whatever generator it drew from (a module-level one, one
    made in the step). A step that cannot run under the watch is taken to draw, as before."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode  # torch only: a random op's tag

    seen: list[str] = []

    class RandomOps(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if torch.Tag.nondeterministic_seeded in func.tags:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with same_draws(ctx, 1):
        optimizer, variables = fresh(ctx)
        try:
            with RandomOps():
                for step in range(3):
                    ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=60 + step), ctx.needs)
        except Exception:  # not observable so: not shown to draw nothing
            return True
    return bool(seen)


def state_shared_by_instances(ctx: CheckContext) -> list[str]:
    """Arrays the class's own modules hold at their top level, or on the class itself, that its steps
    change: one value every instance (and every replica in one process) shares, and no save holds.
    Cached."""
    known = ctx.notes.get("state_shared_by_instances")
    if isinstance(known, list):
        return known
    with same_draws(ctx, 1):
        before = _shared_arrays(ctx)
        optimizer, variables = fresh(ctx)
        for step in range(WARMUP_STEPS):
            ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=60 + step), ctx.needs)
        after = _shared_arrays(ctx)
    changed = sorted(name for name, value in after.items() if before.get(name) != value)
    ctx.notes["state_shared_by_instances"] = changed
    return changed


@dataclass(frozen=True)
class Aliasing:
    """State that shares storage with a parameter, first seen after `seen_after` steps, that changes
    the update: a twin with a copy of its own steps differently."""

    names: list[str]
    seen_after: int

    def said(self) -> str:
        """The state named, and why sharing a parameter's storage is a fault here."""
        return (
            f"{listed(self.names, 3)} {'shares' if len(self.names) == 1 else 'share'} storage with a model "
            f"parameter (from step {self.seen_after}), and that changes the update: with a copy of its own "
            "the steps after differ, since each step of the parameter moves the state too (a kept "
            "`p.detach()` follows the weights it should remember; after `p.data = saved` the weights and the "
            "saved copy are one tensor)"
        )


ALIASING_FIX = (
    "keep a copy of its own: `p.detach().clone()` where state is made from a parameter, and put saved "
    "weights back with `p.copy_(saved)`, never `p.data = saved`"
)
# A line that makes state one tensor with a parameter: `state["init"] = p.detach()` (no clone),
# `p.data = state["slow"]`.
_ALIASING_LINE = re.compile(r"\]\s*=\s*[\w.]+\.(?:detach\(\)|data)\s*$|\b\w+\.data\s*=[^=]")


def state_aliasing(ctx: CheckContext) -> Aliasing | None:
    """State sharing a parameter's storage that changes the update, looked for after each of
    WARMUP_STEPS steps (Lookahead's `p.data = slow` comes only every k steps); None where there is
    none, or where it changes nothing (SAM's saved weights, rewritten before they are read). Cached."""
    if "state_aliasing" in ctx.notes:
        found: Aliasing | None = ctx.notes["state_aliasing"]
        return found
    found = None
    overrides = ctx.stateful_overrides()
    with contextlib.suppress(Exception), same_draws(ctx, seed=7):  # a step that raises: the others say
        optimizer, variables = fresh(ctx, **overrides)
        for step in range(WARMUP_STEPS):
            ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=90 + step), ctx.needs)
            names = ctx.driver.state_sharing_variables(optimizer, variables)
            if names:
                found = Aliasing(names, step + 1) if _aliasing_acts(ctx, overrides, step + 1) else None
                break
    ctx.notes["state_aliasing"] = found
    return found


def _aliasing_acts(ctx: CheckContext, overrides: Mapping[str, Any], seen_after: int) -> bool:
    """Two equal optimizers `seen_after` steps in, one with each state tensor that shares a parameter's
    storage given a copy of its own: whether WARMUP_STEPS more steps part them (several, since a
    decay toward kept weights equal to the parameter's at that moment shows only later)."""
    runs = []
    for unshare in (False, True):
        with same_draws(ctx, seed=7):
            optimizer, variables = fresh(ctx, **overrides)
            for step in range(seen_after):
                ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=90 + step), ctx.needs)
            if unshare:
                ctx.driver.unshare_state(optimizer, variables)
            values: list[np.ndarray] = []
            for step in range(seen_after, seen_after + WARMUP_STEPS):
                ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=90 + step), ctx.needs)
                values += ctx.driver.values(variables)
            runs.append(values)
    return not same_arrays(runs[0], runs[1])


def aliasing_location(ctx: CheckContext) -> str:
    """`file:line` of the first line of the class's methods that makes state one tensor with a
    parameter; the update method's where none reads so."""
    for found in user_method_lines(ctx):
        if _ALIASING_LINE.search(found.code):
            return found.where
    return method_location(ctx)


ZERO_GRAD_FIX = (
    "clear every gradient in zero_grad(): `p.grad = None` where set_to_none, else `p.grad.zero_()` (the "
    "call, with its parentheses), or call super().zero_grad(set_to_none)"
)


def zero_grad_keeps(ctx: CheckContext) -> list[str]:
    """The calls of the class's own zero_grad() that leave gradients nonzero after a step, as a loop
    calls it (a `p.grad.zero_` without its call): every loop's gradients then pile up across steps.
    Cached; empty where there is no override, or where building, the step or the call raises (the
    checks that build and step say why)."""
    known = ctx.notes.get("zero_grad_keeps")
    if isinstance(known, list):
        return known
    kept: list[str] = []
    with contextlib.suppress(Exception):
        optimizer, variables = fresh(ctx, **ctx.stateful_overrides())
        kept = ctx.driver.gradients_kept_by_zero_grad(optimizer, variables, ctx.needs)
    ctx.notes["zero_grad_keeps"] = kept
    return kept


def zero_grad_said(kept: Sequence[str]) -> str:
    """Why a loop's steps part from what they should be where zero_grad() keeps the gradients."""
    return (
        f"the class's own {' and '.join(kept)} left gradients nonzero, so a loop's gradients pile up "
        "across steps (each step gets the sum of every gradient so far)"
    )


def _shared_arrays(ctx: CheckContext) -> dict[str, bytes]:
    """The bytes of every tensor or variable (anything with a shape and a dtype that numpy reads)
    the user's classes, and the modules they are defined in, hold as attributes."""
    holders: dict[str, Any] = {}
    for cls in user_classes(ctx.target.entry.cls):
        module = inspect.getmodule(cls)
        if module is not None:  # named by its file: a plugin's module has a name made up for it
            holders[Path(module.__file__).name if module.__file__ else module.__name__] = module
        holders[cls.__qualname__] = cls
    found: dict[str, bytes] = {}
    for prefix, holder in holders.items():
        for name, value in list(vars(holder).items()):
            if not name.startswith("__"):
                found.update(_arrays_in(f"{prefix}.{name}", value, depth=2))
    return found


def changed_defaults(ctx: CheckContext) -> list[str]:
    """The mutable defaults of the user's classes' `__init__` (a list, dict or set written as a literal)
    that an optimizer built with them holds in its param groups as that very object, and that its steps
    change in place (`betas[1] = ...` on a group's list), so every optimizer built later without that
    argument starts from the changed value. Each is put back to the value written first (earlier checks'
    steps may have changed it already), and what the steps do is judged against its value once built: a
    class completing it once in __init__, alike every time, changes nothing later. Cached; only where
    the driver's optimizers keep their hyperparameters in param groups (torch)."""
    known = ctx.notes.get("changed_defaults")
    if isinstance(known, list):
        return known
    changed: list[str] = []
    ctx.notes["changed_defaults"] = changed
    if not ctx.driver.capabilities.param_groups:
        return changed
    defaults = _mutable_defaults(ctx)
    if not defaults:  # most classes: nothing to build and step for
        return changed
    for _, _, written, now in defaults:
        _put_back(now, written)
    built: dict[int, Any] = {}
    with contextlib.suppress(Exception), same_draws(ctx, 1):  # a step that raises: the others say
        optimizer, variables = fresh(ctx)
        held = {id(value) for group in optimizer.param_groups for value in group.values()}
        built = {id(now): copy.deepcopy(now) for _, _, _, now in defaults if id(now) in held}
        for step in range(3):
            ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=60 + step), ctx.needs)
    for owner, name, written, now in defaults:
        if id(now) in built and not _equal(now, built[id(now)]):
            once = "" if _equal(built[id(now)], written) else f", {built[id(now)]!r} once built"
            changed.append(f"`{name}` (written {written!r}{once}, {now!r} after 3 steps) of {owner}.__init__")
    return changed


def _mutable_defaults(ctx: CheckContext) -> list[tuple[str, str, Any, Any]]:
    """(class, argument, value written, the default object itself) for each default of the user's
    classes' `__init__` written as a list, dict or set literal and still of that type."""
    found = []
    for cls in user_classes(ctx.target.entry.cls):
        init = vars(cls).get("__init__")
        if not inspect.isfunction(init):
            continue
        current = {name: p.default for name, p in inspect.signature(init).parameters.items()}
        for name, written in _literal_defaults(init).items():
            now = current.get(name)
            if isinstance(written, list | dict | set) and isinstance(now, type(written)):
                found.append((cls.__qualname__, name, written, now))
    return found


def _put_back(now: list[Any] | dict[Any, Any] | set[Any], written: Any) -> None:
    """`now`, the default object itself, holding the value written again, in place."""
    with contextlib.suppress(Exception):  # a subclass of list that refuses it: judged as it is
        if isinstance(now, list):
            now[:] = copy.deepcopy(written)
        else:
            now.clear()
            now.update(copy.deepcopy(written))


def _equal(a: Any, b: Any) -> bool:
    """Whether two values compare equal; so where comparing raises (tensors put in a list)."""
    try:
        return bool(a == b)
    except Exception:
        return True


def _literal_defaults(function: Callable[..., Any]) -> dict[str, Any]:
    """The defaults of `function` as its source writes them, where a literal (`[0.9, 0.999]`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        return {}
    arguments = definition.args
    positional = [*arguments.posonlyargs, *arguments.args]
    pairs = [
        *zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True),
        *((a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d is not None),
    ]
    found = {}
    for argument, default in pairs:
        with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            found[argument.arg] = ast.literal_eval(default)
    return found


def changed_defaults_said(names: Sequence[str]) -> str:
    return (
        f"the class changed the default {listed(names, 2)} in place (the param groups hold that very "
        "object, and a step writes it): every optimizer built later without that argument starts from the "
        "changed value, not the one written"
    )


CHANGED_DEFAULT_FIX = (
    "make the default immutable (a tuple: `betas=(0.9, 0.999)`), or copy it in __init__ "
    "(`betas = list(betas)`) before it goes into the param groups"
)


def _arrays_in(name: str, value: Any, depth: int) -> dict[str, bytes]:
    """The bytes of `value` where it is an array (a shape and a dtype numpy reads), or of those a
    dict, list or tuple of it holds (a registry of shared variables, `_SHARED["t"]`), by name."""
    if isinstance(value, type) or inspect.ismodule(value):
        return {}
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            return {name: np.array(value).tobytes()}
        except Exception:  # not a host array (a GPU tensor numpy cannot read): not compared
            return {}
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    found: dict[str, bytes] = {}
    for key, item in list(items)[:64] if depth else ():
        found.update(_arrays_in(f"{name}[{key!r}]", item, depth - 1))
    return found


def _global_random_states(ctx: CheckContext) -> tuple[Any, ...]:
    _, keys, position, *_ = np.random.get_state()
    return ctx.driver.random_state(), bytes(np.asarray(keys).tobytes()), position, random.getstate()


def inconclusive_random(what: str) -> str:
    """The skip text of a comparison a class that draws random numbers makes meaningless."""
    return (
        f"inconclusive: the class draws random numbers in its steps (by design: random state, masks or "
        f"probes), and {what} cannot give both sides the same draws"
    )


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
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, as before, without a RuntimeWarning printed
        diffs = [
            float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            for x, y in zip(a, b, strict=True)
            if x.size
        ]
    return max(diffs, default=0.0)


def non_finite(value: np.ndarray) -> bool:
    """Whether a floating-point array holds a NaN or an infinity (integers never do)."""
    return value.dtype.kind in "fc" and not bool(np.all(np.isfinite(value)))


Key = TypeVar("Key")


def made_non_finite(start: Mapping[Key, np.ndarray], *sides: Mapping[Key, np.ndarray]) -> list[Key]:
    """The arrays (by key) that were finite at `start`, before any step (weights; state read when
    built), and end non-finite, in the same shape, on every one of `sides`: the update itself makes
    non-finite values, whatever a check changes between its sides (NaN against NaN is no difference
    of its own). The one judgement graph_mode, sparse, mixed_precision and distributed make. State
    non-finite from the start, as a "lowest loss seen" kept at +inf until a loss comes, is no sign
    of it: the checks compare it as any array, equal where both sides hold the same NaN or inf (it
    had failed as "the update itself makes non-finite values")."""
    return [
        key
        for key, value in start.items()
        if value.dtype.kind in "fc"
        and not non_finite(value)
        and all(key in side and side[key].shape == value.shape and non_finite(side[key]) for side in sides)
    ]


def non_finite_update(ctx: CheckContext, observed: str, names: Sequence[str], *, regardless: str) -> Outcome:
    """The fail where `made_non_finite` names arrays (`names`, said after `observed`): no cause of the
    check's own (a frozen Python counter, float16 maths, the sparse path, the replicas) is blamed,
    and dense_step's fix is given. `regardless` says what the check changed that is not the cause."""
    shown = listed(names, 3)
    return failed(
        f"{observed} ({shown}): the update itself makes non-finite values, {regardless} (dense_step names "
        "the first), so nothing here is compared",
        where=method_location(ctx),
        fix=ctx.driver.advice.finite_state,
        figure=float(len(names)),
    )


def listed(names: Sequence[str], most: int) -> str:
    """The first `most` names, comma-separated, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + (",)" if len(shape) == 1 else ")")


def method_location(ctx: CheckContext, method: str | None = None) -> str:
    """`file:line` of the class's update method (where the fix goes) when the user's file
    defines it, else the class statement."""
    # Unwrapped: torch wraps `step` in profiling hooks and no_grad decorators defined elsewhere.
    function = getattr(ctx.target.cls, method or ctx.driver.advice.update_method, None)
    try:
        function = inspect.unwrap(function)  # type: ignore[arg-type]
        _, first = inspect.getsourcelines(function)
        source = inspect.getsourcefile(function)
    except (OSError, TypeError):
        return ctx.where()
    if source is None or source not in ctx.user_files():
        return ctx.where()
    return f"{source}:{first}"


_CALLED_WRONGLY = re.compile(
    r"^(\w+)\.(\w+)\(\) (?:takes (?:from )?\d+ (?:to \d+ )?positional|missing \d+ required|"
    r"got an unexpected keyword)"
)


@dataclass(frozen=True)
class WrongSignature:
    """A method of the class the framework called with other arguments than it takes."""

    method: str
    expected: str  # the framework base's signature of it, as `name(self, ...)`; "" where unknown
    where: str  # `file:line` of the class's definition of it

    def failed(self, said: str) -> Outcome:
        """The fail of a check that met it; `said`: the error, described."""
        takes = f": {self.expected}, as the framework's base declares it" if self.expected else ""
        return failed(
            f"the framework called the class's {self.method} with other arguments than it takes: {said}",
            where=self.where,
            fix=f"give {self.method} the signature the framework calls it with{takes}",
        )


def wrong_signature(ctx: CheckContext, error: BaseException) -> WrongSignature | None:
    """Where `error` is a TypeError of the framework calling a method the class defines with other
    arguments than it declares (legacy `_resource_apply_sparse(self, grad, var)`, which tf.keras calls
    with `indices` too): the class's method never ran, so no line of it is in the traceback."""
    if not isinstance(error, TypeError):
        return None
    called = _CALLED_WRONGLY.match(str(error))
    if called is None:
        return None
    owner, method = called.groups()
    ours = [k for k in user_classes(ctx.target.cls) if k.__name__ == owner and method in vars(k)]
    caller = raising_frame(error)  # the call's own line: the framework's, or it is the class's bug
    if not ours or method == "__init__" or caller is None or caller.filename in ctx.user_files():
        return None
    theirs = next(
        (k for k in ctx.target.cls.__mro__ if k not in user_classes(ctx.target.cls) and method in vars(k)),
        None,
    )
    expected = ""
    if theirs is not None:
        with contextlib.suppress(TypeError, ValueError):
            expected = f"{method}{inspect.signature(vars(theirs)[method])}"
    return WrongSignature(method, expected, method_location(ctx, method))


def reached_user_code(ctx: CheckContext, error: BaseException) -> bool:
    """Whether code of the class (its file, or that of any of its bases outside the frameworks, the
    wrapped base's too) was on the way to `error` or to an error it was raised from: in a traceback,
    or quoted in a message (a compiled function's error names the user's lines). False: the
    framework's own code crashed with the class configuring it (an option of the framework's base
    the class sets), or optlab's own code did."""
    files = ctx.user_files()
    for link in exception_chain(error):
        if user_line(ctx, link) != ctx.target.class_location():
            return True
        if any(frame.filename in files for frame in traceback.extract_tb(link.__traceback__)):
            return True
    return False


def exception_chain(error: BaseException) -> list[BaseException]:
    """`error` and those it was raised from or while handling (`raise ... from`), outermost first:
    a driver that re-raises a user's error in its own words keeps the user's frames there."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def user_line(ctx: CheckContext, error: BaseException) -> str:
    """`file:line` in the user's file: from the traceback, else from a message that quotes the
    user's code (`File "x.py", line 12`: autograph, dynamo), else the class statement."""
    if ctx.user_frame(error) is not None:
        return ctx.where(error)
    source = ctx.target.source_file()
    if source is not None:
        quoted = re.findall(rf'File "{re.escape(source)}", line (\d+)', str(error))
        if quoted:
            return f"{source}:{quoted[-1]}"
    return ctx.target.class_location()


def raised_in(
    error: BaseException, files: Container[str | None], *, by: Literal["raise", "assert"] | None = None
) -> bool:
    """Whether `error` was raised in one of `files`; with `by`, by that statement there: `raise` (a
    deliberate refusal, not a crash such as calling a closure that is None), or `assert`."""
    frame = raising_frame(error)
    if frame is None or frame.filename not in files:
        return False
    return by is None or (frame.line or "").lstrip().startswith(by)


@dataclass(frozen=True)
class RefusalFiles:
    """Files whose `raise` is a deliberate refusal: the class's own, the framework's optimizers', and
    those of the base optimizer a wrapper wraps; and the user's helpers beside their class (`homes`:
    another module of its package, a file beside its plugin file: `check_shape(p)` raising "only 2-D
    parameters" for it had read as a crash), never an installed package's, Python's or optlab's."""

    files: frozenset[str]
    homes: tuple[CodeHome, ...]

    def __contains__(self, filename: object) -> bool:
        if not isinstance(filename, str):
            return False
        return filename in self.files or any(home.holds(Path(filename)) for home in self.homes)


# Code under these is never the user's, wherever their class lives (a plugin in a folder that also
# holds a virtual environment, a pyenv install or an optlab checkout).
_NOT_THE_USERS = tuple(
    Path(p).resolve() for p in {sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[2])}
)


@dataclass(frozen=True)
class CodeHome:
    """Where the user's code beside a class lies: its package's folder, at any depth, or the folder
    of a lone file (a plugin file), whose other files only, not its subfolders."""

    folder: Path
    recursive: bool

    def holds(self, file: Path) -> bool:
        if file.parent != self.folder and not (self.recursive and file.is_relative_to(self.folder)):
            return False
        if {"site-packages", "dist-packages"} & set(file.relative_to(self.folder).parts):
            return False
        # A root the folder itself lies under (a package installed in the environment) is its own.
        outside = [root for root in _NOT_THE_USERS if not self.folder.is_relative_to(root)]
        return not any(file.is_relative_to(root) for root in outside)


def code_home(cls: type) -> CodeHome | None:
    """The user's code that holds `cls` (CodeHome); None for a framework's own class."""
    top = (cls.__module__ or "").split(".")[0]
    if not user_classes(cls) or top in FRAMEWORK_PACKAGES or top in ("jobs", "numpy"):
        return None
    package_path = list(getattr(sys.modules.get(top), "__path__", None) or [])
    if package_path:
        return CodeHome(Path(package_path[0]), recursive=True)
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:
        return None
    return CodeHome(Path(file).parent, recursive=False) if file else None


def _classes(ctx: CheckContext) -> list[type]:
    return [ctx.target.cls] + ([ctx.base.entry.cls] if ctx.base is not None else [])


def _homes(ctx: CheckContext) -> tuple[CodeHome, ...]:
    return tuple(home for home in map(code_home, _classes(ctx)) if home is not None)


def refusal_files(ctx: CheckContext) -> RefusalFiles:
    files = set().union(*(ctx.driver.refusal_files(cls) for cls in _classes(ctx)))
    return RefusalFiles(frozenset(files), _homes(ctx))


def own_code(ctx: CheckContext) -> RefusalFiles:
    """The user's code whose `raise` or `assert` is the class's own refusal: its files and its bases'
    (ctx.user_files), and their helpers beside them (RefusalFiles)."""
    return RefusalFiles(frozenset(ctx.user_files()), _homes(ctx))


def left_out_of_save(ctx: CheckContext, overrides: Mapping[str, Any]) -> list[str]:
    """The state an optimizer stepped three times holds and its own save leaves out (torch: an
    overridden state_dict() that drops a key of self.state[p]), named. Asked only to explain a
    failure: an optimizer that cannot be stepped here explains nothing, and leaves that failure as
    it was."""
    return save_faults(ctx, overrides)[1]


def save_faults(ctx: CheckContext, overrides: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """What an optimizer stepped three times loses to its own save: the live state the save call
    removed or changed (Driver.state_changed_by_save, put back), and the state it leaves out
    (left_out_of_save). Asked only to explain a failure, as that is."""
    if type(ctx.driver).state_left_out_of_save is Driver.state_left_out_of_save:
        return [], []  # a style whose save sees everything the optimizer holds
    try:
        optimizer, variables = fresh(ctx, **overrides)
        for seed in (40, 41, 42):
            ctx.driver.step(optimizer, variables, arrays(SHAPES, seed), ctx.needs)
        changed = ctx.driver.state_changed_by_save(optimizer)  # first: it puts back what the save took
        return changed, ctx.driver.state_left_out_of_save(optimizer)
    except Exception:
        return [], []


def missing_key_left_out(observed: str, left: Sequence[str]) -> bool:
    """Whether a failure is a KeyError for one of the keys `left` names (`state[param 0]['m']`)."""
    return any(f"KeyError: {entry.rsplit('[', 1)[1].rstrip(']')}" in observed for entry in left)


def left_out_said(left: Sequence[str]) -> str:
    return f"state_dict() leaves out {', '.join(left[:4])}, which self.state holds"


LEFT_OUT_FIX = (
    "save every key of self.state[p] in state_dict() (or do not override it): a reloaded optimizer "
    "otherwise rebuilds what the save left out from scratch, or fails for want of it"
)


def clear_refusal(ctx: CheckContext, error: BaseException, about: Collection[str]) -> bool:
    """A deliberate `raise` in the class's code (or the framework's optimizers', or a wrapped base's)
    whose message names what it refuses (one of the words `about`): a documented limit, not a crash.
    An error from inside a framework op ("expected scalar type Float but found BFloat16") is raised by
    no `raise` in those files, so it stays a fault."""
    message = str(error).lower()
    return raised_in(error, refusal_files(ctx), by="raise") and any(word in message for word in about)


# The words of a refusal of row-sparse gradients: "does not support sparse gradients", "IndexedSlices
# not supported", "dense gradients only" (a refusal worded by what the class takes had been a crash).
SPARSE_WORDS = (
    "sparse",
    "indexedslices",
    "dense gradients only",
    "dense gradient only",
    "only dense",
    "dense only",
    "supports dense",
    "support dense",
)
# The legacy style's methods that only row-sparse gradients reach: a `raise` of the class's own there
# refuses them, whatever its words ("SignumLegacy: not implemented").
SPARSE_METHODS = ("_resource_apply_sparse", "_resource_apply_sparse_duplicate_indices")


def refuses_dense(ctx: CheckContext, error: BaseException) -> bool:
    """A deliberate `raise` about the gradient's layout (dense or sparse) in the class's code (or the
    framework's) for a dense gradient: the class takes only sparse gradients by design (torch's
    SparseAdam: "does not support dense gradients")."""
    return clear_refusal(ctx, error, ("dense", "sparse"))


RAISED_FIX = "the optimizer raised during this check; the error above and its line say why"


def fix_for_raised(error: BaseException) -> str:
    """The fix for an error the class raised: the known cause where its message names one."""
    return known_fix(error) or RAISED_FIX


def refused_rate(ctx: CheckContext) -> Exception | None:
    """The error with which the class, given these hyperparameters, refuses any learning rate, or None.

    Its lr defaults to None, none was given, and building with one raised a ValueError or TypeError
    from a `raise` in its own code: in this configuration it sets its own step size (transformers'
    Adafactor with relative_step=True: "Cannot combine manual `lr` and `relative_step=True`
    options"). Checks that build with a rate of their own leave it out then. Cached."""
    if "refused_rate" not in ctx.notes:
        ctx.notes["refused_rate"] = _refused_rate(ctx)
    refused: Exception | None = ctx.notes["refused_rate"]
    return refused


def _refused_rate(ctx: CheckContext) -> Exception | None:
    declared = ctx.target.entry.params.get("lr")
    if declared is None or declared.default is not None or ctx.params.get("lr") is not None:
        return None
    try:
        fresh(ctx, lr=ctx.lr)
    except (ValueError, TypeError) as exc:
        return exc if raised_in(exc, refusal_files(ctx), by="raise") else None
    return None


def takes_a_rate(ctx: CheckContext) -> bool:
    """Whether a check may build the optimizer with a learning rate of its own choosing."""
    return ctx.has_lr and refused_rate(ctx) is None


def native(ctx: CheckContext, name: str) -> str:
    """The class's own argument name for catalogue name `name` (`lr` may be `learning_rate`)."""
    return ctx.target.entry.lr_arg if name == "lr" else name


def same_value(actual: Any, expected: Any) -> bool:
    """Equal as hyperparameters: one-element tensors and numpy scalars as numbers, floats to
    float32 precision (legacy Keras stores them as float32 variables), lists as tuples."""
    if hasattr(actual, "item") and getattr(actual, "size", 1) in (1, None) and np.ndim(actual) == 0:
        actual = actual.item()
    if isinstance(actual, enum.Enum) and isinstance(expected, str):  # a `choice` of an enum's names
        return actual.name == expected
    if isinstance(actual, Mapping) and isinstance(expected, Mapping):
        return actual.keys() == expected.keys() and all(same_value(actual[k], expected[k]) for k in actual)
    if isinstance(expected, tuple | list) and isinstance(actual, tuple | list):
        return len(actual) == len(expected) and all(
            same_value(a, e) for a, e in zip(actual, expected, strict=True)
        )
    if _is_array(actual) and _is_array(expected):
        # DoG keeps per-group lists of tensors (its step sizes, distances) in its param groups.
        return _same_array(actual, expected)
    numbers = (int, float)
    if isinstance(expected, float) and isinstance(actual, numbers) and not isinstance(actual, bool):
        return math.isclose(actual, expected, rel_tol=1e-6) or (math.isnan(actual) and math.isnan(expected))
    if type(actual) is type(expected) and equal_only_to_itself(actual):
        # A round trip copies a plain object (Kron's ProbScheduler in its param groups): a copy that
        # holds the same, not the same object, is what it should give back.
        try:
            return same_value(_what_it_holds(actual), _what_it_holds(expected))
        except Exception:  # objects that hold each other, or values == cannot compare: only identity says
            return actual is expected
    return bool(actual == expected)


def _is_array(value: Any) -> bool:
    """A tensor or array of any size (`==` on one gives an array, which no `bool` can be taken of)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


def _same_array(actual: Any, expected: Any) -> bool:
    """Same shape and values (NaN equal to NaN), whatever the framework; bfloat16 compared as float64."""
    if tuple(actual.shape) != tuple(expected.shape):
        return False
    return bool(np.array_equal(_as_numpy(actual), _as_numpy(expected), equal_nan=True))


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch: numpy has no bfloat16, and a tensor may sit on a GPU
        return np.asarray(value.detach().cpu().double().numpy())
    return np.asarray(value, dtype=np.float64)


def _what_it_holds(value: Any) -> Any:
    """What pickle and deepcopy rebuild `value` from (its class's own __reduce__ where it has one,
    else its attributes), or the object itself where it cannot be pickled."""
    try:
        return value.__reduce_ex__(4)
    except Exception:
        return value


def update_made_non_finite(ctx: CheckContext) -> bool:
    """`dense_step` saw plain steps make variables or state non-finite: a check that then sees
    non-finite values blames the update (`non_finite_update`), not a cause of its own (a sign, a
    schedule, an added group, bfloat16)."""
    return ctx.notes.get("non_finite_update", False) is True


def updates_nothing(ctx: CheckContext) -> bool:
    """`dense_step` saw no variable move: checks that need movement say so instead of failing."""
    return ctx.notes.get("moves_nothing", False) is True


def still_steps(ctx: CheckContext, shapes: Sequence[tuple[int, ...]] = SHAPES, **overrides: Any) -> int:
    """How many first steps of a fresh optimizer move no variable at all (a warm-up that only
    builds state), at most WARMUP_STEPS - 1; an optimizer still at rest after WARMUP_STEPS steps
    gets 0, so the checks judge it as they would any other."""
    driver = ctx.driver
    optimizer, variables = fresh(ctx, shapes, **overrides)
    start = driver.values(variables)
    for step in range(WARMUP_STEPS):
        driver.step(optimizer, variables, arrays(shapes, seed=1 + step), ctx.needs)
        if max_diff(driver.values(variables), start) > 0:
            return step
    return 0


def attributes_written_by_the_user(cls: type) -> set[str]:
    """The `self.<name>` the classes of `cls`'s MRO outside the frameworks mention in their source
    (the frameworks' own classes keep counters of their own: TensorFlow's trackables a
    `_self_update_uid`)."""
    names: set[str] = set()
    for klass in user_classes(cls):
        try:
            names.update(
                re.findall(r"\bself\.(\w+)", "".join(code_only(inspect.getsource(klass).splitlines(True))))
            )
        except (OSError, TypeError):  # a class without source here (compiled, or made in a REPL)
            continue
    return names


def python_counters(ctx: CheckContext) -> list[str]:
    """The plain numbers the class's own code keeps as attributes that a step changes (`self.t += 1`),
    as `self.t`: state no variable holds, so a strategy's replicas, a traced graph and a save each
    see a copy of their own. Empty where a step raises."""
    try:
        optimizer, variables = fresh(ctx)
        before = plain_numbers(optimizer)
        ctx.driver.step(optimizer, variables, arrays(SHAPES, seed=50), ctx.needs)
        after = plain_numbers(optimizer)
    except Exception:
        return []
    written = attributes_written_by_the_user(type(optimizer))
    return sorted(f"self.{name}" for name in after.keys() & written if before.get(name) != after[name])


@dataclass(frozen=True)
class MethodLine:
    """One source line of a method of the user's class: the method, `file:line`, the line as written,
    and the same line with comments and string insides blanked (`code_only`)."""

    method: str
    where: str
    line: str
    code: str


def user_method_lines(ctx: CheckContext, skip: Collection[str] = ()) -> Iterator[MethodLine]:
    """Every line of the methods the user's classes define (their bases of the user's too), method
    by method, but those named in `skip`: what the scans that read a class's source by pattern read."""
    for klass in user_classes(ctx.target.cls):
        for name, function in vars(klass).items():
            if name in skip or not inspect.isfunction(function):
                continue
            try:  # unwrapped: torch wraps `step` in hooks defined in its own file
                lines, first = inspect.getsourcelines(inspect.unwrap(function))
                path = inspect.getsourcefile(inspect.unwrap(function))
            except (OSError, TypeError):
                continue
            for offset, (line, code) in enumerate(zip(lines, code_only(lines), strict=True)):
                yield MethodLine(name, f"{path}:{first + offset}", line, code)


def line_computing_with(ctx: CheckContext, key: str, computing: re.Pattern[str]) -> tuple[str, str]:
    """(`file:line`, code) of the first line of the class's own methods (its constructor aside)
    that uses `key` (`group["weight_decay"]`, or a name taken from it) as `computing` says; ("", "")
    where none is found."""
    quoted = re.compile(rf"""\[\s*['"]{re.escape(key)}['"]\s*\]|\b{re.escape(key)}\b""")
    names: list[re.Pattern[str]] = []
    method = None
    for found in user_method_lines(ctx, skip=("__init__",)):
        if found.method != method:  # a name taken from the key holds it in its own method only
            method, names = found.method, [quoted]
        code = found.line.split("#", 1)[0]  # the key's quotes kept: `code_only` blanks what they hold
        if not any(name.search(code) for name in names):
            continue
        alias = re.match(r"\s*(\w+)\s*=[^=]", code)
        if alias and not computing.search(code):
            names.append(re.compile(rf"\b{alias.group(1)}\b"))  # `wd = group["weight_decay"]`
        elif computing.search(code):
            return found.where, found.line.strip()
    return "", ""


def code_only(lines: Sequence[str]) -> list[str]:
    """Source lines with their comments and the insides of their strings blanked (same lines, same
    columns), for the scans that read a class's source by pattern: a line commented out, or a
    docstring's example, is no code of the class. The lines as they are where they do not tokenize
    (a fragment)."""
    blanked = [list(line) for line in lines]
    try:
        for token in tokenize.generate_tokens(iter(lines).__next__):
            if token.type not in (tokenize.COMMENT, tokenize.STRING):
                continue
            (first_row, first_column), (last_row, last_column) = token.start, token.end
            keep = 1 if token.type == tokenize.STRING else 0  # a string's quote stays: `x[""]`
            for row in range(first_row, last_row + 1):
                line = blanked[row - 1]
                start = first_column + keep if row == first_row else 0
                end = last_column - keep if row == last_row else len(line)
                line[start:end] = [" " if char != "\n" else char for char in line[start:end]]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return list(lines)
    return ["".join(line) for line in blanked]


def plain_numbers(optimizer: Any) -> dict[str, int | float]:
    """The plain numbers (not bools) an object keeps as attributes, by name."""
    return {
        name: value
        for name, value in getattr(optimizer, "__dict__", {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
