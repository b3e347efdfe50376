"""The optimizer catalogue: one registry fed by built-ins, entry points and plugin folders.

Optimizer code is only ever loaded from those three places, never from a request.
A plugin file needs no import of optlab: every optimizer class *defined* in it is
registered under its `optlab_name` attribute, else its class name in snake_case.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from optimizers.declared_ranges import check_declared_names, declared_param
from optimizers.forwarded_arguments import constructor_arguments, reaches_the_base
from optimizers.hyperparams import (
    FRAMEWORK_SWITCHES,
    MAX_LIST_LENGTH,
    Param,
    ParamType,
    check_all,
    is_number,
    is_option_text,
)
from optimizers.loop_needs import (
    BASE_ARGUMENTS,
    CLASS_ANNOTATION,
    MODEL_ARGUMENTS,
    NAMED_PARAMETERS_ARGUMENTS,
    OPTIMIZER_ANNOTATION,
    LoopNeeds,
    annotation_text,
    base_problem,
    detect_loop_needs,
    first_argument,
    unserved,
)
from optimizers.optional_imports import KERAS_MODULE_OF_STYLE, keras_imports_hidden
from optimizers.param_groups import (
    GroupRule,
    assign_groups,
    extra_key_problem,
    extra_key_value,
    read_group_keys,
)
from optimizers.plugin_import import import_file

ENTRY_POINT_GROUP = "optlab.optimizers"
PLUGIN_DIRS_ENV = "OPTLAB_PLUGIN_DIRS"
# An entry's `source` when a plugin file registered it: this, then the file's path.
PLUGIN_SOURCE = "plugin "

STYLES = ("torch", "keras", "tf_legacy")
FRAMEWORK_OF_STYLE = {"torch": "torch", "keras": "tensorflow", "tf_legacy": "tensorflow"}

BUILTIN_MODULES: dict[str, tuple[str, ...]] = {
    style: tuple(
        f"optimizers.{style}.{name}"
        for name in ("ema_momentum", "lion", "adamw_ref", "sgd", "adam", "adamw")
        if not (style == "tf_legacy" and name == "adamw")  # tf_keras has no legacy AdamW
    )
    for style in STYLES
}

_LR_ARGS = ("lr", "learning_rate")
# A wrapper's argument that takes the base optimizer's class (SAM) when it follows the parameters;
# any other, and one that comes first (timm's Lookahead), takes a built one.
_BASE_CLASS_ARGUMENTS = ("base_optimizer",)
# Keras optimizers take the learning rate through **kwargs when a subclass does not restate it.
_KERAS_DEFAULT_LR = 1e-3


def _takes_the_base_class(cls: type, argument: str) -> bool:
    """SAM's `(params, base_optimizer, ...)` builds its base from the class over the parameters it
    takes first; a constructor whose first argument is the base itself (timm's Lookahead:
    `(base_optimizer, alpha, k)`) takes no parameters, so its base comes built. An annotation says
    it outright: `Type[Optimizer]` a class, `Optimizer` a built one (sam-pytorch's `optim`)."""
    try:
        written = annotation_text(inspect.signature(cls).parameters[argument])
    except (TypeError, ValueError, KeyError):
        written = ""
    named = len(OPTIMIZER_ANNOTATION.findall(written))
    as_class = len(CLASS_ANNOTATION.findall(written))
    if named and as_class in (0, named):  # one form only (a union of both, as Lookahead's, says nothing)
        return as_class == named
    return argument in _BASE_CLASS_ARGUMENTS and first_argument(cls) != argument


@dataclass(frozen=True)
class Entry:
    name: str
    framework: str
    style: str
    cls: type
    params: dict[str, Param]
    supports_sparse: bool
    summary: str
    reference: str
    source: str
    lr_arg: str = "lr"
    # What the optimizer needs from the training loop (closure, create_graph, train/eval, ...).
    needs: LoopNeeds = field(default_factory=LoopNeeds)
    # A plugin file's sha256 as it was read: a job submitted against it refuses to run other code.
    sha256: str | None = None

    def create(
        self,
        hyperparams: Mapping[str, Any],
        *,
        model_params: Iterable[Any] | None = None,
        learning_rate: Any = None,
        base: Base | None = None,
        model: Any = None,
    ) -> Any:
        """Validate `hyperparams` (`lr` included) and construct the optimizer.

        torch optimizers take `model_params`; Keras ones take none. `learning_rate`, when
        given, replaces the validated `lr` (a Keras LearningRateSchedule built from it).
        A wrapper (`needs.base_optimizer`) is built around `base`, which it requires. One built
        over the model (`needs.model_argument`) takes `model`, or its named parameters.
        """
        kwargs = self.kwargs(hyperparams)
        if learning_rate is not None:
            kwargs[self.lr_arg] = learning_rate
        problem = base_problem(self.name, self.needs, (base.entry.name, base.entry.needs) if base else None)
        if problem and self.needs.base_optimizer is not None:
            # A wrapper no base can serve (a Keras one) is told so, not to name a base.
            problem = unserved(self.name, self.needs, self.framework) or problem
        if problem:
            raise ValueError(problem)
        if base is not None and self.needs.base_optimizer is not None:
            given = set(self.kwargs(hyperparams, partial=True)) | (
                {self.lr_arg} if learning_rate is not None else set()
            )
            return self._wrap(base, self.needs.base_optimizer, kwargs, model_params, given=given, model=model)
        if self.needs.model_argument is not None:
            over = self._over_the_model(model)
            try:
                return self.cls(over, **kwargs)
            except TypeError as exc:  # torch's "can only optimize Tensors" said nothing of the need
                raise ValueError(
                    f"optimizer {self.name!r} was built over the model (needs.model_argument "
                    f"{self.needs.model_argument!r}) and its constructor refused it: {exc}; a class that "
                    "takes parameters needs no model_argument"
                ) from exc
        if self.style == "torch":
            return self.cls(model_params, **kwargs)
        return self.cls(**kwargs)

    def kwargs(self, hyperparams: Mapping[str, Any], *, partial: bool = False) -> dict[str, Any]:
        """`hyperparams` validated and keyed by the class's own argument names (`lr` -> `lr_arg`).

        `partial`: a param group's params, only those given (torch keys its groups by the same names).
        """
        owner = f"optimizer {self.name!r} ({self.style})"
        checked = check_all(hyperparams, self.params, owner=owner, partial=partial)
        native = {key: self.params[key].native(value) for key, value in checked.items()}
        return {(self.lr_arg if key == "lr" else key): value for key, value in native.items()}

    def group_keys(self) -> frozenset[str] | None:
        """The keys the class reads from its param groups (torch, the only style with groups), a
        superset read from its source; None when unknown (see `param_groups.read_group_keys`)."""
        return read_group_keys(self.cls) if self.style == "torch" else None

    def group_kwargs(
        self, params: Mapping[str, Any], *, owner: str = "optimizer.param_groups"
    ) -> dict[str, Any]:
        """A param group's params as the group gets them: catalogued hyperparameters validated and
        renamed as in `kwargs`, other keys the class reads from its groups passed as given
        (`param_groups.extra_key_problem`); ValueError names the first bad key."""
        extra = {key: value for key, value in params.items() if key not in self.params}
        reads = self.group_keys()
        for key, value in extra.items():
            problem = extra_key_problem(
                key, value, owner=f"optimizer {self.name!r}", declared=self.params, reads=reads
            )
            if problem:
                raise ValueError(f"{owner}: {problem}")
        declared = self.kwargs({k: v for k, v in params.items() if k in self.params}, partial=True)
        if self.lr_arg in declared and reads is not None and "lr" in reads and self.lr_arg not in reads:
            # Takes `learning_rate` and keeps it in its groups as torch's `lr` (a port from Keras).
            declared["lr"] = declared.pop(self.lr_arg)
        return {**declared, **{key: extra_key_value(key, value) for key, value in extra.items()}}

    def param_groups(
        self,
        rules: Sequence[tuple[GroupRule, Mapping[str, Any]]],
        named: Iterable[tuple[str, Any]],
        *,
        skip_unmatched: bool = False,
    ) -> list[dict[str, Any]]:
        """torch param groups (`{"params": [...], **hyperparameters}`) a recipe makes of `named`
        tensors (anything with a `shape`); `skip_unmatched` as in `assign_groups`."""
        by_name = dict(named)
        groups = assign_groups(
            [
                (rule, self.group_kwargs(params, owner=f"optimizer.param_groups[{i}]"))
                for i, (rule, params) in enumerate(rules)
            ],
            [(name, tuple(tensor.shape)) for name, tensor in by_name.items()],
            skip_unmatched=skip_unmatched,
        )
        return [{"params": [by_name[name] for name in group.names], **group.params} for group in groups]

    def _over_the_model(self, model: Any) -> Any:
        """What the first argument of a class built over the model asks for: the model itself, or
        its named parameters (adam-mini's `named_parameters`)."""
        argument = self.needs.model_argument
        if model is None:
            raise ValueError(
                f"optimizer {self.name!r} is built over the model (its {argument!r} argument), and no "
                "model was given: only a training job has one"
            )
        return model.named_parameters() if argument in NAMED_PARAMETERS_ARGUMENTS else model

    def _wrap(
        self,
        base: Base,
        argument: str,
        kwargs: dict[str, Any],
        model_params: Any,
        *,
        given: set[str],
        model: Any = None,
    ) -> Any:
        """The two conventions wrappers follow, told apart by the argument's name and place.
        `given`: the wrapper's arguments the spec set (the rest of `kwargs` are its defaults)."""
        if self.style != "torch":
            raise ValueError(f"optimizer {self.name!r} ({self.style}): wrappers run in torch jobs only")
        base_kwargs = base.entry.kwargs(base.hyperparams)
        if _takes_the_base_class(self.cls, argument):
            # SAM: builds the base itself from the class, forwarding the keyword arguments it does
            # not take (the base's lr and the rest) and sharing the base's param groups. An argument
            # both take (`eps`, `foreach`) is the wrapper's: the base keeps its own default. Only one
            # the spec set for both, or for the base alone, cannot be served.
            shared = set(base_kwargs) & set(kwargs)
            base_given = set(base.entry.kwargs(base.hyperparams, partial=True))
            if shared & base_given:
                both = sorted(shared & base_given & given)
                raise ValueError(
                    f"optimizer {self.name!r} and its base {base.entry.name!r} both take {both}; set them "
                    "in optimizer.params or optimizer.base.params, not both"
                    if both
                    else f"optimizer.base.params: {sorted(shared & base_given)} is an argument of the "
                    f"wrapper {self.name!r} itself, so it cannot also reach its base "
                    f"{base.entry.name!r}, which the wrapper builds; set it in optimizer.params"
                )
            forwarded = {key: value for key, value in base_kwargs.items() if key not in shared}
            leading = [model_params]
            if self.needs.model_argument is not None:  # WSAM(model, params, base_optimizer, ...)
                leading = [self._over_the_model(model), model_params]
            return self.cls(*leading, **{argument: base.entry.cls}, **forwarded, **kwargs)
        # Lookahead: wraps a built base optimizer, whose param groups it exposes as its own; one that
        # takes the parameters too (sam-pytorch's SAM) gets them first, as it asks.
        if first_argument(self.cls) == argument:
            return self.cls(**{argument: base.entry.cls(model_params, **base_kwargs)}, **kwargs)
        params = list(model_params or ())  # once for the base, once for the wrapper
        return self.cls(params, **{argument: base.entry.cls(params, **base_kwargs)}, **kwargs)

    def with_needs(self, overrides: Mapping[str, Any]) -> Entry:
        """This entry with needs a job states (what detection cannot see) merged over the detected ones."""
        if not overrides:
            return self
        return dataclasses.replace(self, needs=self.needs.with_overrides(overrides, owner="optimizer.needs"))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "framework": self.framework,
            "style": self.style,
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "params": [param.to_json() for param in self.params.values()],
            "supports_sparse": self.supports_sparse,
            "needs": self.needs.to_json(),
            "group_keys": None if (keys := self.group_keys()) is None else sorted(keys),
            "summary": self.summary,
            "reference": self.reference,
            "source": self.source,
            "sha256": self.sha256,
        }

    def where(self) -> str:
        """`probe_torch.py:ProbeMomentum (line 12)`: the class and where it is, for a person to read."""
        return class_place(self.cls, _plugin_file(self))


