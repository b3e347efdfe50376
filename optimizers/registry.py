"""The optimizer catalogue: one registry fed by built-ins, entry points and plugin folders.

Optimizer code is only ever loaded from those three places, never from a request.
A plugin file needs no import of optlab: every optimizer class *defined* in it is
registered under its `optlab_name` attribute, else its class name in snake_case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from optimizers.hyperparams import Param, ParamType, check_all

ENTRY_POINT_GROUP = "optlab.optimizers"
PLUGIN_DIRS_ENV = "OPTLAB_PLUGIN_DIRS"

BUILTIN_MODULES = (
    "optimizers.torch.ema_momentum",
    "optimizers.torch.sgd",
    "optimizers.torch.adam",
    "optimizers.torch.adamw",
)

# Constructor arguments that are implementation switches, not hyperparameters.
_NOT_HYPERPARAMETERS = {"params", "foreach", "fused", "capturable", "differentiable", "maximize"}


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

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "framework": self.framework,
            "style": self.style,
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "params": [param.to_json() for param in self.params.values()],
            "supports_sparse": self.supports_sparse,
            "summary": self.summary,
            "reference": self.reference,
            "source": self.source,
        }


@dataclass(frozen=True)
class LoadError:
    source: str
    error: str


@dataclass
class Registry:
    entries: dict[str, Entry] = field(default_factory=dict)
    errors: list[LoadError] = field(default_factory=list)

    def add(self, entry: Entry) -> None:
        if entry.name in self.entries:
            first = self.entries[entry.name]
            raise ValueError(
                f"optimizer name {entry.name!r} is registered twice: by {first.source} "
                f"and by {entry.source}; set a distinct `optlab_name` on one of them"
            )
        self.entries[entry.name] = entry

    def get(self, name: str) -> Entry:
        if name not in self.entries:
            raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(sorted(self.entries))}")
        return self.entries[name]

    def build(self, name: str, model_params: Iterable[Any], hyperparams: Mapping[str, Any]) -> Any:
        """Construct optimizer `name` over `model_params`; `lr` maps to the class's own name."""
        entry = self.get(name)
        checked = check_all(hyperparams, entry.params, owner=f"optimizer {name!r}")
        kwargs = {(entry.lr_arg if key == "lr" else key): value for key, value in checked.items()}
        return entry.cls(model_params, **kwargs)

    def load_module(self, module: ModuleType, source: str) -> None:
        """Register every optimizer class defined in `module` (not those it imports)."""
        for cls in _optimizer_classes(module):
            self.add(entry_for_class(cls, source=source))


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


def entry_for_class(cls: type, *, source: str) -> Entry:
    framework, style = _style_of(cls)
    # The class's own docstring only: an undocumented plugin must not borrow torch's.
    doc = inspect.cleandoc(cls.__doc__) if cls.__doc__ else ""
    summary = getattr(cls, "optlab_summary", None) or (doc.splitlines()[0] if doc else "")
    reference = getattr(cls, "optlab_reference", None) or _first_url(doc)
    return Entry(
        name=getattr(cls, "optlab_name", None) or snake_case(cls.__name__),
        framework=framework,
        style=style,
        cls=cls,
        params=derive_params(cls),
        supports_sparse=bool(getattr(cls, "optlab_supports_sparse", False)),
        summary=summary,
        reference=reference,
        source=source,
    )


