"""What to check: a registered optimizer name, `path/to/file.py:Class` or `package.module:Class`.

A class is checked exactly as the registry would catalogue it (same hyperparameters,
same `lr` mapping), so a class that passes here behaves the same once registered.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.frameworks import needs_legacy_keras_process
from jobs.processes import in_legacy_keras_process
from jobs.spec import STYLES_OF_FRAMEWORK
from jobs.spec import parse_params as parse_params_json
from optimizers.plugin_import import NotAModule, import_file
from optimizers.registry import (
    PLUGIN_DIRS_ENV,
    STYLES,
    Entry,
    entry_for_class,
    load_registry,
    not_an_optimizer,
    plugin_dirs_from_environment,
    style_of,
)

# Source text that only legacy tf.keras optimizers contain: such a file must be imported
# with TF_USE_LEGACY_KERAS=1, which has to be set before TensorFlow is imported.
_LEGACY_MARKERS = ("optimizers.legacy", "_resource_apply_dense", "_resource_apply_sparse", "tf_keras")


class UsageError(ValueError):
    """The target or the options are wrong (exit status 2), not the optimizer."""


def parse_params(text: str) -> dict[str, Any]:
    """`--params` JSON as a dict (`jobs.spec.parse_params`); UsageError says what is allowed."""
    try:
        return parse_params_json(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Target:
    text: str  # as the user wrote it; a child process resolves the same text again
    entry: Entry

    @property
    def cls(self) -> type:
        return self.entry.cls

    @property
    def style(self) -> str:
        return self.entry.style

    @property
    def framework(self) -> str:
        return self.entry.framework

    @property
    def name(self) -> str:
        """The registered name; for a class reference, the class's own name (`RMSprop`, not
        the `rm_sprop` the registry would derive) unless it sets `optlab_name`."""
        if is_class_reference(self.text) and not getattr(self.cls, "optlab_name", None):
            return self.cls.__name__
        return self.entry.name

    @property
    def qualname(self) -> str:
        """`package.module.Class`; for a class loaded from a file, `path/file.py:Class`
        (its module name is one this checker made up)."""
        if is_class_reference(self.text) and self.text.rsplit(":", 1)[0].endswith(".py"):
            return self.text
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def source_file(self) -> str | None:
        try:
            return inspect.getsourcefile(self.cls)
        except TypeError:
            return None

    def class_location(self) -> str:
        """`file.py:line` of the class statement, or the class's qualified name."""
        try:
            _, first = inspect.getsourcelines(self.cls)
        except (OSError, TypeError):
            return self.qualname
        return f"{self.source_file()}:{first}"


def is_class_reference(text: str) -> bool:
    return ":" in text


def needs_legacy_keras(text: str, *, style: str | None = None) -> bool:
    """Whether checking `text` should happen in a TF_USE_LEGACY_KERAS=1 process.

    Decided before any import: an explicit style, else a look at the module path or
    the file's source for legacy-only names.
    """
    if style is not None:
        return needs_legacy_keras_process(style)
    if not is_class_reference(text):
        return False
    reference, _ = text.rsplit(":", 1)
    if reference.endswith(".py"):
        return _has_legacy_markers(Path(reference))
    if "legacy" in reference.split(".") or reference.split(".")[0] == "tf_keras":
        return True
    # A module of a package written for tf.keras (TensorFlow Recommenders refuses to import under
    # Keras 3): its source says so as a file's does, read without importing the package.
    source = _module_file(reference)
    return source is not None and _has_legacy_markers(source)


def _has_legacy_markers(path: Path) -> bool:
    try:
        source = path.read_text(errors="replace")
    except OSError:
        return False
    return any(marker in source for marker in _LEGACY_MARKERS)