@dataclass(frozen=True)
class Base:
    """The optimizer a wrapper wraps, as a job names it: its entry and its hyperparameters."""

    entry: Entry
    hyperparams: Mapping[str, Any]


@dataclass(frozen=True)
class LoadError:
    source: str
    error: str
    # False where one class of the file was refused (the file's other classes may be registered);
    # True where the file as a whole failed (an import error, no optimizer class in it).
    whole_file: bool = True


def class_place(cls: type, file: str) -> str:
    """`probe_torch.py:ProbeMomentum (line 12)`, or without the line where the source cannot say."""
    name = f"{Path(file).name}:{cls.__qualname__}" if file.endswith(".py") else f"{file}:{cls.__qualname__}"
    try:
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return name
    return f"{name} (line {line})"


@dataclass
class Registry:
    """Entries keyed by (name, style): one name may exist once in each style.

    Two plugin classes that claim one name in one style take it from each other: neither is
    registered under it (`clashes`), so adding a file never changes what a name runs; a plugin class
    that claims a name a built-in or an installed package holds is refused, and they keep it.
    """

    entries: dict[tuple[str, str], Entry] = field(default_factory=dict)
    errors: list[LoadError] = field(default_factory=list)
    clashes: dict[tuple[str, str], list[Entry]] = field(default_factory=dict)

    def add(self, entry: Entry) -> None:
        key = (entry.name, entry.style)
        known = [self.entries[key]] if key in self.entries else self.clashes.get(key, [])
        # An alias in its file (`OldName = Adan`): one class from one source, not two claiming a name.
        if any(other.cls is entry.cls and other.source == entry.source for other in known):
            return
        if key in self.clashes:
            self.clashes[key].append(entry)
            return
        if key in self.entries:
            first = self.entries[key]
            if _from_a_plugin(first) and _from_a_plugin(entry):
                self.clashes[key] = [self.entries.pop(key), entry]
                return
            fix = (
                "a plugin cannot take a built-in's or an installed package's name, which keeps it: set "
                "another `optlab_name` on the plugin's class, or rename the class"
                if _from_a_plugin(entry)
                else "set a distinct `optlab_name` on one of them"
            )
            raise ValueError(
                f"optimizer name {entry.name!r} ({entry.style} style) is registered twice: by "
                f"{first.source} and by {entry.source}; {fix}"
            )
        self.entries[key] = entry

    def clash_errors(self) -> list[LoadError]:
        """One error per file of a clash, each naming every class that claims the name and the fix."""
        errors: list[LoadError] = []
        for (name, style), claimants in self.clashes.items():
            places = "; ".join(f"{claimant.where()} in {_plugin_file(claimant)}" for claimant in claimants)
            said = (
                f"optimizer name {name!r} ({style} style) is claimed by {len(claimants)} plugin classes: "
                f"{places}. None of them is registered under it, so no job runs either: rename all but "
                "one (set `optlab_name` on the class, or rename the class)"
            )
            for file in dict.fromkeys(_plugin_file(claimant) for claimant in claimants):
                errors.append(LoadError(source=file, error=said, whole_file=False))
        return errors

    def names(self) -> list[str]:
        return sorted({name for name, _ in self.entries})

    def get(self, name: str, style: str | None = None) -> Entry:
        """The entry for `name` in `style`; without a style, the first of torch, keras, tf_legacy."""
        styles = [style] if style is not None else list(STYLES)
        for candidate in styles:
            if (name, candidate) in self.entries:
                return self.entries[(name, candidate)]
        if any(n == name for n, _ in self.entries):
            have = ", ".join(s for n, s in self.entries if n == name)
            raise ValueError(f"optimizer {name!r} has no {style} style; it exists in: {have}")
        raise ValueError(
            unknown_optimizer(name, self.names(), [(error.source, error.error) for error in self.errors])
        )

    def build(
        self, name: str, model_params: Iterable[Any], hyperparams: Mapping[str, Any], style: str = "torch"
    ) -> Any:
        """Construct torch optimizer `name` over `model_params`; `lr` maps to the class's own name."""
        return self.get(name, style).create(hyperparams, model_params=model_params)

    def load_module(
        self, module: ModuleType, source: str, styles: Iterable[str] = STYLES, *, sha256: str | None = None
    ) -> None:
        """Register every optimizer class defined in `module` (not those it imports) of `styles`, each
        on its own: a class refused (a bad declaration, a name taken) is an error of its own, and the
        file's other classes are still registered (the first refusal had dropped the classes after it
        and the refusal itself, where the file registered one before it)."""
        file = source.removeprefix(PLUGIN_SOURCE)
        for cls, style in optimizer_classes(module):
            if style not in styles:
                continue
            try:
                entry = entry_for_class(cls, source=source, style=style)
                self.add(dataclasses.replace(entry, sha256=sha256))
            except Exception as exc:
                said = f"class {class_place(cls, file)} is not registered: {_load_error_text(exc, file)}"
                self.errors.append(LoadError(source=file, error=said, whole_file=False))


