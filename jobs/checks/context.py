"""What every check function gets: the target, the hyperparameters, what the loop is told
(`LoopSetup`: stated needs, a param-group recipe, a wrapper's base), a scratch folder."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.checks.target import Target, UsageError, resolve_target
from jobs.frameworks import driver_for
from jobs.frameworks.base import Driver, raising_frame
from jobs.spec import ParamGroupRecipe
from optimizers.hyperparams import check_all
from optimizers.loop_needs import LoopNeeds, base_unserved, user_classes
from optimizers.param_groups import GroupRule
from optimizers.registry import Base, Entry

STATEFUL_MOMENTUM = 0.9


class RecipeNotHonoured(Exception):
    """A check built param groups of its own, which a recipe cannot be applied to: its verdict would
    be about optlab's groups, not the class (the runner reports it as an inconclusive skip)."""


@dataclass(frozen=True)
class LoopSetup:
    """What a check is told beyond hyperparameters, in the job spec's own terms and JSON form:
    `needs` merged over the detected ones (`optimizer.needs`), a param-group recipe
    (`optimizer.param_groups`), the optimizer a wrapper wraps (`optimizer.base`: name, params,
    needs). JSON, so a fresh process rebuilds the same context."""

    needs: Mapping[str, Any] = field(default_factory=dict)
    param_groups: Sequence[Mapping[str, Any]] = ()
    base: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        # One form whatever the caller passed (a list from JSON, a tuple by default).
        object.__setattr__(self, "param_groups", tuple(self.param_groups))

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "needs": dict(self.needs),
            "param_groups": [dict(g) for g in self.param_groups],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> LoopSetup:
        data = data or {}
        return cls(
            needs=dict(data.get("needs") or {}),
            param_groups=data.get("param_groups") or (),
            base=data.get("base"),
        )

    def rules(self) -> list[tuple[GroupRule, Mapping[str, Any]]]:
        recipes = [ParamGroupRecipe.model_validate(group) for group in self.param_groups]
        return [(recipe.rule(), recipe.params) for recipe in recipes]


