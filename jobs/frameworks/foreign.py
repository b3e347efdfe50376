"""Methods of another optimizer API that a style's framework never calls: a port from tf.keras to
Keras 3 that kept `_resource_apply_dense`, a gradient change written in `get_gradients`. The code in
them never runs, and the class steps with what it inherits in their place (Adam's update, the
gradients as taken) or meets the base's NotImplementedError. Each driver names the methods of its
style (`Driver.foreign_methods`); the rule and its words are here, for the checks and the jobs alike.

Never a false alarm: a method counts only where the driver's table names it, the class defines none
of the methods the style calls in its place, and no code in the class's files names it outside its
own body (a call, getattr with its name, a string built around it).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FunctionType
from typing import Any

from optimizers.loop_needs import user_classes

# A string piece this long that is part of a method's name (`f"_resource_apply_{kind}"`) may name it.
_NAMING_PIECE = 8


@dataclass(frozen=True)
class ForeignMethod:
    """What a driver knows of one method of another API."""

    said: str  # what it is, in words: "a method of ..., which Keras 3 never calls"
    instead: tuple[str, ...]  # what the style calls in its place: a class defining one is left alone
    fix: str
    # The class's update or its change of the gradients: a fault on its own. False for setup (slots):
    # named only to explain a first step that raised.
    own_work: bool = True
    lost: str = ""  # what the class's steps lose, where its update still runs ("" for the update)
    # The arguments (after self) the other API calls it with, by name, where its name alone does not
    # make it that API's (`get_gradients(loss, params)`); None: any definition of the name is.
    called_with: tuple[str, ...] | None = None
    # Whether it changes the gradients: then a method of `instead` that hands on to the base's is
    # where the class moved that change; an update handed on to the base's is no update of its own.
    changes_gradients: bool = False


@dataclass(frozen=True)
class Foreign:
    """A method of another API that a class defines and nothing of its own calls."""

    name: str
    method: ForeignMethod
    where: str  # `file:line` of its def, or the class's qualified name


def never_called(cls: type, table: Mapping[str, ForeignMethod]) -> list[Foreign]:
    """The methods of `table` that `cls`'s own code defines and that nothing of its own could call."""
    own = user_classes(cls)
    found = []
    for name, method in table.items():
        defining = [k for k in own if isinstance(vars(k).get(name), FunctionType)]
        if not defining or not _called_as(vars(defining[0])[name], method.called_with):
            continue
        if all(_passes_through(vars(k)[name]) for k in defining):
            continue  # nothing of the class's own is lost where it only hands on super()'s
        if _has_its_own(own, method):
            continue  # written for both APIs: the style's own method is there too
        if _named_in_code_of(own, name):
            continue
        found.append(Foreign(name, method, _location(defining[0], name)))
    return found


def told(cls: type, foreign: Foreign, api: str, also: Sequence[Foreign] = ()) -> str:
    """What a method that never runs is, and what the framework (`api`, in words) does instead;
    `also`: more such methods, named."""
    others = f" (nor does {', '.join(f.name for f in also)})" if also else ""
    return (
        f"{cls.__qualname__}.{foreign.name} never runs{others}: it is {foreign.method.said}; "
        + in_its_place(cls, foreign, api)
    )


def in_its_place(cls: type, foreign: Foreign, api: str) -> str:
    """What the framework calls instead, and where the class gets it from."""
    instead, owner = _instead(cls, foreign)
    if owner is None:
        return f"{api} calls {instead} in its place, which the class does not have"
    named = f"{owner.__qualname__} ({owner.__module__.split('.')[0]})"
    if _unimplemented_instead(cls, foreign):
        return (
            f"{api} calls {instead} in its place, which the class does not define and {named} leaves "
            "unimplemented (a step raises NotImplementedError)"
        )
    effect = foreign.method.lost or f"the class steps as {named} does"
    return f"{api} calls {instead} in its place, which the class inherits from {named}: {effect}"


def _unimplemented_instead(cls: type, foreign: Foreign) -> bool:
    """Whether what the framework calls in the method's place only raises NotImplementedError (the
    abstract update of the framework's base): every step raises."""
    instead, owner = _instead(cls, foreign)
    return owner is not None and _unimplemented(vars(owner)[instead])


def _instead(cls: type, foreign: Foreign) -> tuple[str, type | None]:
    """The method the framework calls in `foreign`'s place, and the class `cls` has it from."""
    instead = next((n for n in foreign.method.instead if hasattr(cls, n)), foreign.method.instead[0])
    return instead, next((k for k in cls.__mro__ if instead in vars(k)), None)


def _has_its_own(classes: Sequence[type], method: ForeignMethod) -> bool:
    """Whether the classes define a method the style calls in `method`'s place: for an update, one
    that does not merely hand on to the base's of its name (a port's clipping `apply_gradients`
    that calls super()'s leaves the update the base's)."""
    for klass in classes:
        for other in method.instead:
            function = vars(klass).get(other)
            if function is None:
                continue
            if method.changes_gradients or not isinstance(function, FunctionType):
                return True
            if not _hands_on_to_super(function):
                return True
    return False