def register(
    cls: type | None = None,
    *,
    name: str | None = None,
    summary: str | None = None,
    reference: str | None = None,
    supports_sparse: bool | None = None,
) -> Any:
    """Decorator for explicit control over how a class appears in the catalogue.

    It only annotates the class; the loader registers it when it scans the module.
    """

    def annotate(target: type) -> type:
        if name is not None:
            target.optlab_name = name  # type: ignore[attr-defined]
        if summary is not None:
            target.optlab_summary = summary  # type: ignore[attr-defined]
        if reference is not None:
            target.optlab_reference = reference  # type: ignore[attr-defined]
        if supports_sparse is not None:
            target.optlab_supports_sparse = supports_sparse  # type: ignore[attr-defined]
        return target

    return annotate(cls) if cls is not None else annotate


def snake_case(class_name: str) -> str:
    """`SignMomentum` -> `sign_momentum`, `EMAMomentum` -> `ema_momentum`."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", class_name)
    return spaced.lower()


OPTIMIZER_BASES = "torch.optim.Optimizer, keras.optimizers.Optimizer or tf_keras.optimizers.legacy.Optimizer"
NOT_AN_OPTIMIZER = f"expected a subclass of {OPTIMIZER_BASES}"


def not_an_optimizer(cls: Any) -> str:
    """Why `cls` is none of the three styles, as the end of a sentence after its name: what is
    expected, and where it subclasses another Keras API's optimizer, which and what to subclass."""
    foreign = foreign_base(cls) if inspect.isclass(cls) else None
    return f"{NOT_AN_OPTIMIZER}; {foreign}" if foreign else NOT_AN_OPTIMIZER