@dataclass
class CheckContext:
    target: Target
    # The user's hyperparameters in catalogue form (`lr`, not `learning_rate`), checked
    # against the class's declared ranges; defaults fill the rest when building.
    params: dict[str, Any]
    workdir: Path
    # Checks may leave notes for later ones (e.g. the variables that `dense_step` saw).
    notes: dict[str, Any] = field(default_factory=dict)
    setup: LoopSetup = field(default_factory=LoopSetup)

    @property
    def driver(self) -> Driver:
        """The style's driver: how the checks drive its framework (imported on first use)."""
        if "driver" not in self.notes:
            self.notes["driver"] = driver_for(self.target.style)
        driver: Driver = self.notes["driver"]
        return driver

    def build(
        self,
        model_params: Iterable[Any] | None = None,
        *,
        learning_rate: Any = None,
        **overrides: Any,
    ) -> Any:
        """A new optimizer with the user's params (and `overrides`, catalogue names)."""
        return self.create(
            {**self.params, **overrides}, model_params=model_params, learning_rate=learning_rate
        )

    def create(
        self,
        params: Mapping[str, Any],
        *,
        model_params: Iterable[Any] | None = None,
        learning_rate: Any = None,
    ) -> Any:
        """The optimizer with exactly `params`, as a job builds it: over the recipe's param groups
        (the variables named p0, p1, ... in order), around the base a wrapper wraps (which takes the
        params the wrapper does not, the learning rate among them)."""
        entry, base = self.entry, self.base
        if base is not None:
            moved = {k: v for k, v in params.items() if k not in entry.params and k in base.entry.params}
            params = {k: v for k, v in params.items() if k not in moved}
            base = Base(base.entry, {**base.hyperparams, **moved})
        if model_params is not None and self.setup.param_groups:
            model_params = self._grouped(model_params)
        return entry.create(params, model_params=model_params, learning_rate=learning_rate, base=base)

    def _grouped(self, model_params: Iterable[Any]) -> list[dict[str, Any]]:
        """The recipe's groups of a check's flat list of variables. A rule that matches none of them
        is left out (they are not the model it was written for); groups a check built itself are
        not regrouped: RecipeNotHonoured."""
        variables = list(model_params)
        if any(isinstance(item, Mapping) for item in variables):
            raise RecipeNotHonoured(
                "this check builds param groups of its own, which the given recipe cannot be applied to: "
                "group keys the class requires (such as Muon's use_muon) would be missing, so a failure "
                "would be optlab's, not the class's"
            )
        holder = self.base.entry if self.base is not None else self.entry
        named = [(f"p{index}", variable) for index, variable in enumerate(variables)]
        return holder.param_groups(self.setup.rules(), named, skip_unmatched=True)

    @property
    def entry(self) -> Entry:
        """The target's entry with the stated needs merged over the detected ones."""
        return self.target.entry.with_needs(self.setup.needs)

    @property
    def base(self) -> Base | None:
        """The optimizer a wrapper wraps, resolved like the target (in its style); None without one."""
        if self.setup.base is None:
            return None
        if "base" not in self.notes:
            self.notes["base"] = resolve_base(self.target, self.setup.base)
        base: Base = self.notes["base"]
        return base

    @property
    def needs(self) -> LoopNeeds:
        """How the class must be stepped (closure, create_graph): every step a check takes passes it.
        A wrapper's are its own and its base's (Lookahead over AdaHessian needs a graph)."""
        base = self.base
        return self.entry.needs.with_base(base.entry.needs if base is not None else None)

    @property
    def has_lr(self) -> bool:
        """Whether the class takes a learning rate at all (A2Grad and AliG compute their step); a
        wrapper without one of its own takes its base's."""
        base = self.base
        return "lr" in self.target.entry.params or (base is not None and "lr" in base.entry.params)

    @property
    def lr(self) -> float:
        """The learning rate the optimizer is built with (the user's, else the class default; a
        wrapper without one of its own: its base's)."""
        declared = self.target.entry.params.get("lr")
        base = self.base
        if declared is None and base is not None and "lr" in base.entry.params:
            given = base.hyperparams.get("lr", base.entry.params["lr"].default)
        else:
            given = self.params.get("lr", None if declared is None else declared.default)
        if given is None and declared is None:
            given = self.rate_in_groups()
        return 1e-3 if given is None else float(given)  # None: the class derives its rate (SaRA)

    def rate_in_groups(self) -> float | None:
        """For a torch class whose constructor declares no rate (one taking its hyperparameters as
        **kwargs): the numeric 'lr' its param groups hold, where an `lr` keyword sets it (built with
        twice that rate, the groups hold twice that). Every torch LR scheduler sets that key, so a
        schedule reaches such a class as any other. None otherwise. Cached."""
        if "rate_in_groups" not in self.notes:
            self.notes["rate_in_groups"] = self._rate_in_groups()
        rate: float | None = self.notes["rate_in_groups"]
        return rate

    def _rate_in_groups(self) -> float | None:
        if self.target.style != "torch" or self.has_lr:
            return None
        try:
            rates = _group_rates(self.build(self.driver.variables([np.ones(3, dtype=np.float32)])))
            if len(rates) != 1:
                return None
            rate = rates.pop()
            variables = self.driver.variables([np.ones(3, dtype=np.float32)])
            doubled = self.build(variables, learning_rate=2 * rate)
        except Exception:  # no `lr` keyword, or a build that fails for its own reasons (see construct)
            return None
        return rate if _group_rates(doubled) == {2 * rate} else None

    def mark_unbuildable(self) -> None:
        """`construct` could not build the optimizer at all: the other checks cannot run.

        A construct fail for an invalid value it accepted does not count: the rest still runs.
        """
        self.notes["unbuildable"] = True

    @property
    def unbuildable(self) -> bool:
        return bool(self.notes.get("unbuildable"))

    def mark_step_raises(self) -> None:
        """`dense_step`'s first step on the standard variables raised: every later check would
        report the same error again, so they are not run (one cause, one flag)."""
        self.notes["step_raises"] = True

    @property
    def step_raises(self) -> bool:
        return bool(self.notes.get("step_raises"))

    def mark_takes_only_sparse(self) -> None:
        """`dense_step`'s first step was refused because the gradient is dense (torch's SparseAdam):
        the checks that step with dense gradients are not run; `sparse` still is."""
        self.notes["takes_only_sparse"] = True

    @property
    def takes_only_sparse(self) -> bool:
        return bool(self.notes.get("takes_only_sparse"))

    def user_files(self) -> set[str]:
        """The source files of the class and of its bases outside the frameworks (the user's code, or
        their package's), the wrapped base's too: a class registered as `class MyYogi(Yogi): pass`
        runs the code of the file it imports Yogi from."""
        classes = user_classes(self.target.cls) + (user_classes(self.base.entry.cls) if self.base else [])
        own = self.target.source_file()  # the class's own, a framework's built-in checked as a target too
        files = {own} if own is not None else set()
        for klass in classes:
            try:
                source = inspect.getsourcefile(klass)
            except TypeError:  # a class without a source file
                continue
            if source is not None:
                files.add(source)
        return files

    def user_frame(self, error: BaseException) -> traceback.FrameSummary | None:
        """The deepest frame of `error` inside the user's code (`user_files`), if any: where a method
        the class inherits from another file of theirs raised, that file's line, not the line of a
        `class ...: pass` that registers it."""
        files = self.user_files()
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in files]
        return frames[-1] if frames else None

    def where(self, error: BaseException | None = None) -> str:
        """`file.py:line` in the user's class: the deepest frame of `error` inside its file, else
        the class statement."""
        frame = None if error is None else self.user_frame(error)
        if frame is not None:
            return f"{frame.filename}:{frame.lineno}"
        return self.target.class_location()

    def describe_error(self, error: BaseException) -> str:
        return one_line(error)

    def stateful_overrides(self) -> dict[str, Any]:
        """Settings that give a stateless configuration (SGD's default momentum=0) some state.

        Checks of state across a save or a process would be vacuous without it: momentum 0.9
        is used instead, only when the class declares a numeric `momentum` that allows it, and
        the pass detail says so (`overrides_note`).
        """
        declared = self.target.entry.params.get("momentum")
        if declared is None or declared.type not in ("float", "number"):
            return {}
        if self.params.get("momentum", declared.default) != 0:
            return {}
        try:
            return {"momentum": declared.check(STATEFUL_MOMENTUM)}
        except ValueError:
            return {}


