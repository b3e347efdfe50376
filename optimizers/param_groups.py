"""Param-group recipes: which model parameters get which hyperparameters.

A job's `optimizer.param_groups` is a list of rules, each a `match` (tensor dimension and/or
parameter-name glob) and the `params` its parameters get, e.g. no weight decay on biases and
norms (`{"ndim": "<2"}`) or a smaller rate for the head (`{"name": "logits.*"}`). The first
rule that matches a parameter wins; parameters no rule matches form a last group with the
optimizer's own params. Written once over `(name, shape)` pairs, so any framework's driver can
turn the result into its own groups.

Pure Python: the API validates `ndim` comparisons with it.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
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
) -> list[Group]:
    """The groups a recipe makes of a model's parameters: one per rule, then the unmatched ones.

    A rule that matches no parameter is an error (a typo in a name glob would otherwise train
    silently with the optimizer's own params); the message lists the parameters there are.
    The last group is left out when every parameter matched a rule.
    """
    named = list(named_shapes)
    groups = [Group([], params) for _, params in rules]
    rest = Group([], {})
    for name, shape in named:
        index = next((i for i, (rule, _) in enumerate(rules) if rule.matches(name, shape)), None)
        (rest if index is None else groups[index]).names.append(name)
    for index, group in enumerate(groups):
        if not group.names:
            # Earlier rules may have taken this one's parameters: first match wins.
            there = ", ".join(f"{name} (ndim {len(shape)})" for name, shape in named)
            raise ValueError(
                f"{owner}[{index}] matches no parameter of the model (earlier groups take their matches "
                f"first); the model's parameters: {there}"
            )
    return groups + ([rest] if rest.names else [])
