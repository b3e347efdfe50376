"""What a class declares in `optlab_hyperparameters`, read into `Param`s and checked.

A declaration is a `Param` (the built-ins') or a plain dict, so that a plugin file needs no
import of optlab: `{"beta": {"low": 0.0, "high": 1.0, "high_inclusive": False}}`. A dict holds
only the range; the type, default, and whether it is required or nullable come from `__init__`'s
signature, as for an argument with no declaration. A mistake in either form is refused naming the
class, the hyperparameter, the key or value and what is allowed: a declaration that silently did
nothing (a misspelt name, a range no value fits) would publish a range nobody enforces.

Pure Python, like `optimizers.hyperparams`: the API process builds its catalogue from it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from optimizers.hyperparams import Param, ParamType

# The keys a plain-dict declaration may hold: Param's fields that describe a range.
RANGE_KEYS = ("low", "high", "low_inclusive", "high_inclusive", "choices", "help")
# Param's fields that the signature gives; a dict that states one is told so.
SIGNATURE_KEYS = ("name", "type", "default", "required", "nullable")
# The types `low`/`high` bound (every number of a list or pair).
NUMBER_TYPES: frozenset[str] = frozenset(
    ("float", "int", "number", "float_pair", "float_tuple", "int_list", "float_list")
)
# The types a `choices` list can narrow: a string argument, which then takes only those values.
TEXT_TYPES: frozenset[str] = frozenset(("str", "choice", "any"))


def check_declared_names(owner: str, declared: Mapping[str, Any], arguments: Collection[str]) -> None:
    """Refuse a declaration for an argument the constructor does not take (a misspelling had been
    ignored without a word, and the argument published unbounded)."""
    for name in declared:
        if name not in arguments:
            raise ValueError(
                f"{owner}.optlab_hyperparameters declares {name!r}, which {owner}.__init__ does not take; "
                f"its arguments: {', '.join(arguments) or 'none'}"
            )


def declared_param(owner: str, name: str, declaration: Any, inferred_type: ParamType) -> Param:
    """`declaration` as a Param, checked; a dict's type is `inferred_type` (the signature's), or a
    `choice` where it lists `choices`."""
    where = f"{owner}.optlab_hyperparameters[{name!r}]"
    if isinstance(declaration, Param):
        param = declaration
    elif isinstance(declaration, Mapping):
        param = _param_from_dict(where, name, declaration, inferred_type)
    else:
        raise ValueError(
            f"{where} must be a dict with keys among {', '.join(RANGE_KEYS)} (or an "
            f"optimizers.hyperparams.Param); received {type(declaration).__name__} {declaration!r}"
        )
    _check_interval(where, param)
    return param


def _param_from_dict(
    where: str, name: str, declaration: Mapping[str, Any], inferred_type: ParamType
) -> Param:
    _check_keys(where, declaration)
    low = _bound(where, "low", declaration.get("low"))
    high = _bound(where, "high", declaration.get("high"))
    low_inclusive = _flag(where, "low_inclusive", declaration.get("low_inclusive", True))
    high_inclusive = _flag(where, "high_inclusive", declaration.get("high_inclusive", True))
    help_text = declaration.get("help", "")
    if not isinstance(help_text, str):
        raise ValueError(f"{where}: 'help' must be a string; received {help_text!r}")
    choices = _choices(where, declaration.get("choices"))
    param_type = "choice" if choices else inferred_type
    if choices and inferred_type not in TEXT_TYPES:
        raise ValueError(
            f"{where}: 'choices' lists the values of a string argument; {name} is {inferred_type} "
            "(from __init__'s signature)"
        )
    if (low is not None or high is not None) and param_type not in NUMBER_TYPES:
        raise ValueError(
            f"{where}: 'low' and 'high' bound numbers; {name} is {param_type} (from __init__'s signature)"
        )
    return Param(
        name,
        param_type,
        None,  # the default comes from the signature
        low=low,
        high=high,
        low_inclusive=low_inclusive,
        high_inclusive=high_inclusive,
        help=help_text,
        choices=choices,
    )


def _check_keys(where: str, declaration: Mapping[str, Any]) -> None:
    for key in declaration:
        if key in RANGE_KEYS:
            continue
        from_signature = f" ({key} comes from __init__'s signature)" if key in SIGNATURE_KEYS else ""
        raise ValueError(f"{where}: unknown key {key!r}{from_signature}; allowed: {', '.join(RANGE_KEYS)}")


def _bound(where: str, key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{where}: {key!r} must be a number or None (unbounded); received {value!r}")
    return value


def _flag(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key!r} must be True or False; received {value!r}")
    return value


def _choices(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(choice, str) for choice in value)
    ):
        raise ValueError(f"{where}: 'choices' must be a non-empty list of strings; received {value!r}")
    return tuple(value)


def _check_interval(where: str, param: Param) -> None:
    """Refuse a range no value fits: low above high, or one point with an end left out."""
    if param.low is None or param.high is None:
        return
    empty = param.low > param.high or (
        param.low == param.high and not (param.low_inclusive and param.high_inclusive)
    )
    if empty:
        raise ValueError(
            f"{where}: no value fits low={param.low!r}, high={param.high!r}"
            f"{'' if param.low_inclusive else ', low_inclusive=False'}"
            f"{'' if param.high_inclusive else ', high_inclusive=False'}; "
            "low must be below high (or equal, with both ends inclusive)"
        )