def _hands_on_to_super(function: FunctionType) -> bool:
    """Whether the method calls the base's method of its own name (`super().apply_gradients(...)`);
    True where its source cannot be read (then it is not taken for an update of its own)."""
    tree = _definition(function)
    if tree is None:
        return True
    return any(_calls_super(node, tree.name) for node in ast.walk(tree))


def _definition(function: FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    return definition if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _passes_through(function: FunctionType) -> bool:
    """Whether the method only returns what the base's method of its name returns for the very
    arguments it was given (`return super().get_gradients(loss, params)`, through a name or not; a
    print left commented out): skipped, it changes nothing. False where its source cannot be read."""
    definition = _definition(function)
    if definition is None:
        return False
    own = [a.arg for a in definition.args.args[1:]]  # after self
    body = [
        s
        for s in definition.body
        if not isinstance(s, ast.Pass) and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    if len(body) == 1 and isinstance(body[0], ast.Return):
        return _calls_super(body[0].value, definition.name, own)
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        assigned, returned = body[0], body[1].value
        named = len(assigned.targets) == 1 and isinstance(assigned.targets[0], ast.Name)
        same = named and isinstance(returned, ast.Name) and assigned.targets[0].id == returned.id  # type: ignore[attr-defined]
        return same and _calls_super(assigned.value, definition.name, own)
    return False


def _calls_super(node: ast.AST | None, name: str, arguments: Sequence[str] | None = None) -> bool:
    """`super().<name>(...)`, or `super(Cls, self).<name>(...)`; with `arguments`, passing exactly
    those names, in order (`super().get_gradients(loss * scale, params)` changes something)."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "super"
    ):
        return False
    if arguments is None:
        return True
    passed = [a.id if isinstance(a, ast.Name) else None for a in node.args]
    passed += [
        k.value.id if isinstance(k.value, ast.Name) and k.arg == k.value.id else None for k in node.keywords
    ]
    return passed == list(arguments)


def _called_as(function: FunctionType, arguments: tuple[str, ...] | None) -> bool:
    """Whether `function` takes the other API's arguments, by name, first after self."""
    if arguments is None:
        return True
    try:
        parameters = list(inspect.signature(function).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return tuple(parameters[: len(arguments)]) == arguments


def _location(klass: type, name: str) -> str:
    try:
        _, first = inspect.getsourcelines(vars(klass)[name])
        return f"{inspect.getsourcefile(klass)}:{first}"
    except (OSError, TypeError):
        return f"{klass.__qualname__}.{name}"


def _named_in_code_of(classes: Sequence[type], name: str) -> bool:
    """Whether code in the classes' files names `name` outside the bodies of methods so named;
    True where a file cannot be read."""
    files = set()
    for klass in classes:
        try:
            files.add(inspect.getsourcefile(klass))
        except TypeError:
            return True
    for file in files:
        if file is None:
            return True
        try:
            with open(file, encoding="utf-8") as source:
                tree = ast.parse(source.read())
        except (OSError, SyntaxError, ValueError):
            return True
        if _names(tree, name):
            return True
    return False


def _names(node: ast.AST, name: str) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
        return False  # the method itself, and a super() call inside it, do not make it called
    if (
        (isinstance(node, ast.Attribute) and node.attr == name)
        or (isinstance(node, ast.Name) and node.id == name)
        or (isinstance(node, ast.Constant) and node.value == name)
    ):
        return True
    if isinstance(node, ast.JoinedStr) and any(
        isinstance(part, ast.Constant)
        and isinstance(part.value, str)
        and len(part.value) >= _NAMING_PIECE
        and part.value in name
        for part in node.values
    ):
        return True
    return any(_names(child, name) for child in ast.iter_child_nodes(node))


def _unimplemented(function: Any) -> bool:
    """Whether a framework's method only raises NotImplementedError (an abstract update)."""
    try:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (
        len(body) == 1
        and isinstance(body[0], ast.Raise)
        and "NotImplementedError" in ast.unparse(body[0].exc or ast.Constant(None))
    )


@contextmanager
def counting_calls(cls: type, names: Sequence[str]) -> Iterator[Counter[str]]:
    """Each of `names` the class's own code defines counts its calls until the block ends; the
    class is given back its own functions after it."""
    calls: Counter[str] = Counter()
    replaced = []
    for klass in user_classes(cls):
        for name in names:
            function = vars(klass).get(name)
            if isinstance(function, FunctionType):
                replaced.append((klass, name, function))
                setattr(klass, name, _counted(function, name, calls))
    try:
        yield calls
    finally:
        for klass, name, function in reversed(replaced):
            setattr(klass, name, function)


def _counted(function: Callable[..., Any], name: str, calls: Counter[str]) -> Callable[..., Any]:
    # Not functools.wraps: autograph converts a function's __wrapped__ source in its place, which
    # would skip the count.
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return function(*args, **kwargs)

    return counted