def foreign_base(cls: type) -> str | None:
    """The optimizer base of a Keras API optlab does not train with that `cls` subclasses, with what
    to subclass instead; None for any other class. Read from the class's bases by name, so nothing
    is imported: TensorFlow's frozen internal Keras 2 (2020-era packages import
    `tensorflow.python.keras.optimizer_v2`), and tf_keras's own newer optimizer API (what
    `tf.keras.optimizers.Optimizer` is under TF_USE_LEGACY_KERAS)."""
    # A class written with the legacy API's methods takes the legacy base as it is.
    legacy_api = any(
        name in vars(klass) for klass in cls.__mro__ for name in ("_resource_apply_dense", "_create_slots")
    )
    legacy = (
        "tf_keras.optimizers.legacy.Optimizer (_resource_apply_dense, _create_slots, _set_hyper and "
        "get_config carry over)"
    )
    for base in cls.__mro__[1:]:
        module = base.__module__ or ""
        if module.startswith("tensorflow.python.keras") and base.__name__ == "OptimizerV2":
            return (
                "it subclasses tensorflow.python.keras's OptimizerV2, TensorFlow's frozen internal copy of "
                f"Keras 2, which neither Keras 3 nor tf_keras trains with: subclass {legacy}"
            )
        if module.startswith("tf_keras.") and ".legacy" not in module and base.__name__ == "Optimizer":
            keras3 = (
                "keras.optimizers.Optimizer (Keras 3's: build() and update_step(gradient, variable, "
                "learning_rate))"
            )
            instead = legacy if legacy_api else keras3
            return (
                "it subclasses tf_keras.optimizers.Optimizer, tf.keras's optimizer API of Keras 2.11 to 2.15 "
                "(tf.keras.optimizers.Optimizer under TF_USE_LEGACY_KERAS), which optlab does not run"
                f"{'; its methods are the older API' if legacy_api else ''}: subclass {instead}"
            )
    return None


def entry_for_class(cls: type, *, source: str, style: str | None = None) -> Entry:
    style = style or style_of(cls)
    if style is None:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not an optimizer: {not_an_optimizer(cls)}")
    missing = unfinished(cls, style)
    if missing is not None:
        raise TypeError(f"{cls.__qualname__} {missing}")
    params, lr_arg = derive_params(cls, style)
    # The class's own docstring only: an undocumented plugin must not borrow torch's.
    doc = inspect.cleandoc(cls.__doc__) if cls.__doc__ else ""
    reference = getattr(cls, "optlab_reference", None) or _first_url(doc)
    summary = getattr(cls, "optlab_summary", None) or _without_url(
        doc.splitlines()[0] if doc else "", reference
    )
    return Entry(
        name=getattr(cls, "optlab_name", None) or snake_case(cls.__name__),
        framework=FRAMEWORK_OF_STYLE[style],
        style=style,
        cls=cls,
        params=params,
        lr_arg=lr_arg,
        supports_sparse=bool(getattr(cls, "optlab_supports_sparse", False)),
        needs=detect_loop_needs(cls),
        summary=summary,
        reference=reference,
        source=source,
    )


def derive_params(cls: type, style: str = "torch") -> tuple[dict[str, Param], str]:
    """Hyperparameters from the constructor signature, ranges from the class's declarations.

    Types and defaults come from the signature (written once, in `__init__`); ranges
    from `optlab_hyperparameters` (`Param`s, or plain dicts of a range: `optimizers.declared_ranges`), the
    same declarations the constructor validates with.
    Numbers, booleans, tuples of numbers (a pair, `float_pair`; three or more, `float_tuple`) and
    strings are tunable: a string whose annotation lists its values (`Literal["uni", "exp"]`) is a
    `choice` of them, any other (`line_search_fn: str | None`, or a string default) a `str`. An
    unannotated `x=None` (Keras's `weight_decay`, Ranger21's `num_epochs`) says nothing of what it
    takes: it is `any` scalar, which the class judges when it is built. Arguments of no tunable type
    (callables, dtypes, modules) are left out, and so are ones whose default is a sentinel rather
    than a value (`palm: bool = use_default`); one with no default (or torch's `required`) but a
    tunable annotation (`beta: float`) is catalogued as required, and one with neither default nor
    annotation (`beta`) as a required `any`. An optional one (`beta3: float |
    None = None`, `clip: float | None = 1.0`) is catalogued as that type and `nullable`: a job may
    send null, as the class allows (a None default leaves the choice to the class). The learning rate is
    catalogued as `lr` whatever the class calls it; the second value returned is the class's own
    name for it.
    """
    declared: Mapping[str, Any] = getattr(cls, "optlab_hyperparameters", None) or {}
    only: Iterable[str] | None = getattr(cls, "optlab_tunable", None)
    params: dict[str, Param] = {}
    lr_arg = "lr" if style == "torch" else "learning_rate"
    over = _built_over(cls) if style == "torch" else None
    arguments = constructor_arguments(cls, _style_base(style))  # without self; **kwargs followed
    if not _takes_keywords_on(cls):  # with **kwargs a declared name may reach a base's constructor
        own = vars(cls).get("optlab_hyperparameters") or {}  # a parent's may name what a child fixes
        check_declared_names(
            cls.__name__, own, [a.parameter.name for a in arguments if a.parameter.name != over]
        )
    names_a_rate = any(argument.parameter.name in _LR_ARGS for argument in arguments)
    for argument in arguments:
        arg = argument.parameter
        if arg.name == over or (arg.name in FRAMEWORK_SWITCHES and arg.name not in declared):
            continue
        if only is not None and arg.name not in only:
            continue
        # torch's old `lr=required` (torch.optim.optimizer.required) marks a required argument too.
        required = (
            arg.default is inspect.Parameter.empty or type(arg.default).__name__ == "_RequiredParameter"
        )
        default = None if required else _plain(arg.default)
        annotation = _resolved(arg.annotation, argument.declared_by)
        kind = _infer_type(annotation) if required else _infer_type(annotation, default)
        if required and kind is None and _unannotated_value(arg):
            kind = "any"  # `beta` with neither default nor annotation: left out, no job could build it
        if arg.name in _LR_ARGS and default is None and kind in (None, "any"):
            kind = "float"  # `lr=None`: the class derives its rate (SaRA); one given is still a rate
        choices = _literal_strings(_without_none(annotation))
        members = _enum_of(annotation, default)
        if members is not None:  # a choice of the members' names, which JSON can carry
            kind, choices = "choice", tuple(members.__members__)
            default = default.name if isinstance(default, members) else default
        if kind is None or not _plain_default_of(kind, default, choices):
            continue
        nullable = _allows_none(annotation) or (default is None and not required)
        name = "lr" if arg.name in _LR_ARGS else arg.name
        if arg.name in _LR_ARGS:
            lr_arg = arg.name
        if arg.name in declared:
            param = declared_param(cls.__name__, arg.name, declared[arg.name], kind)
            if param.type == "float" and isinstance(default, int):
                default = float(default)  # torch writes `momentum=0`
            params[name] = dataclasses.replace(
                param, name=name, default=default, required=required, nullable=nullable
            )
        elif name == "lr":
            lr_default = None if default is None else float(default)
            params[name] = Param(
                "lr", "float", lr_default, low=0.0, low_inclusive=False, required=required, nullable=nullable
            )
        else:
            params[name] = Param(
                name, kind, default, required=required, nullable=nullable, choices=choices, enum_class=members
            )
    # One the class names whose default is no plain number (a schedule object) is still its rate.
    if "lr" not in params and (names_a_rate or _takes_a_rate_it_does_not_name(cls, style)):
        params = {"lr": Param("lr", "float", _KERAS_DEFAULT_LR, low=0.0, low_inclusive=False), **params}
    return params, lr_arg