def _module_file(reference: str) -> Path | None:
    """The source file of module `reference` (`package.sub.module`), found under its top-level
    package's folders without running any of the package's code; None if not found so."""
    top, *rest = reference.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds, does not import
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for folder in spec.submodule_search_locations or ():
        for candidate in (Path(folder, *rest).with_suffix(".py"), Path(folder, *rest, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def resolve_target(
    text: str, *, framework: str | None = None, style: str | None = None, plugin_files: Sequence[str] = ()
) -> Target:
    """The target's registry entry; UsageError says what is wrong with `text` and what is allowed.
    `plugin_files`: where the catalogue found a registered name (optimizers.registry.load_registry)."""
    if framework is not None and framework not in STYLES_OF_FRAMEWORK:
        raise UsageError(f"--framework must be torch or tensorflow; received {framework!r}")
    if style is not None and style not in STYLES:
        raise UsageError(f"--style must be one of {', '.join(STYLES)}; received {style!r}")
    if framework is not None and style is not None and style not in STYLES_OF_FRAMEWORK[framework]:
        # The style alone decides which class is checked: the framework had been ignored in silence.
        raise UsageError(
            f"--style {style} is not a {framework} style ({framework}: "
            f"{', '.join(STYLES_OF_FRAMEWORK[framework])}); give one of those, or leave --framework out"
        )
    if is_class_reference(text):
        entry = _class_entry(text)
        if (style is not None and entry.style != style) or framework not in (None, entry.framework):
            raise UsageError(
                f"{text} is a {entry.style} optimizer; it cannot be checked as {style or framework}"
            )
        return Target(text, entry)
    return Target(text, _registered_entry(text, framework=framework, style=style, plugin_files=plugin_files))


def candidate_styles(framework: str | None, style: str | None) -> tuple[str, ...]:
    if style is not None:
        return (style,)
    return STYLES_OF_FRAMEWORK[framework] if framework is not None else STYLES


def _registered_entry(
    name: str, *, framework: str | None, style: str | None, plugin_files: Sequence[str]
) -> Entry:
    # One style at a time, cheapest framework first, and never both Keras styles in one
    # process: the legacy style is only looked at in a TF_USE_LEGACY_KERAS=1 process.
    legacy_process = in_legacy_keras_process()
    candidates = candidate_styles(framework, style)
    failed: list[str] = []
    for candidate in candidates:
        if needs_legacy_keras_process(candidate) != legacy_process:
            continue
        registry = load_registry(styles=(candidate,), wanted=[name], plugin_files=plugin_files)
        if any(n == name for n, _ in registry.entries):
            return registry.get(name, candidate)
        failed += [
            f"{e.source} ({e.error})" for e in registry.errors if f"{e.source} ({e.error})" not in failed
        ]
    raise UsageError(
        f"no optimizer named {name!r} is registered in the {', '.join(candidates)} style(s); give a "
        "registered name, path/to/file.py:ClassName or package.module:ClassName" + _why_not_here(name, failed)
    )


def _why_not_here(name: str, failed: Sequence[str]) -> str:
    """What most often hides a name a user sees in the service's catalogue: a file given without its
    class, plugin folders this shell does not name, a plugin that failed to load."""
    if name.endswith(".py") and Path(name).is_file():
        defined = ", ".join(_classes_in(Path(name))) or "none"
        return f". {name} is a file: add the class, {name}:ClassName (it defines: {defined})"
    said = ""
    folders = plugin_dirs_from_environment()
    if not folders:
        said += (
            f". {PLUGIN_DIRS_ENV} is not set in this shell, so no plugin folder was read: set it to the "
            "service's plugin folders, or check on the service with --remote URL"
        )
    missing = [str(folder) for folder in folders if not folder.is_dir()]
    if missing:  # a typo in the folder read as the name not being registered
        said += f". {PLUGIN_DIRS_ENV} names {', '.join(missing)}, which is not a folder here"
    if failed:
        said += f". These failed to load: {'; '.join(failed[:3])}"
    return said


def _classes_in(path: Path) -> list[str]:
    """The classes a Python file defines at its top level, read without running it."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    return [
        node.name for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
    ]


def _class_entry(text: str) -> Entry:
    reference, class_name = text.rsplit(":", 1)
    if not class_name.isidentifier():
        raise UsageError(f"{text!r}: {class_name!r} after the colon is not a class name")
    if not reference.strip():
        raise UsageError(
            f"{text!r}: nothing before the colon; give path/to/file.py:ClassName or package.module:ClassName"
        )
    module = _import_file(Path(reference)) if reference.endswith(".py") else _import_module(reference)
    cls: Any = getattr(module, class_name, None)
    if cls is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and not k.startswith("_"))
        listed = ", ".join(defined) or "none"
        raise UsageError(f"{reference} has no class {class_name!r}; it defines: {listed}")
    if not inspect.isclass(cls) or style_of(cls) is None:
        raise UsageError(f"{text} is not an optimizer class: {not_an_optimizer(cls)}")
    try:
        return entry_for_class(cls, source=text)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{text}: {exc}") from None


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            hint = "is its package installed, or on PYTHONPATH?"
            raise UsageError(f"no module named {name!r} ({hint})") from None
        raise


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise UsageError(f"file not found: {path}")
    try:
        return import_file(path, prefix="optlab_check", reuse=True)
    except NotAModule as exc:
        raise UsageError(str(exc)) from None