def derive_params(cls: type) -> dict[str, Param]:
    """Hyperparameters from the constructor signature, ranges from the class's declarations.

    Types and defaults come from the signature (written once, in `__init__`); ranges
    from `optlab_hyperparameters`, the same declarations the constructor validates with.
    Arguments with no default of a tunable type (None, strings, callables) are left out.
    """
    declared: Mapping[str, Param] = getattr(cls, "optlab_hyperparameters", {})
    only: Iterable[str] | None = getattr(cls, "optlab_tunable", None)
    params: dict[str, Param] = {}
    for arg in inspect.signature(cls).parameters.values():  # the constructor's, without self
        if arg.name in _NOT_HYPERPARAMETERS or arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        if only is not None and arg.name not in only:
            continue
        default = _plain(arg.default)
        kind = _infer_type(default, arg.annotation)
        if kind is None:
            continue
        if arg.name in declared:
            param = declared[arg.name]
            if param.type == "float" and isinstance(default, int):
                default = float(default)  # torch writes `momentum=0`
            params[arg.name] = dataclasses.replace(param, default=default)
        elif arg.name == "lr":
            params[arg.name] = Param("lr", "float", default, low=0.0, low_inclusive=False)
        else:
            params[arg.name] = Param(arg.name, kind, default)
    return params


def load_registry(plugin_dirs: Iterable[str] | None = None) -> Registry:
    """Built-ins, then entry points, then plugin folders; failures are kept, not raised."""
    registry = Registry()
    for module_name in BUILTIN_MODULES:
        registry.load_module(importlib.import_module(module_name), source=f"builtin:{module_name}")
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _guarded(
            registry, f"entry point {entry_point.name}", partial(_load_entry_point, registry, entry_point)
        )
    if plugin_dirs is None:
        plugin_dirs = [d for d in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep) if d]
    for directory in plugin_dirs:
        for path in sorted(Path(directory).glob("*.py")):
            _guarded(registry, str(path), partial(_load_plugin_file, registry, path))
    return registry


def _guarded(registry: Registry, source: str, load: Callable[[], None]) -> None:
    # One bad plugin must not hide the others: record the failure and carry on.
    try:
        load()
    except Exception as exc:
        tail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        registry.errors.append(LoadError(source=source, error=tail))


def _load_entry_point(registry: Registry, entry_point: importlib.metadata.EntryPoint) -> None:
    loaded = entry_point.load()
    source = f"entry point {entry_point.name} ({entry_point.value})"
    if isinstance(loaded, ModuleType):
        registry.load_module(loaded, source=source)
    else:
        registry.add(entry_for_class(loaded, source=source))


def _load_plugin_file(registry: Registry, path: Path) -> None:
    # The path's hash keeps same-named files in two plugin folders apart.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    module_name = f"optlab_plugin_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # leave no half-imported module behind
        raise
    found = _optimizer_classes(module)
    if not found:
        raise ValueError(f"{path} defines no optimizer class (a subclass of torch.optim.Optimizer)")
    registry.load_module(module, source=f"plugin {path}")


def _optimizer_classes(module: ModuleType) -> list[type]:
    import torch

    return [
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and issubclass(value, torch.optim.Optimizer)
        and not inspect.isabstract(value)
    ]


def _style_of(cls: type) -> tuple[str, str]:
    import torch

    if issubclass(cls, torch.optim.Optimizer):
        return "torch", "torch"
    raise TypeError(
        f"{cls.__module__}.{cls.__qualname__} is not an optimizer: expected a subclass of "
        "torch.optim.Optimizer"
    )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()  # a 0-d tensor default, as torch allows for lr
    return value


def _infer_type(default: Any, annotation: Any) -> ParamType | None:
    if default is inspect.Parameter.empty:
        return None
    named: dict[str, ParamType] = {"float": "float", "int": "int", "bool": "bool"}
    if isinstance(annotation, str) and annotation in named:  # postponed annotations
        return named[annotation]
    if annotation in (float, int, bool):
        return named[annotation.__name__]
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int | float):
        # Unannotated `weight_decay=0` is a float in practice: accept any number as given.
        return "number"
    if (
        isinstance(default, tuple)
        and len(default) == 2
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in default)
    ):
        return "float_pair"
    return None


def _first_url(text: str) -> str:
    match = re.search(r"https?://\S+?(?=[\s)>\]]|$)", text)
    return match.group(0) if match else ""