def _takes_a_rate_it_does_not_name(cls: type, style: str) -> bool:
    """A Keras 3 class that names no learning rate but hands its **kwargs on to Keras's base, which
    requires one: it takes `learning_rate` there. Not one whose keywords stop on the way (no
    **kwargs), nor one that fills the base's `learning_rate` itself (`super().__init__(
    learning_rate=1.0, **kwargs)`: A2Grad and AliG compute their step), nor a legacy tf.keras class
    whose keywords reach the legacy base, which takes none (COCOB): building those with one had
    raised a TypeError, a false `construct` fail. Where the source does not say, one is assumed, as
    before (a subclass of a built-in that changes its kwargs on the way takes the built-in's)."""
    if style == "torch":
        return False
    base = _style_base(style)
    if base is None:  # its framework was never imported, so its source cannot be followed there
        return True
    reaches = reaches_the_base(cls, base, "learning_rate")
    if reaches is None:
        return True
    return reaches and style == "keras"


def _built_over(cls: type) -> str | None:
    """The torch constructor argument that takes what a job builds the class over: its first, whatever
    its name, when it has no default. torch's contract is `Optimizer(params, defaults)`, and jobs and
    checks pass the parameters (a recipe's param groups) first: KellerJordan's
    SingleDeviceMuonWithAuxAdam names it `param_groups`, and its catalogue had asked for
    `param_groups` as a required hyperparameter; a wrapper takes its base there, a class built over
    the model the model (their needs serve those). None where the first argument has a default: a
    hyperparameter (MARS_M's `lr=1e-3`, see `_hyperparameter_first`), or where none can be read."""
    first = _first_positional(cls)
    return first.name if first is not None and first.default is inspect.Parameter.empty else None


def _first_positional(cls: type) -> inspect.Parameter | None:
    """The constructor's first argument (without self) where it can be passed by position."""
    try:
        first = next(iter(inspect.signature(cls).parameters.values()), None)
    except (TypeError, ValueError):  # a constructor written in C states none
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return first if first is not None and first.kind in positional else None


def load_registry(
    plugin_dirs: Iterable[str] | None = None,
    styles: Iterable[str] = STYLES,
    *,
    wanted: Iterable[str] | None = None,
    plugin_files: Iterable[str] = (),
) -> Registry:
    """Built-ins, then entry points, then plugin folders; failures are kept, not raised.

    Only entries of `styles` are registered: a job process loads just its own
    framework, and the two Keras styles are never loaded into one process.

    `wanted`: the names the caller will look up (a job's optimizer and its base). The plugin
    folders are read only if one of them is not among the built-ins and entry points. A plugin
    cannot take a name those hold (a second registration is refused), so reading them could not
    change what the caller finds; skipping them keeps a job of a built-in optimizer from importing
    every plugin file and the frameworks they import (a Keras plugin would bring TensorFlow into a
    torch job, a torch one torch into a TensorFlow job).

    `plugin_files`: where the catalogue found `wanted` (a worker passes them to its jobs; a user
    running a job by hand may name a file outside the folders). They are read first, and the
    folders' other files only if `wanted` is still not all found: a job of one plugin optimizer
    then imports neither the others' files (one slow to import, one that imports TensorFlow) nor
    the frameworks they bring. First still means first in the folders' order (then the files
    outside them), so what a job finds is what the catalogue listed.

    Two plugin classes that claim one name in one style are both refused (`Registry.clashes`), each
    file's error naming them all.
    """
    styles = (styles,) if isinstance(styles, str) else tuple(styles)
    registry = Registry()
    _fill(registry, plugin_dirs, styles, wanted, plugin_files)
    registry.errors += registry.clash_errors()
    return registry


def _fill(
    registry: Registry,
    plugin_dirs: Iterable[str] | None,
    styles: tuple[str, ...],
    wanted: Iterable[str] | None,
    plugin_files: Iterable[str],
) -> None:
    """`load_registry`'s loading, into `registry`."""
    unknown = sorted(set(styles) - set(STYLES))
    if unknown:
        raise ValueError(f"unknown style {unknown[0]!r}; known: {', '.join(STYLES)}")
    for style in styles:
        # A style's built-ins import its framework first in a process: Keras's without the optional
        # libraries it imports just in case (optimizers/optional_imports.py).
        with keras_imports_hidden(KERAS_MODULE_OF_STYLE.get(style)):
            for module_name in BUILTIN_MODULES[style]:
                # Guarded too: a host without TensorFlow still serves its torch optimizers.
                _guarded(
                    registry, f"builtin:{module_name}", partial(_load_builtin, registry, module_name, styles)
                )
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        load = partial(_load_entry_point, registry, entry_point, styles)
        _guarded(registry, f"entry point {entry_point.name}", load)
    if wanted is not None and _holds(registry, wanted):
        return
    if plugin_dirs is None:
        plugin_dirs = [str(d) for d in plugin_dirs_from_environment()]
    files = [path for directory in plugin_dirs for path in sorted(Path(directory).glob("*.py"))]
    if wanted is not None:
        # Each named file, in the folders or not: one named by hand outside them had been passed over
        # without a word, and the job failed as an unknown optimizer.
        named = list(dict.fromkeys(str(file) for file in plugin_files))
        in_folders = [path for path in files if str(path) in named]
        found = {str(path) for path in in_folders}
        first = in_folders + [Path(file) for file in named if file not in found]
        for path in first:
            _guarded(registry, str(path), partial(_load_plugin_file, registry, path, styles))
        if first and _holds(registry, wanted):
            return
        files = [path for path in files if path not in first]
    for path in files:
        _guarded(registry, str(path), partial(_load_plugin_file, registry, path, styles))


