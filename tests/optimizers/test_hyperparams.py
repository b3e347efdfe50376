"""Param declarations: one description validates constructor arguments and publishes the catalogue."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from optimizers.hyperparams import (
    Param,
    check_all,
    check_hyperparameters,
    non_negative,
    positive,
    unit_interval,
    unit_interval_pair,
)

LR = Param("lr", "float", 0.1, low=0.0, low_inclusive=False)
BETA = Param("beta", "float", 0.9, low=0.0, high=1.0, high_inclusive=False)
STEPS = Param("steps", "int", 1, low=1)
WEIGHT_DECAY = Param("weight_decay", "number", 0, low=0.0)
NESTEROV = Param("nesterov", "bool", False)
BETAS = Param("betas", "float_pair", (0.9, 0.999), low=0.0, high=1.0, high_inclusive=False)
CLIP = Param("clip", "float", 1.0, high=10.0)
UNBOUNDED = Param("shift", "float", 0.0)


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        (LR, "a number > 0"),
        (BETA, "a number in [0, 1)"),
        (STEPS, "an integer >= 1"),
        (WEIGHT_DECAY, "a number >= 0"),
        (NESTEROV, "true or false"),
        (BETAS, "two numbers in [0, 1)"),
        (CLIP, "a number <= 10"),
        (Param("clip", "float", 1.0, high=10.0, high_inclusive=False), "a number < 10"),
        (Param("p", "float", 0.5, low=0.0, high=1.0, low_inclusive=False), "a number in (0, 1]"),
        (UNBOUNDED, "a number"),
    ],
    ids=lambda value: value.name if isinstance(value, Param) else None,
)
def test_allowed_describes_type_and_interval(param: Param, expected: str) -> None:
    assert param.allowed() == expected


@pytest.mark.parametrize(
    ("param", "value", "expected"),
    [
        (LR, 0.5, 0.5),
        (LR, 1e-12, 1e-12),
        (BETA, 0.0, 0.0),
        (BETA, 0.999, 0.999),
        (STEPS, 1, 1),
        (STEPS, 5.0, 5),
        (WEIGHT_DECAY, 0.25, 0.25),
        (CLIP, 10.0, 10.0),
        (UNBOUNDED, -1e9, -1e9),
        (NESTEROV, True, True),
        (NESTEROV, False, False),
        (BETAS, [0.9, 0.99], (0.9, 0.99)),
        (BETAS, (0, 0.5), (0.0, 0.5)),
    ],
)
def test_check_accepts_in_range(param: Param, value: Any, expected: Any) -> None:
    assert param.check(value) == expected


@pytest.mark.parametrize(
    ("param", "value", "expected_type"),
    [
        (LR, 3, float),  # "float" converts: the optimizer sees the type it declared
        (STEPS, 5.0, int),  # a whole float is an integer for "int"
        (WEIGHT_DECAY, 0, int),  # "number" keeps an int an int, for code that counts with it
        (WEIGHT_DECAY, 2, int),
        (WEIGHT_DECAY, 0.5, float),
    ],
)
def test_check_normalises_type(param: Param, value: Any, expected_type: type) -> None:
    checked = param.check(value)
    assert type(checked) is expected_type
    assert checked == value


def test_check_returns_float_pair_as_tuple_of_floats() -> None:
    checked = BETAS.check([0, 1 / 2])
    assert checked == (0.0, 0.5)
    assert isinstance(checked, tuple)
    assert all(type(number) is float for number in checked)


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        (BETA, 1.5, "beta must be a number in [0, 1); received 1.5"),
        (BETA, 1.0, "beta must be a number in [0, 1); received 1.0"),
        (BETA, -0.1, "beta must be a number in [0, 1); received -0.1"),
        (LR, 0.0, "lr must be a number > 0; received 0.0"),
        (LR, -1, "lr must be a number > 0; received -1"),
        (STEPS, 0, "steps must be an integer >= 1; received 0"),
        (STEPS, 2.5, "steps must be an integer >= 1; received 2.5"),
        (WEIGHT_DECAY, -1, "weight_decay must be a number >= 0; received -1"),
        (CLIP, 11, "clip must be a number <= 10; received 11"),
        (BETAS, [0.9, 1.0], "betas must be two numbers in [0, 1); received [0.9, 1.0]"),
        (BETAS, (-0.1, 0.5), "betas must be two numbers in [0, 1); received [-0.1, 0.5]"),
    ],
)
def test_check_rejects_out_of_range_naming_arg_range_and_value(
    param: Param, value: Any, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        param.check(value)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("param", "value", "shown"),
    [
        (LR, "0.1", '"0.1"'),
        (LR, None, "null"),
        (LR, [0.1], "[0.1]"),
        (STEPS, "3", '"3"'),
        (NESTEROV, 1, "1"),
        (NESTEROV, "true", '"true"'),
        (BETAS, [0.9], "[0.9]"),
        (BETAS, [0.9, 0.99, 0.999], "[0.9, 0.99, 0.999]"),
        (BETAS, 0.9, "0.9"),
        (BETAS, ["a", "b"], '["a", "b"]'),
    ],
)
def test_check_rejects_wrong_type(param: Param, value: Any, shown: str) -> None:
    with pytest.raises(ValueError) as caught:
        param.check(value)
    assert str(caught.value) == f"{param.name} must be {param.allowed()}; received {shown}"


NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("param", [LR, BETA, STEPS, WEIGHT_DECAY, UNBOUNDED], ids=lambda p: p.name)
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_check_rejects_non_finite(param: Param, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{param.name} must be .*; received -?(NaN|Infinity)$"):
        param.check(value)


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_check_rejects_non_finite_in_pair(value: float) -> None:
    with pytest.raises(ValueError, match=r"^betas must be two numbers"):
        BETAS.check([0.9, value])


@pytest.mark.parametrize("param", [LR, STEPS, WEIGHT_DECAY, UNBOUNDED], ids=lambda p: p.name)
@pytest.mark.parametrize("value", [True, False])
def test_check_rejects_bool_where_a_number_is_expected(param: Param, value: bool) -> None:
    shown = json.dumps(value)
    with pytest.raises(ValueError, match=f"^{param.name} must be .*; received {shown}$"):
        param.check(value)


def test_check_rejects_bool_inside_a_pair() -> None:
    with pytest.raises(ValueError, match=r"received \[true, 0.9\]$"):
        BETAS.check([True, 0.9])


def test_check_rejects_huge_int_for_float_with_value_error() -> None:
    with pytest.raises(ValueError, match=r"^lr must be a number > 0; received 1000"):
        LR.check(10**400)


def test_declaration_helpers() -> None:
    assert positive("lr").allowed() == "a number > 0"
    assert non_negative("weight_decay").allowed() == "a number >= 0"
    assert unit_interval("beta").allowed() == "a number in [0, 1)"
    assert unit_interval_pair("betas").allowed() == "two numbers in [0, 1)"
    # The default is written once, in the constructor signature; derive_params fills it in.
    assert positive("lr").default is None


DECLARED = {"lr": LR, "beta": BETA, "nesterov": NESTEROV}


def test_check_all_fills_defaults() -> None:
    assert check_all({"lr": 0.5}, DECLARED, owner="optimizer 'probe'") == {
        "lr": 0.5,
        "beta": 0.9,
        "nesterov": False,
    }
    assert check_all({}, DECLARED, owner="optimizer 'probe'") == {"lr": 0.1, "beta": 0.9, "nesterov": False}


def test_check_all_normalises_values() -> None:
    checked = check_all({"lr": 1, "betas": [0.8, 0.9]}, {"lr": LR, "betas": BETAS}, owner="x")
    assert checked == {"lr": 1.0, "betas": (0.8, 0.9)}
    assert type(checked["lr"]) is float
    assert isinstance(checked["betas"], tuple)


def test_check_all_rejects_unknown_names_listing_accepted_ones() -> None:
    with pytest.raises(ValueError) as caught:
        check_all({"lr": 0.1, "gamma": 1, "alpha": 2}, DECLARED, owner="optimizer 'probe'")
    assert (
        str(caught.value) == "optimizer 'probe' has no hyperparameter 'alpha'; accepted: lr, beta, nesterov"
    )


def test_a_rate_called_learning_rate_is_pointed_to_lr() -> None:
    """Keras's name for it: the catalogue's is `lr`, whatever the class calls it."""
    with pytest.raises(ValueError) as caught:
        check_all({"learning_rate": 0.1}, DECLARED, owner="optimizer 'probe'")
    assert str(caught.value) == (
        "optimizer 'probe' has no hyperparameter 'learning_rate'; accepted: lr, beta, nesterov "
        "(the learning rate is 'lr' here, whatever the class calls it)"
    )


def test_check_all_rejects_invalid_value_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^beta must be a number in \[0, 1\); received 2$"):
        check_all({"lr": 0.1, "beta": 2}, DECLARED, owner="optimizer 'probe'")


def test_check_hyperparameters_accepts_valid_and_rejects_invalid() -> None:
    check_hyperparameters(DECLARED, lr=0.01, beta=0.0, nesterov=True)
    with pytest.raises(ValueError, match=r"^lr must be a number > 0; received 0$"):
        check_hyperparameters(DECLARED, beta=0.5, lr=0)


ROUND_TRIP = [
    LR,
    BETA,
    STEPS,
    WEIGHT_DECAY,
    NESTEROV,
    BETAS,
    CLIP,
    UNBOUNDED,
    Param("p", "float", 0.5, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False, help="why"),
]


@pytest.mark.parametrize("param", ROUND_TRIP, ids=lambda p: p.name)
def test_to_json_from_json_round_trip(param: Param) -> None:
    assert Param.from_json(param.to_json()) == param
    # Over the wire: through a JSON string, where a tuple default comes back as a list.
    assert Param.from_json(json.loads(json.dumps(param.to_json()))) == param


def test_to_json_publishes_allowed_and_a_json_default() -> None:
    data = BETAS.to_json()
    assert data["allowed"] == "two numbers in [0, 1)"
    assert data["default"] == [0.9, 0.999]
    assert json.loads(json.dumps(data)) == data


def test_from_json_fills_optional_fields() -> None:
    assert Param.from_json({"name": "lr", "type": "float", "default": 0.1}) == Param("lr", "float", 0.1)


def test_a_non_finite_default_is_published_as_text() -> None:
    """JSON (and PostgreSQL's json type) has no inf: a plugin's `clip: float = inf` must not
    stop the catalogue from being stored."""
    described = Param("clip", "float", float("inf")).to_json()
    assert described["default"] == "inf"
    json.dumps(described, allow_nan=False)


def test_a_declared_default_is_valid_by_definition() -> None:
    # Prodigy declares `growth_rate=inf`: the filled-in default comes back when the optimizer is
    # built, and must not be refused as if a user had sent it.
    growth = Param("growth_rate", "number", math.inf)
    checked = check_all({"growth_rate": math.inf}, {"growth_rate": growth}, owner="x")
    assert checked == {"growth_rate": math.inf}
    off = Param("clip", "float", None, low=0.0)
    assert check_all({"clip": None}, {"clip": off}, owner="x") == {"clip": None}


@pytest.mark.parametrize("default", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_default_sent_back_as_its_published_text_is_that_default(default: float) -> None:
    """The catalogue shows `max_norm=inf` as "inf" (JSON has no inf), and the API, which reads the
    catalogue, took "inf" back as the default: the job then refused it ("must be a number")."""
    declared = Param("max_norm", "float", default)
    published = Param.from_json(json.loads(json.dumps(declared.to_json(), allow_nan=False)))
    text = str(default)
    assert published.accept(text) == text  # the API's side: the default, as it knows it
    built = check_all({"max_norm": text}, {"max_norm": declared}, owner="x")["max_norm"]
    assert isinstance(built, float) and (math.isnan(built) if math.isnan(default) else built == default)
    with pytest.raises(ValueError, match="must be"):
        declared.accept("infinity")  # only the published text itself
    with pytest.raises(ValueError, match="must be"):
        Param("lr", "float", 0.1).accept("inf")  # a finite default makes no text a number


def test_a_value_other_than_the_default_is_still_validated() -> None:
    with pytest.raises(ValueError, match="received Infinity"):
        check_all({"lr": math.inf}, {"lr": Param("lr", "float", 0.1, low=0.0)}, owner="x")
    # `True == 1` in Python: the default 1 does not make `true` a valid integer.
    with pytest.raises(ValueError, match="received true"):
        check_all({"steps": True}, {"steps": Param("steps", "int", 1)}, owner="x")


def test_a_required_argument_has_no_default_that_null_could_stand_for() -> None:
    # npz's required `path` is published with the default null; null given for it is no path at all.
    path = Param("path", "path", None, required=True)
    assert not path.is_default(None)
    with pytest.raises(ValueError, match="path must be a file path"):
        check_all({"path": None}, {"path": path}, owner="x")
    beta = Param("beta", "float", None, required=True)
    with pytest.raises(ValueError, match="beta must be a number; received null"):
        check_all({"beta": None}, {"beta": beta}, owner="x")


@pytest.mark.parametrize(
    "param",
    [
        Param("data_format", "choice", "channels_first", choices=("channels_first", "channels_last")),
        Param("line_search_fn", "str", None, nullable=True),
        Param("clip", "float", 1.0, low=0.0, nullable=True),
        Param("betas", "float_tuple", (0.9, 0.999, 0.9999), low=0.0, high=1.0),
    ],
    ids=lambda param: param.type,
)
def test_the_published_param_reads_back_the_same(param: Param) -> None:
    published = json.loads(json.dumps(param.to_json()))
    assert Param.from_json(published) == param


def test_nullable_takes_null_besides_its_type_and_says_so() -> None:
    """`clip: float | None = 1.0`: null turns it off, which the class allows; a required nullable
    argument takes null as its given value."""
    clip = Param("clip", "float", 1.0, low=0.0, nullable=True)
    assert check_all({"clip": None}, {"clip": clip}, owner="x") == {"clip": None}
    with pytest.raises(ValueError, match=r"clip must be a number >= 0, or null; received -1"):
        check_all({"clip": -1}, {"clip": clip}, owner="x")
    given = Param("mode", "choice", None, required=True, nullable=True, choices=("a",))
    assert check_all({"mode": None}, {"mode": given}, owner="x") == {"mode": None}
    with pytest.raises(ValueError, match=r'mode must be "a", or null; received "b"'):
        check_all({"mode": "b"}, {"mode": given}, owner="x")


def test_a_framework_switch_is_told_why_it_is_no_hyperparameter() -> None:
    """torch's Adam takes `maximize`: "has no hyperparameter 'maximize'" alone read as wrong."""
    with pytest.raises(ValueError) as caught:
        check_all({"maximize": True}, {"lr": Param("lr", "float", 0.1)}, owner="optimizer 'adam'")
    assert str(caught.value).startswith("optimizer 'adam' has no hyperparameter 'maximize'; accepted: lr (")
    assert "one of the framework's own switches, which a job leaves at the class's default" in str(
        caught.value
    )


def test_an_unannotated_argument_takes_a_list_of_scalars_as_given() -> None:
    """Keras's Muon takes `exclude_layers=None`, a list of layer names: the catalogue reads it as
    `any`, which took scalars only, so the class could not be checked or trained with its option."""
    excluded = Param("exclude_layers", "any", None, nullable=True)
    assert excluded.accept(["embedding", "dense"]) == ["embedding", "dense"]
    assert excluded.accept([0.1, 2, True]) == [0.1, 2, True]
    assert excluded.accept("dense") == "dense"  # a scalar, as before
    for wrong in ([["nested"]], ["x"] * 65, ["\x00"], [math.nan]):
        with pytest.raises(ValueError, match="or a list of at most 64 of those"):
            excluded.accept(wrong)
