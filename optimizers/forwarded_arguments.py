"""A constructor's arguments, those it takes through `**kwargs` and hands on unchanged included.

A subclass that adds one argument and passes the rest on (`class GCAdamW(torch.optim.AdamW)` with
`def __init__(self, params, centralize=True, **kwargs): super().__init__(params, **kwargs)`) takes
AdamW's `lr`, `betas` and `weight_decay` as surely as AdamW does; reading its own signature alone,
the catalogue had none of them, so no job could set its learning rate. The arguments are followed
only where the source shows them handed on untouched: `**kwargs` named nowhere else in the
constructor (a `kwargs.setdefault("momentum", 0.9)` changes a default the next signature states)
and passed in one call to the next class's constructor. Never into the framework's base class,
whose options are left out of the catalogue on purpose.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Argument:
    """A named constructor argument and the class whose constructor declares it (its annotations
    are that class's module's)."""

    parameter: inspect.Parameter
    declared_by: type


@dataclass(frozen=True)
class _Handoff:
    """A constructor's one call handing its **kwargs on: to whom, and what the call fills itself."""

    to: type
    positional: int  # how many of the next constructor's leading arguments the call passes
    keywords: frozenset[str]


def constructor_arguments(cls: type, framework_base: type | None) -> list[Argument]:
    """The named arguments of `cls(...)`, then those of each constructor its **kwargs reach, less
    what the forwarding call fills itself and what came before."""
    owner = _constructor_owner(cls)
    found = [
        Argument(p, owner or cls)
        for p in inspect.signature(cls).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    stop = set(framework_base.__mro__) if framework_base is not None else {object}
    while owner is not None:
        handoff = _handoff(owner)
        if handoff is None or handoff.to in stop:
            break
        seen = {argument.parameter.name for argument in found}
        found += [
            Argument(p, handoff.to)
            for p in _named_after(handoff)
            if p.name not in seen and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        owner = handoff.to
    return found


def reaches_the_base(cls: type, framework_base: type, argument: str) -> bool | None:
    """Whether `argument`, given to `cls(...)` as a keyword it does not name, reaches
    `framework_base`'s own constructor through the **kwargs each constructor hands on untouched:
    False where one takes no **kwargs (it refuses the keyword) or the call into the base fills it
    itself (`super().__init__(learning_rate=1.0, **kwargs)`, or by position: `learning_rate` is the
    first of Keras 3's); None where the source does not say (unreadable, kwargs changed on the way)."""
    owner = _constructor_owner(cls)
    stop = set(framework_base.__mro__)
    while owner is not None and owner not in stop:
        try:
            parameters = inspect.signature(vars(owner)["__init__"]).parameters.values()
        except (TypeError, ValueError):
            return None
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return False
        handoff = _handoff(owner)
        if handoff is None:
            return None
        if handoff.to in stop:
            leading = _leading_arguments(handoff.to)[: handoff.positional]
            return argument not in handoff.keywords and argument not in leading
        owner = handoff.to
    return None


def _leading_arguments(base: type) -> list[str]:
    """The positional argument names of the first constructor in `base`'s MRO that names any (Keras
    3's TensorFlow optimizer takes `*args, **kwargs` on to BaseOptimizer's `learning_rate, ...`)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for klass in base.__mro__:
        if "__init__" not in vars(klass):
            continue
        try:
            parameters = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        except (TypeError, ValueError):
            continue
        names = [p.name for p in parameters if p.kind in positional]
        if names:
            return names
    return []


def _constructor_owner(cls: type) -> type | None:
    """The class of the MRO whose `__init__` a call of `cls` runs."""
    return next((k for k in cls.__mro__ if "__init__" in vars(k)), None)


def _named_after(handoff: _Handoff) -> list[inspect.Parameter]:
    """The next constructor's arguments (without `self`) the forwarding call leaves to **kwargs."""
    try:
        parameters = list(inspect.signature(handoff.to.__init__).parameters.values())[1:]  # type: ignore[misc]
    except (TypeError, ValueError):  # a constructor written in C states none
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    filled = {p.name for p in [p for p in parameters if p.kind in positional][: handoff.positional]}
    return [p for p in parameters if p.name not in filled and p.name not in handoff.keywords]


def _handoff(owner: type) -> _Handoff | None:
    """`owner.__init__`'s one call passing its **kwargs on untouched, or None: no **kwargs, no
    source to read, kwargs used otherwise too, several calls, a starred positional argument, or
    a next class that cannot be told from the source."""
    init = inspect.unwrap(vars(owner)["__init__"])
    try:
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):  # a constructor written in C states none
        return None
    var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    function = _parsed(init)
    if var_keyword is None or function is None:
        return None
    nodes = list(ast.walk(function))
    uses = [node for node in nodes if isinstance(node, ast.Name) and node.id == var_keyword]
    calls = [node for node in nodes if isinstance(node, ast.Call) and _hands_on(node, var_keyword)]
    if len(uses) != 1 or len(calls) != 1:
        return None
    call = calls[0]
    target = call.func.value if isinstance(call.func, ast.Attribute) else None
    args = list(call.args)
    if _is_super(target):
        to = next((k for k in owner.__mro__[owner.__mro__.index(owner) + 1 :] if "__init__" in vars(k)), None)
    elif target is not None and _dotted(target):  # Parent.__init__(self, ...), torch.optim.SGD.__init__
        to = _looked_up(_dotted(target), getattr(init, "__globals__", {}))
        args = args[1:]
    else:
        return None
    if not isinstance(to, type) or not issubclass(owner, to) or any(isinstance(a, ast.Starred) for a in args):
        return None
    runs = _constructor_owner(to)  # the `__init__` that call runs, maybe inherited by `to`
    if runs is None:
        return None
    return _Handoff(runs, len(args), frozenset(k.arg for k in call.keywords if k.arg is not None))


def _parsed(function: Any) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef) else None


def _hands_on(call: ast.Call, var_keyword: str) -> bool:
    """A call of some `__init__` with `**<var_keyword>` among its arguments."""
    return (
        isinstance(call.func, ast.Attribute)
        and call.func.attr == "__init__"
        and any(
            k.arg is None and isinstance(k.value, ast.Name) and k.value.id == var_keyword
            for k in call.keywords
        )
    )


def _dotted(node: ast.expr) -> list[str]:
    """`a.b.C` as its names; [] for any other expression."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return [*head, node.attr] if head else []
    return []


def _looked_up(names: list[str], namespace: dict[str, Any]) -> Any:
    value = namespace.get(names[0])
    for name in names[1:]:
        value = getattr(value, name, None)
    return value


def _is_super(node: ast.expr | None) -> bool:
    """`super()` or `super(Cls, self)`."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