def unknown_optimizer(name: str, known: Sequence[str], failed: Sequence[tuple[str, str]]) -> str:
    """Why `name` is not an optimizer here: the `known` ones, and the sources that `failed` to load
    (source, error), which may be where it is (a plugin with a syntax error, or one caught half
    rewritten as a job started, had been only "unknown")."""
    said = f"unknown optimizer {name!r}; known: {', '.join(known)}"
    if not failed:
        return said
    shown = [f"{source} ({(error.strip().splitlines() or [''])[-1][:200]})" for source, error in failed[:3]]
    more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
    return (
        f"{said}. These failed to load, so optimizers they define are not known: "
        f"{'; '.join(shown)}{more} (GET /optimizers lists the errors whole)"
    )


def _holds(registry: Registry, names: Iterable[str]) -> bool:
    return set(names) <= {name for name, _ in registry.entries}


def plugin_dirs_from_environment() -> list[Path]:
    """The plugin folders `OPTLAB_PLUGIN_DIRS` names (`:`-separated), as every process reads them."""
    return [Path(d) for d in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep) if d]


def _guarded(registry: Registry, source: str, load: Callable[[], None]) -> None:
    # One bad plugin must not hide the others: record the failure and carry on.
    try:
        load()
    except (Exception, SystemExit) as exc:  # any import-time error of user code, sys.exit() too
        registry.errors.append(LoadError(source=source, error=_load_error_text(exc, source)))


def _load_error_text(exc: BaseException, source: str) -> str:
    """The error's last line, with the line of the plugin file it points at: a SyntaxError's own,
    else the deepest frame in that file (an error raised further down names it in its message)."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f"{text} (at {Path(exc.filename or source).name}:{exc.lineno})"
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == source]
    return f"{text} (at {Path(source).name}:{lines[-1]})" if lines else text


def _load_builtin(registry: Registry, module_name: str, styles: tuple[str, ...]) -> None:
    registry.load_module(importlib.import_module(module_name), f"builtin:{module_name}", styles)


def _load_entry_point(
    registry: Registry, entry_point: importlib.metadata.EntryPoint, styles: tuple[str, ...]
) -> None:
    loaded = entry_point.load()
    source = f"entry point {entry_point.name} ({entry_point.value})"
    if isinstance(loaded, ModuleType):
        registry.load_module(loaded, source, styles)
        return
    style = style_of(loaded)
    if style is None:
        entry_for_class(loaded, source=source)  # raises the "not an optimizer" error
    elif style in styles:
        registry.add(entry_for_class(loaded, source=source, style=style))


def _from_a_plugin(entry: Entry) -> bool:
    return entry.source.startswith(PLUGIN_SOURCE)


def _plugin_file(entry: Entry) -> str:
    """A plugin entry's file; any other entry's source as it is."""
    return entry.source.removeprefix(PLUGIN_SOURCE)


def _load_plugin_file(registry: Registry, path: Path, styles: tuple[str, ...]) -> None:
    module = import_file(path, prefix="optlab_plugin")
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    if not optimizer_classes(module):
        raise ValueError(
            f"{path} defines no optimizer class (a subclass of {OPTIMIZER_BASES}){_unfinished_note(module)}"
            f"{_foreign_note(module)}{_imported_note(module)}"
        )
    registry.load_module(module, f"{PLUGIN_SOURCE}{path}", styles, sha256=sha256)


def _unfinished_note(module: ModuleType) -> str:
    """Why the optimizer classes the file does define are not ones: what each leaves undone."""
    notes = [f"{cls.__name__} {unfinished(cls, style)}" for cls, style in _defined_classes(module)]
    return "".join(f"; {note}" for note in notes)


def _foreign_note(module: ModuleType) -> str:
    """Why the classes the file defines on another Keras API's optimizer base are not optimizers here."""
    notes = [
        f"{value.__name__}: {foreign}"
        for value in vars(module).values()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and (foreign := foreign_base(value)) is not None
    ]
    return "".join(f"; {note}" for note in notes)


def _imported_note(module: ModuleType) -> str:
    """What to do when the file only imports optimizer classes (a published package's, say): an
    import is not registered, since a file may import an optimizer to use, not to offer."""
    imported = sorted(
        name
        for name, value in vars(module).items()
        if inspect.isclass(value) and value.__module__ != module.__name__ and style_of(value) is not None
    )
    if not imported:
        return ""
    example = imported[0]
    return (
        f"; it imports {', '.join(imported)}, and imported classes are not registered: to register one, "
        f"define a subclass in the file (`class My{example}({example}): pass`, under a name of its own), "
        "or publish its package's classes through the entry-point group optlab.optimizers"
    )


def optimizer_classes(module: ModuleType) -> list[tuple[type, str]]:
    """The optimizer classes `module` defines, each with its style; unfinished ones (`unfinished`), like
    abstract ones, are the bases of the others, not optimizers to offer."""
    return [(cls, style) for cls, style in _defined_classes(module) if unfinished(cls, style) is None]


def _defined_classes(module: ModuleType) -> list[tuple[type, str]]:
    found = []
    for value in vars(module).values():
        if inspect.isclass(value) and value.__module__ == module.__name__ and not inspect.isabstract(value):
            style = style_of(value)
            if style is not None:
                found.append((value, style))
    return found


