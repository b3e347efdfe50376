"""What the CLI makes of input a person writes by hand: YAML numbers as YAML 1.2 and JSON read
them, values JSON cannot carry and addresses that are not ones refused in words, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service import cli
from service.client import ApiClient, ApiError


def test_yaml_numbers_with_only_an_exponent_are_numbers() -> None:
    """PyYAML (YAML 1.1) reads `1e-3` as text; the API then refused "1e-3" as not a number."""
    loaded = yaml.load(
        "lr: [1e-3, 3E+2, -2e-1, 1.0e-4, 5, 1_000]\nversion: 1.2.3\n", Loader=cli._yaml_loader(yaml)
    )
    assert loaded == {"lr": [0.001, 300.0, -0.2, 0.0001, 5, 1000], "version": "1.2.3"}
    assert all(type(value) is float for value in loaded["lr"][:4])


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("name: 2024-01-01", "Object of type date is not JSON serializable"),
        ("seeds: [.inf]", "Out of range float values are not JSON compliant"),
    ],
)
def test_a_value_json_cannot_carry_is_a_usage_error_naming_it(
    line: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "study.yaml"
    spec.write_text(line + "\n")
    assert cli.main(["study", str(spec), "--api", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert words in err and "quote a name or label" in err and "Traceback" not in err


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:9"])
def test_an_address_that_is_not_one_is_an_api_error_naming_it(url: str) -> None:
    client = ApiClient(url, timeout_s=2)
    with pytest.raises(ApiError, match=f"cannot reach the optlab API at '{url}'"):
        client.job(1)
    client.close()


def test_a_refusal_s_problems_are_printed_at_their_fields() -> None:
    """ "lr must be a number > 0" alone did not say which param group's lr was refused."""
    from service.client import format_detail

    detail = [
        {"loc": ["body", "optimizer", "param_groups", 1, "params", "lr"], "msg": "lr must be a number > 0"},
        {"loc": ["body", "steps"], "msg": "steps: Input should be greater than 0"},
        {"loc": ["body"], "msg": "the body is not valid JSON"},
    ]
    assert format_detail(422, detail).splitlines() == [
        "HTTP 422:",
        "  - optimizer.param_groups.1.params.lr: lr must be a number > 0",
        "  - steps: Input should be greater than 0",
        "  - the body is not valid JSON",
    ]
