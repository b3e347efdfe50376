"""Param-group recipes: which model parameters get which hyperparameters.

A job's `optimizer.param_groups` is a list of rules, each a `match` (tensor dimension and/or
parameter-name glob) and the `params` its parameters get, e.g. no weight decay on biases and
norms (`{"ndim": "<2"}`) or a smaller rate for the head (`{"name": "logits.*"}`). The first
rule that matches a parameter wins; parameters no rule matches form a last group with the
optimizer's own params. Written once over `(name, shape)` pairs, so any framework's driver can
turn the result into its own groups.

A rule may also set group keys the optimizer does not catalogue as hyperparameters but reads
from its groups (pytorch-optimizer's Muon family: `use_muon`, and `betas`/`eps` in its AdamW
groups): see `extra_key_problem`.

Pure Python: the API validates `ndim` comparisons and group keys with it.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import inspect
import operator
import re
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_COMPARISON = re.compile(r"^\s*(<=|>=|==|!=|<|>)?\s*([0-9]+)\s*$")
_OPERATORS: dict[str, Callable[[int, int], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
NDIM_ALLOWED = 'a comparison with a whole number: "<2", "<=1", ">=2", "==1", "!=4" or just "2"'


def parse_ndim(text: str) -> Callable[[int], bool]:
    """`"<2"` -> a test on a tensor's number of dimensions; ValueError says what is allowed."""
    found = _COMPARISON.match(text)
    if found is None:
        raise ValueError(f"ndim must be {NDIM_ALLOWED}; received {text!r}")
    compare = _OPERATORS[found.group(1) or "=="]
    bound = int(found.group(2))
    return lambda ndim: compare(ndim, bound)


@dataclass(frozen=True)
class GroupRule:
    """One recipe entry: a parameter matches when every given test holds."""

    ndim: str | None = None
    name: str | None = None

    def matches(self, name: str, shape: Sequence[int]) -> bool:
        if self.ndim is not None and not parse_ndim(self.ndim)(len(shape)):
            return False
        return self.name is None or fnmatch.fnmatchcase(name, self.name)


@dataclass(frozen=True)
class Group:
    """The parameters (by name, in model order) one group holds, and that group's hyperparameters."""

    names: list[str]
    params: Mapping[str, Any]


def assign_groups(
    rules: Sequence[tuple[GroupRule, Mapping[str, Any]]],
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    *,
    owner: str = "optimizer.param_groups",
    skip_unmatched: bool = False,
) -> list[Group]:
    """The groups a recipe makes of a model's parameters: one per rule, then the unmatched ones.

    A rule that matches no parameter is an error (a typo in a name glob would otherwise train
    silently with the optimizer's own params); the message lists the parameters there are.
    `skip_unmatched` leaves such a rule out instead: the checks' few variables are not the
    model the recipe was written for. The last group is left out when every parameter matched
    a rule.
    """
    named = list(named_shapes)
    groups = [Group([], params) for _, params in rules]
    rest = Group([], {})
    for name, shape in named:
        index = _first_match([rule for rule, _ in rules], name, shape)
        (rest if index is None else groups[index]).names.append(name)
    if skip_unmatched:
        groups = [group for group in groups if group.names]
    for index, group in enumerate(groups):
        if not group.names:
            raise ValueError(f"{owner}[{index}] {matches_nothing(named, 'the model')}")
    return groups + ([rest] if rest.names else [])


def unmatched_rule(
    rules: Sequence[GroupRule], named_shapes: Iterable[tuple[str, Sequence[int]]]
) -> int | None:
    """The first rule that no parameter is left for (first match wins), or None."""
    taken = {_first_match(rules, name, shape) for name, shape in named_shapes}
    return next((i for i in range(len(rules)) if i not in taken), None)


def _first_match(rules: Sequence[GroupRule], name: str, shape: Sequence[int]) -> int | None:
    """The index of the rule that takes a parameter: the first that matches it."""
    return next((i for i, rule in enumerate(rules) if rule.matches(name, shape)), None)


def matches_nothing(named_shapes: Iterable[tuple[str, Sequence[int]]], model: str) -> str:
    """The end of a sentence about a rule that takes no parameter of `model`."""
    there = ", ".join(f"{name} (ndim {len(shape)})" for name, shape in named_shapes)
    # Earlier rules may have taken this one's parameters: first match wins.
    return (
        f"matches no parameter of {model} (earlier groups take their matches first); its parameters: {there}"
    )


# What a group key the optimizer does not catalogue may be set to: JSON has no tuples, and a
# group's pair (`betas`) is read by unpacking, so a list of numbers becomes a tuple.
EXTRA_VALUE_ALLOWED = "true/false, a number, a string or a list of numbers"
# Declares group keys a class reads that its source does not show as literals (`group[key]`).
GROUP_KEYS_ATTRIBUTE = "optlab_group_keys"
# Keys of a torch param group that the recipe itself fills: its match chooses the parameters.
RESERVED_GROUP_KEYS = frozenset({"params", "param_names"})
# What torch's own Optimizer reads by these literals: its implementation switches (which no job sets,
# as the catalogue leaves them out: `capturable` on a CPU job fails in the step) and its state_dict's
# layout. A class that offers one as a hyperparameter (the built-ins' `fused`) catalogues it.
TORCH_OWN_KEYS = frozenset(
    {"capturable", "differentiable", "foreach", "fused", "maximize", "state", "param_groups"}
)