# What each style's base class leaves to its subclasses, and what the missing part is for. A class
# inheriting the base's own is unfinished: a base class for a file's other optimizers, or a mistake.
# Any one of a line's methods suffices (Keras's LossScaleOptimizer overrides `apply`, not `update_step`).
_UPDATE_METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("step",), "step(self, closure=None), which updates each p in group['params'] from p.grad"),
    "keras": (
        # `_resource_apply_dense` too: a class written for tf.keras's API (lion-tf) is finished there,
        # and building it under Keras 3 tells its user so (see `construct`).
        (
            "update_step",
            "apply",
            "apply_gradients",
            "_backend_update_step",
            "stateless_apply",
            "_resource_apply_dense",
        ),
        "update_step(self, gradient, variable, learning_rate)",
    ),
    "tf_legacy": (
        ("_resource_apply_dense", "apply_gradients", "_distributed_apply"),
        "_resource_apply_dense(self, grad, var, apply_state=None)",
    ),
}


def _takes_keywords_on(cls: type) -> bool:
    """Whether the class's own constructor takes **kwargs; True where its signature cannot be read."""
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def update_methods(style: str) -> tuple[str, ...]:
    """The methods any one of which makes a class of `style` update (a Keras 3 class's own `apply`
    does, without `update_step`)."""
    return _UPDATE_METHODS[style][0]


def unfinished(cls: type, style: str) -> str | None:
    """What `cls` leaves to its framework's base class that the base cannot do, as the end of a
    sentence about it; None for a class that can be built and stepped. torch's Optimizer takes its
    defaults as a dict no job or check can give, and steps nothing: its `step` raises a bare
    NotImplementedError, as Keras's `update_step` and tf.keras's `_resource_apply_dense` do. A torch
    class that takes a hyperparameter where the parameters go cannot be built either
    (`_hyperparameter_first`); a subclass that takes them first can."""
    base = _style_base(style)
    if style == "torch" and cls.__init__ is base.__init__:  # type: ignore[misc]
        return (
            "defines no __init__: torch.optim.Optimizer's own takes (params, defaults), a dict no job can "
            "give; define __init__(self, params, lr=..., ...) that checks each argument and calls "
            "super().__init__(params, dict(lr=lr, ...))"
        )
    if style == "torch" and (first := _hyperparameter_first(cls)) is not None:
        return first
    names, wanted = _UPDATE_METHODS[style]
    # torch wraps `step` in a profiling hook on a class's first instance: compare what is wrapped.
    if all(_method(cls, n) is _method(base, n) for n in names):
        return f"defines no {names[0]}(), so it updates nothing; define {wanted}"
    return None


def _hyperparameter_first(cls: type) -> str | None:
    """Why a torch class whose first argument is a number with a default (AGI-Arena's MARS_M and
    Moonlight: `(lr=1e-3, wd=0.1, muon_params=None, ..., adamw_params=None)`) cannot be built as jobs
    and checks build every torch optimizer, `cls(params, **hyperparameters)`: the parameters would
    land in that argument (`optlab check` had skipped all its checks over "got multiple values for
    argument 'lr'" and exited 0). Which of its keyword arguments takes which parameters is the
    class's own convention (Moonlight asserts that `muon_params` are matrices), so optlab does not
    guess it: a subclass that takes the parameters first and hands them on says it. None for any
    other class."""
    first = _first_positional(cls)
    if first is None or not is_number(first.default):
        return None
    keywords = [name for name in inspect.signature(cls).parameters if "param" in name]
    takes = (
        f"its parameters by keyword ({', '.join(keywords)})"
        if keywords
        else "no argument named for parameters"
    )
    hand_on = ", ".join([f"{first.name}={first.name}", *(f"{name}=..." for name in keywords)])
    return (
        f"takes {first.name}={first.default!r} first, where a torch optimizer takes its parameters, and "
        f"{takes}: optlab builds every torch optimizer as cls(params, **hyperparameters), the "
        f"parameters first as in torch.optim.Optimizer(params, defaults), so they would land in "
        f"{first.name!r}; define a subclass whose __init__(self, params, {first.name}={first.default!r}, "
        f"...) hands them on as the class expects (super().__init__({hand_on}, ...)), and check or "
        "register that"
    )


def _method(owner: type, name: str) -> Any:
    """What `owner.name` runs, under any wrapper; None where it has none."""
    method = getattr(owner, name, None)
    return inspect.unwrap(method) if callable(method) else method


def _style_base(style: str) -> Any:
    """The class every optimizer of `style` subclasses; None where its framework was never imported
    (a class cannot subclass it then, and looking must not import it)."""
    if style == "torch":
        torch = sys.modules.get("torch")
        return None if torch is None else torch.optim.Optimizer
    if style == "keras":
        keras = sys.modules.get("keras")
        return None if keras is None else keras.optimizers.Optimizer
    if "tf_keras" not in sys.modules:
        return None
    return importlib.import_module("tf_keras.src.optimizers.legacy.optimizer_v2").OptimizerV2


def style_of(cls: type) -> str | None:
    """torch, keras or tf_legacy, from the class's bases; None for anything else.

    Only frameworks already imported are consulted: a class cannot subclass a framework
    that was never imported, and checking must not import one.
    """
    for style in ("torch", "tf_legacy", "keras"):
        base = _style_base(style)
        if base is not None and issubclass(cls, base):
            return style
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()  # a 0-d tensor default, as torch allows for lr
    return value


def _unannotated_value(arg: inspect.Parameter) -> bool:
    """An argument without annotation that is not the base a wrapper wraps or the model one is built
    over (their needs serve those): it takes a value the class judges, as an unannotated `x=None` does."""
    return arg.annotation is inspect.Parameter.empty and arg.name not in (*BASE_ARGUMENTS, *MODEL_ARGUMENTS)


def _plain_default_of(kind: ParamType, default: Any, choices: tuple[str, ...] = ()) -> bool:
    """Whether `default` is a value of `kind` (or None, "off"), as a job could send it. A sentinel
    (heavyball's `palm: bool = use_default`, an `object()` that means "decide later") is not: such an
    argument is left to the class, as untunable ones are, or the catalogue could not be written as
    JSON and every job would pass the sentinel on as if the user had chosen it."""
    if default is None or kind in ("float_pair", "float_tuple", "int_list", "float_list"):  # numbers only
        return True
    if kind == "bool":
        return isinstance(default, bool)
    if kind == "str":
        return is_option_text(default)
    if kind == "choice":
        return default in choices
    return is_number(default)


