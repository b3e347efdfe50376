"""Declarations of tunable parameters: one description, used both to validate
constructor arguments and to publish the catalogue the API validates jobs against.

Pure Python on purpose: the API process imports this module and must never pull in
torch or TensorFlow.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ParamType = Literal[
    "float", "int", "number", "bool", "float_pair", "float_tuple", "int_list", "float_list", "path", "str",
    "choice", "any",
]  # fmt: skip
MAX_LIST_LENGTH = 64
# A `path` param (a workload's data file) is a string; where it may point is the data roots' rule
# (jobs/data_roots.py), checked where the roots are known.
MAX_PATH_LENGTH = 1000
# A `str` param (an option a class takes by name: LBFGS's `line_search_fn="strong_wolfe"`) whose
# values the signature does not list; a `choice` is one whose annotation does (`Literal["a", "b"]`).
# Printable ASCII: option names, never text for a log line, run name or page to be wary of. An
# `any` param is an unannotated `x=None` (Keras's `weight_decay=None`): nothing says what it takes, so
# it takes any of those scalars, and the class's own code judges the value when it is built.
MAX_STRING_LENGTH = 200
OPTION_TEXT_PATTERN = "^[ -~]*$"
TEXT_ALLOWED = f"a string of at most {MAX_STRING_LENGTH} printable ASCII characters"
EnumClass = type[enum.Enum]


@dataclass(frozen=True)
class Param:
    """One tunable argument: its type, default and allowed interval.

    `low`/`high` bound every number in the value (both numbers of a `float_pair`);
    `None` means unbounded on that side. `nullable`: null is a value too (`clip: float | None = 1.0`,
    where None turns clipping off), besides the default.
    """

    name: str
    type: ParamType
    default: Any
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    help: str = ""
    # No default in the signature: a job must give it (the default is then None).
    required: bool = False
    nullable: bool = False
    choices: tuple[str, ...] = ()  # a `choice`'s values
    suffixes: tuple[str, ...] = ()  # a `path`'s allowed endings (npz's ".npz"); () for any
    # A `choice` of an enum's member names (Distributed Shampoo's `weight_decay_type`): the class takes
    # the member. Known where the class is (the registry), not in the catalogue the API reads.
    enum_class: EnumClass | None = field(default=None, compare=False, repr=False)

    def allowed(self) -> str:
        """Human description of the allowed values, e.g. `a number in [0, 1)`, `"a" or "b", or null`."""
        kind = self._allowed_values()
        return f"{kind}, or null" if self.nullable else kind

    def _allowed_values(self) -> str:
        if self.type == "choice":
            quoted = [json.dumps(choice) for choice in self.choices]
            return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        if self.type == "str":
            return TEXT_ALLOWED
        if self.type == "any":
            scalars = f"true or false, a number or {TEXT_ALLOWED}"
            return f"{scalars}, or a list of at most {MAX_LIST_LENGTH} of those"
        if self.type == "bool":
            return "true or false"
        if self.type == "path":  # "" means none only where a path may be left out (char_lm's corpus)
            none = "" if self.required else ', or "" for none'
            return f"a file path (at most {MAX_PATH_LENGTH} characters) under a data root{none}"
        kind = {
            "float": "a number",
            "number": "a number",
            "int": "an integer",
            "float_pair": "two numbers",
            "float_tuple": f"a list of 1 to {MAX_LIST_LENGTH} numbers",
            "int_list": f"a list of at most {MAX_LIST_LENGTH} integers",
            "float_list": f"a list of at most {MAX_LIST_LENGTH} numbers",
        }[self.type]
        if self.low is None and self.high is None:
            return kind
        if self.low is not None and self.high is not None:
            left = "[" if self.low_inclusive else "("
            right = "]" if self.high_inclusive else ")"
            return f"{kind} in {left}{_fmt(self.low)}, {_fmt(self.high)}{right}"
        if self.low is not None:
            return f"{kind} {'>=' if self.low_inclusive else '>'} {_fmt(self.low)}"
        assert self.high is not None
        return f"{kind} {'<=' if self.high_inclusive else '<'} {_fmt(self.high)}"

    def check(self, value: Any) -> Any:
        """Return `value` normalised to this type, or raise ValueError saying what is allowed."""
        if value is None and self.nullable:
            return None
        numbers = self._coerce(value)
        for number in numbers:
            if not self.in_range(number):
                raise ValueError(f"{self.name} must be {self.allowed()}; received {_show(value)}")
        if self.type == "float_pair":
            return (numbers[0], numbers[1])
        if self.type == "float_tuple":  # as the class's default is (Adan's three `betas`)
            return tuple(numbers)
        if self.type in ("int_list", "float_list"):
            return numbers
        return numbers[0]

    def is_default(self, value: Any) -> bool:
        """Whether `value` is the declared default itself (as `derive_params` read it from the signature).

        Same type too: `True == 1` in Python, and `true` given for an integer whose default
        is 1 must still be refused. A required argument has no default: the None published for it
        is not a value a job may send.
        """
        if self.required:
            return False
        if _non_finite(self.default) and isinstance(value, str):
            return value == str(self.default)  # the text `to_json` publishes it as, sent back
        if type(value) is not type(self.default):
            return False
        if isinstance(value, float) and math.isnan(value):
            return math.isnan(self.default)
        return bool(value == self.default)

    def accept(self, value: Any) -> Any:
        """`value` checked (`check`), except the declared default, valid by definition (Prodigy's
        `growth_rate=inf`, a `None` meaning "off"): the filled-in defaults come back when the
        optimizer is built, and refusing them would make the class unbuildable. A non-finite
        default sent back as the text the catalogue shows it as ("inf") is that default."""
        if not self.is_default(value):
            return self.check(value)
        return self.default if isinstance(value, str) and _non_finite(self.default) else value

    def native(self, value: Any) -> Any:
        """A checked value as the class takes it: the member a `choice` of an enum's names names."""
        if self.enum_class is not None and isinstance(value, str):
            return self.enum_class[value]
        return value

    def to_json(self) -> dict[str, Any]:
        default = list(self.default) if isinstance(self.default, tuple | list) else self.default
        if isinstance(default, float) and not math.isfinite(default):
            default = str(default)  # JSON (and PostgreSQL's json type) has no inf or NaN
        return {
            "name": self.name,
            "type": self.type,
            "default": default,
            "low": self.low,
            "high": self.high,
            "low_inclusive": self.low_inclusive,
            "high_inclusive": self.high_inclusive,
            "allowed": self.allowed(),
            "help": self.help,
            "required": self.required,
            "nullable": self.nullable,
            "choices": list(self.choices),
            "suffixes": list(self.suffixes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Param:
        default = data["default"]
        if data["type"] in ("float_pair", "float_tuple") and isinstance(default, list):
            default = tuple(default)
        return cls(
            name=data["name"],
            type=data["type"],
            default=default,
            low=data.get("low"),
            high=data.get("high"),
            low_inclusive=data.get("low_inclusive", True),
            high_inclusive=data.get("high_inclusive", True),
            help=data.get("help", ""),
            required=data.get("required", False),
            nullable=data.get("nullable", False),
            choices=tuple(data.get("choices", ())),
            suffixes=tuple(data.get("suffixes", ())),
        )

    def _coerce(self, value: Any) -> list[Any]:
        wrong = ValueError(f"{self.name} must be {self.allowed()}; received {_show(value)}")
        if self.type == "bool":
            if not isinstance(value, bool):
                raise wrong
            return [value]
        if self.type == "path":
            if not isinstance(value, str) or len(value) > MAX_PATH_LENGTH or "\x00" in value:
                raise wrong
            return [value]
        if self.type == "str":
            if not is_option_text(value):
                raise wrong
            return [value]
        if self.type == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise wrong
            return [value]
        if self.type == "any":  # kept as given: the class's own code judges it
            if isinstance(value, list | tuple):  # Keras Muon's `exclude_layers=["embedding"]`
                if len(value) > MAX_LIST_LENGTH or any(isinstance(item, list | tuple) for item in value):
                    raise wrong
                return [[self._any_scalar(item, wrong) for item in value]]
            return [self._any_scalar(value, wrong)]
        if self.type == "float_pair":
            if not isinstance(value, list | tuple) or len(value) != 2:
                raise wrong
            return [self._number(item, wrong, integer=False) for item in value]
        if self.type == "float_tuple":
            if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_LIST_LENGTH:
                raise wrong
            return [self._number(item, wrong, integer=False) for item in value]
        if self.type in ("int_list", "float_list"):
            if not isinstance(value, list | tuple) or len(value) > MAX_LIST_LENGTH:
                raise wrong
            return [self._number(item, wrong, integer=self.type == "int_list") for item in value]
        if self.type == "number":
            # Kept as given: an int stays an int for code that counts with it.
            if isinstance(value, int) and not isinstance(value, bool):
                return [value]
        return [self._number(value, wrong, integer=self.type == "int")]

    @classmethod
    def _any_scalar(cls, value: Any, wrong: ValueError) -> Any:
        if isinstance(value, bool | int) or is_option_text(value):
            return value
        return cls._number(value, wrong, integer=False)

    @staticmethod
    def _number(value: Any, wrong: ValueError, *, integer: bool) -> float | int:
        # bool is an int subclass in Python; `true` is never a valid learning rate.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong
        if integer:
            if isinstance(value, float):
                if not value.is_integer():
                    raise wrong
                return int(value)
            return value
        try:
            number = float(value)  # a JSON integer literal can be too long for a float
        except OverflowError:
            raise wrong from None
        if not math.isfinite(number):
            raise wrong
        return number

    def in_range(self, number: float) -> bool:
        """Within `low`/`high` as declared (inclusive or not); always for kinds that are no number."""
        if self.type in ("path", "str", "choice", "any"):
            return True
        if self.low is not None:
            if number < self.low or (number == self.low and not self.low_inclusive):
                return False
        if self.high is not None:
            if number > self.high or (number == self.high and not self.high_inclusive):
                return False
        return True


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_option_text(value: Any) -> bool:
    """Whether `value` is a string a `str` param takes (`OPTION_TEXT_PATTERN`, `MAX_STRING_LENGTH`)."""
    if not isinstance(value, str) or len(value) > MAX_STRING_LENGTH:
        return False
    return re.fullmatch(OPTION_TEXT_PATTERN, value) is not None


# Constructor arguments that are implementation switches or framework plumbing, not
# hyperparameters a job should tune (`params` where it is not first: WSAM's `(model, params, ...)`;
# a torch class's first argument, whatever its name, is the registry's `_built_over`); unless the
# class declares one in `optlab_hyperparameters` (the built-ins' `fused`): then it offers the
# switch to jobs, validated like the rest.
FRAMEWORK_SWITCHES = frozenset({
    "params", "foreach", "fused", "capturable", "differentiable", "maximize",  # torch
    "name", "clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",  # keras
    "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps", "jit_compile",
    "mesh", "is_legacy_optimizer",
})  # fmt: skip


def switch_note(key: str) -> str:
    """Why a framework's own switch the class takes is no hyperparameter here ("has no
    hyperparameter 'maximize'" had read as wrong of torch's Adam, which takes it); "" for any
    other key."""
    if key not in FRAMEWORK_SWITCHES - {"params", "name"}:
        return ""
    return (
        f" ({key} is one of the framework's own switches, which a job leaves at the class's default: "
        "it is no hyperparameter unless the class declares it in optlab_hyperparameters)"
    )


def check_all(
    params: Mapping[str, Any], declared: Mapping[str, Param], *, owner: str, partial: bool = False
) -> dict[str, Any]:
    """Validate `params` against `declared`; return them with defaults filled in.

    `partial` (a param group's own params, which add to the optimizer's): only those given,
    none required. Raises ValueError naming the first unknown, missing required or invalid argument.
    """
    unknown = sorted(set(params) - set(declared))
    if unknown:
        # Keras calls it `learning_rate`; the catalogue names every class's rate `lr`.
        renamed = " (the learning rate is 'lr' here, whatever the class calls it)" if "lr" in declared else ""
        raise ValueError(
            f"{owner} has no hyperparameter {unknown[0]!r}; accepted: {', '.join(declared) or 'none'}"
            + (renamed if unknown[0] == "learning_rate" else switch_note(unknown[0]))
        )
    missing = [name for name, param in declared.items() if param.required and name not in params]
    if missing and not partial:
        param = declared[missing[0]]
        raise ValueError(
            f"{owner} requires hyperparameter {param.name!r} ({param.allowed()}): it has no default"
        )
    checked = {} if partial else {name: p.default for name, p in declared.items() if not p.required}
    for name, value in params.items():
        checked[name] = declared[name].accept(value)
    return checked


def check_hyperparameters(declared: Mapping[str, Param], **values: Any) -> None:
    """Constructor-side validation: raise ValueError naming the argument and the value."""
    for name, value in values.items():
        declared[name].check(value)


# Declarations used by optimizer classes. The default comes from the constructor's
# signature when the catalogue is built, so it is written in one place only.
def positive(name: str, help: str = "") -> Param:
    return Param(name, "float", None, low=0.0, low_inclusive=False, help=help)


def non_negative(name: str, help: str = "") -> Param:
    return Param(name, "float", None, low=0.0, help=help)


def unit_interval(name: str, help: str = "") -> Param:
    """A decay factor in [0, 1): 1 would freeze an average forever."""
    return Param(name, "float", None, low=0.0, high=1.0, high_inclusive=False, help=help)


def unit_interval_pair(name: str, help: str = "") -> Param:
    """Two decay factors in [0, 1), as torch's `betas`."""
    return Param(name, "float_pair", None, low=0.0, high=1.0, high_inclusive=False, help=help)


def _fmt(number: float) -> str:
    return f"{number:g}"


def _show(value: Any) -> str:
    """Show a received value as the client sent it (JSON spelling: true, null, NaN)."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