def overrides_note(overrides: Mapping[str, Any]) -> str:
    """What a pass detail adds when `stateful_overrides` changed the build."""
    if not overrides:
        return ""
    settings = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return f" (built with {settings}: the given settings keep no state to check)"


def one_line(error: BaseException) -> str:
    """`TypeError: message` cut to one readable line."""
    message = " ".join(str(error).split())
    key: Any = error.args[0] if isinstance(error, KeyError) and error.args else None
    if hasattr(key, "shape") and hasattr(key, "dtype"):  # a tensor as a key: its kind, not its values
        message = f"a {type(key).__name__} of shape {tuple(key.shape)} as the key"
    if len(message) > 300:
        message = message[:297] + "..."
    if not message:  # a bare `assert G.ndim >= 2`: its own line is all that says what it wants
        frame = raising_frame(error)
        code = (frame.line or "").strip() if frame is not None else ""
        message = f"raised with no message by `{code}`" if code else "raised with no message"
    return f"{type(error).__name__}: {message}"


def with_defaults(target: Target, params: Mapping[str, Any]) -> dict[str, Any]:
    """The full hyperparameter set a build with `params` uses: declared defaults, then `params`."""
    return {**{name: p.default for name, p in target.entry.params.items()}, **params}


def resolve_base(target: Target, base: Mapping[str, Any]) -> Base:
    """`{"name", "params", "needs"}` (the job spec's `optimizer.base`) as the Base of `target`'s
    style, its params validated; UsageError says what is wrong."""
    refused = base_unserved(target.framework)
    if refused:
        raise UsageError(f"--base: {refused}")
    try:
        found = resolve_target(str(base["name"]), style=target.style)
    except UsageError as exc:  # which option named it: the target's own name resolves alike
        raise UsageError(f"--base: {exc}") from None
    owner = f"--base: optimizer {found.name!r} ({found.style})"
    try:
        entry = found.entry.with_needs(base.get("needs") or {})
        params = dict(base.get("params") or {})
        check_all(params, entry.params, owner=owner)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc) if str(exc).startswith(owner) else f"{owner}: {exc}") from None
    return Base(entry, params)


def _group_rates(optimizer: Any) -> set[float]:
    """The positive finite numbers the optimizer's param groups hold as 'lr' (empty: one holds none)."""
    rates = set()
    for group in getattr(optimizer, "param_groups", None) or [{}]:
        rate = group.get("lr")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < float("inf"):
            return set()
        rates.add(float(rate))
    return rates