def _infer_type(annotation: Any, default: Any = inspect.Parameter.empty) -> ParamType | None:
    """The type from the annotation (an optional one's: `float | None` is a float; `Literal` strings
    a `choice`), else from the default (an unannotated None: `any`); None for an argument that is not
    tunable."""
    named: dict[str, ParamType] = {"float": "float", "int": "int", "bool": "bool", "str": "str"}
    annotation = _without_none(annotation)
    if _literal_strings(annotation):
        return "choice"
    if isinstance(annotation, str) and annotation in named:  # postponed annotations
        return named[annotation]
    if annotation in (float, int, bool, str):
        return named[annotation.__name__]
    if _number_or_tensor(annotation):
        return "number"  # AliG's `max_lr: float | Tensor | None = None` had been left out of the catalogue
    if default is inspect.Parameter.empty:
        return None
    if default is None and annotation is inspect.Parameter.empty:
        return "any"  # unannotated `beta1=None` (transformers' Adafactor): the class judges what is sent
    if isinstance(default, bool):
        return "bool"
    if is_number(default):
        # Unannotated `weight_decay=0` is a float in practice: accept any number as given.
        return "number"
    if isinstance(default, str):
        return "str"
    if isinstance(default, tuple) and all(is_number(x) for x in default):
        if len(default) == 2:
            return "float_pair"
        if 3 <= len(default) <= MAX_LIST_LENGTH:
            return "float_tuple"  # Adan's three `betas`, TRAC's six
    if isinstance(default, list) and 1 <= len(default) <= MAX_LIST_LENGTH and all(map(is_number, default)):
        # `betas=[0.9, 0.999]`, written as a list: a list again, as the class's default is.
        return "int_list" if all(isinstance(x, int) for x in default) else "float_list"
    return None


def _number_or_tensor(annotation: Any) -> bool:
    """`float | Tensor` (or with `int`, or `None`): torch's way of taking a number or a tensor holding
    one, as its own `lr: float | Tensor` does; tensorflow-addons' `Union[FloatTensorLike, Callable]`
    (a tensor, a float or a numpy float, or a schedule) too, whose required `weight_decay` no job or
    check could give. A number here: JSON carries no tensor and no callable."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False  # `tuple[float, float]` has float arguments too, and is a pair
    names = {getattr(arg, "__name__", "") for arg in typing.get_args(annotation) if arg is not type(None)}
    return "float" in names and bool(names & {"Tensor", "Callable"}) and names <= _NUMBER_LIKE


# What a number may also be taken as, by name: a tensor (torch's, TensorFlow's), a numpy scalar, a
# variable, or a schedule (a callable of the step).
_NUMBER_LIKE = frozenset(
    {"float", "int", "Tensor", "Variable", "float16", "float32", "float64", "int32", "int64", "Callable"}
)


# The spellings of "X or None" a postponed annotation (a string) has, X a plain name.
_OPTIONAL_SPELLINGS = tuple(
    re.compile(pattern)
    for pattern in (
        r"(?:typing\.)?Optional\[(\w+)\]",
        r"(?:typing\.)?Union\[(\w+),None\]",
        r"(?:typing\.)?Union\[None,(\w+)\]",
        r"(\w+)\|None",
        r"None\|(\w+)",
    )
)


def _without_none(annotation: Any) -> Any:
    """`X | None`, `Optional[X]` or `Union[X, None]`, as an object or a string: X; else as given."""
    if isinstance(annotation, str):
        spelled = annotation.replace(" ", "").strip("\"'")  # quoted again where postponed
        for pattern in _OPTIONAL_SPELLINGS:
            match = pattern.fullmatch(spelled)
            if match:
                return match.group(1)
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        others = [member for member in members if member is not type(None)]
        if len(others) == 1 and len(members) == 2:
            return others[0]
    return annotation


def _allows_none(annotation: Any) -> bool:
    """Whether the annotation takes None besides its type (`X | None`, `Optional[X]`)."""
    if isinstance(annotation, str):
        return _without_none(annotation) != annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(annotation)


def _enum_of(annotation: Any, default: Any) -> type[enum.Enum] | None:
    """The enum an argument takes a member of: its annotation's (`X` or `X | None`), or an unannotated
    default's."""
    annotated = _without_none(annotation)
    if isinstance(annotated, type) and issubclass(annotated, enum.Enum):
        return annotated
    if annotation is inspect.Parameter.empty and isinstance(default, enum.Enum):
        return type(default)
    return None


def _literal_strings(annotation: Any) -> tuple[str, ...]:
    """The values of `Literal["a", "b"]` (an object or a postponed string), if all are strings."""
    if isinstance(annotation, str):
        try:
            node = ast.parse(annotation.strip(), mode="eval").body
        except SyntaxError:
            return ()
        if not isinstance(node, ast.Subscript) or ast.unparse(node.value) not in _LITERAL_SPELLINGS:
            return ()
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        values = [element.value for element in elements if isinstance(element, ast.Constant)]
    elif typing.get_origin(annotation) is typing.Literal:
        values = list(typing.get_args(annotation))
    else:
        return ()
    strings = tuple(value for value in values if isinstance(value, str))
    return strings if strings and len(strings) == len(values) else ()


_LITERAL_SPELLINGS = ("Literal", "typing.Literal", "typing_extensions.Literal")


def _resolved(annotation: Any, cls: type) -> Any:
    """A postponed annotation (a string) evaluated in the constructor's module, as
    `typing.get_type_hints` does, one argument at a time: a name imported only for type checkers
    (`if TYPE_CHECKING: from torch.optim.optimizer import ParamsT`) leaves that one a string."""
    if not isinstance(annotation, str):
        return annotation
    namespace = getattr(getattr(cls, "__init__", None), "__globals__", None)
    if namespace is None:
        return annotation
    try:
        return eval(annotation, dict(namespace))  # the class's own annotation, as typing evaluates it
    except Exception:
        return annotation


def _without_url(line: str, url: str) -> str:
    """A docstring's first line less the reference URL in brackets that ends it (`Lion
    (https://arxiv.org/abs/2302.06675)` -> `Lion`): the catalogue had shown it twice. One the sentence
    reads on (`Paper: https://...`) stays."""
    if not url:
        return line
    ending = re.compile(r"\s*[(\[<]\s*" + re.escape(url) + r"\s*[)\]>]\.?\s*$")
    return ending.sub("", line) or line


def _first_url(text: str) -> str:
    match = re.search(r"https?://\S+?(?=[\s)>\]]|$)", text)
    return match.group(0) if match else ""