def extra_key_value(key: str, value: Any) -> Any:
    """`value` as a param group gets it for `key`, a group key that is no catalogued hyperparameter;
    ValueError says what is allowed. Passed as given (a list as a tuple): the optimizer, not the
    catalogue, knows what the key means, so there is no range to check."""
    if isinstance(value, bool | str) or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(item, int | float) and not isinstance(item, bool) for item in value
    ):
        return tuple(value)
    shown = "null" if value is None else repr(value)
    raise ValueError(
        f"{key} is not a catalogued hyperparameter, so a param group passes it to the optimizer as given: "
        f"it must be {EXTRA_VALUE_ALLOWED}; received {shown}"
    )


def extra_key_problem(
    key: str, value: Any, *, owner: str, declared: Collection[str], reads: Collection[str] | None
) -> str | None:
    """Why a param group cannot set `key`, which `owner` does not catalogue, to `value`, else None.

    The rule: a param group may set a key the optimizer reads from its groups without declaring it
    (Muon's `use_muon`), to a JSON scalar or a list of numbers, passed as given. `reads` are the group
    keys the class's source reads (`read_group_keys`; None when its source cannot be read): a key it
    never reads is refused, so a misspelt hyperparameter is an error rather than a key nobody reads.
    """
    if key in RESERVED_GROUP_KEYS:
        return f"{key} is the group's parameters, which its match chooses; leave {key!r} out of params"
    if key in TORCH_OWN_KEYS and (reads is None or key not in reads):
        return (
            f"{owner} does not take {key!r} as a hyperparameter: it is torch's own (an implementation "
            f"switch, or the state_dict's layout), which a param group may not set; leave it out"
        )
    if reads is not None and key not in reads:
        accepted = ", ".join(declared) or "none"
        others = sorted(set(reads) - set(declared))
        return (
            f"{owner} has no hyperparameter {key!r} and its source reads no group key {key!r}; accepted: "
            f"{accepted}, or a group key it reads ({', '.join(others) or 'none'}; a class that reads "
            f"others declares them in `{GROUP_KEYS_ATTRIBUTE}`)"
        )
    try:
        extra_key_value(key, value)
    except ValueError as exc:
        return str(exc)
    return None


@functools.cache
def read_group_keys(cls: type) -> frozenset[str] | None:
    """The string keys the class (and its bases) read or write by subscript, `.get`, `.setdefault`,
    `.pop` or `in`, except those it only ever uses on a parameter's state: a superset of the group
    keys its step reads, enough to tell a real key from a typo. None when a class's source cannot be
    read; `optlab_group_keys` adds keys."""
    found: set[str] = set()
    for klass in cls.__mro__:
        keys = _keys_in_source(klass) if klass is not object else frozenset()
        if keys is None:
            return None
        found.update(keys)
    # torch's own keys read in a source are its base class's; a class that declares one reads it itself.
    found -= TORCH_OWN_KEYS
    found |= set(getattr(cls, GROUP_KEYS_ATTRIBUTE, ()) or ())
    return frozenset(key for key in found if not key.startswith("_") and key not in RESERVED_GROUP_KEYS)


@functools.cache
def _keys_in_source(klass: type) -> frozenset[str] | None:
    """One class's own literal keys (cached: every torch optimizer shares torch's base class), less
    those every function uses only on a parameter's state."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return None
    kept: set[str] = set()
    in_functions: set[int] = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            states = _state_names(function)  # per function: `state` may be an argument elsewhere
            for key, receiver, node in _literal_keys(function):
                in_functions.add(id(node))
                if not _is_state(receiver, states):
                    kept.add(key)
    kept.update(key for key, _, node in _literal_keys(tree) if id(node) not in in_functions)
    return frozenset(kept)


def _literal_keys(tree: ast.AST) -> Iterable[tuple[str, ast.AST | None, ast.AST]]:
    """Each literal key, what it is read from (None for `key in` several things), and its node."""
    for node in ast.walk(tree):
        receiver: ast.AST | None
        if isinstance(node, ast.Subscript):
            key: Any = node.slice
            receiver = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr not in ("get", "setdefault", "pop"):
                continue
            key, receiver = node.args[0], node.func.value
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            key = node.left
            receiver = node.comparators[0] if len(node.comparators) == 1 else None
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield key.value, receiver, node


def _state_names(scope: ast.AST) -> frozenset[str]:
    """Names a function only ever binds to a parameter's state (`state = self.state[p]`): a key read
    from one is a state key (SGD's `momentum_buffer`), which no param group sets."""
    bound: dict[str, bool] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = bound.get(target.id, True) and _is_state(node.value, frozenset())
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            bound.setdefault(node.id, False)  # a loop, a with, a walrus, an annotated or augmented one
        elif isinstance(node, ast.arg):
            bound[node.arg] = False
    # A Name stored by an Assign is also met as a Store above: only Assigns from state keep True.
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Store)
            and not _assigned_plainly(scope, node)
        ):
            bound[node.id] = False
    return frozenset(name for name, only_state in bound.items() if only_state)


def _assigned_plainly(scope: ast.AST, name: ast.Name) -> bool:
    """Whether `name` (a Store) is a whole target of an `=` assignment in `scope`."""
    return any(isinstance(node, ast.Assign) and name in node.targets for node in ast.walk(scope))


def _is_state(node: ast.AST | None, states: frozenset[str]) -> bool:
    """Whether `node` is a parameter's state: `<anything>.state[<key>]`, or a name bound only to one."""
    if isinstance(node, ast.Name):
        return node.id in states
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "state"
    )
