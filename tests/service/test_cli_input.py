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


def test_yaml_reads_words_and_dates_as_text_as_json_would() -> None:
    """YAML 1.1's booleans (`on`, `no`) and dates: `name: on` was refused as "received true", and
    `name: 2024-01-01` as a date JSON cannot carry. Only true and false are booleans."""
    loaded = yaml.load(
        "name: on\nlabel: no\nexperiment: 2024-01-01\nflags: [true, False, yes, off, Y]\n",
        Loader=cli._yaml_loader(yaml),
    )
    assert loaded == {
        "name": "on",
        "label": "no",
        "experiment": "2024-01-01",
        "flags": [True, False, "yes", "off", "Y"],
    }


# (the spec file's name, its text, what the message says, the hint that fits, a hint that must not show)
UNREADABLE = [
    (
        "study.yaml",
        "name: !!timestamp 2024-01-01",
        "Object of type date is not JSON serializable",
        "a spec holds JSON's values only",
        "finite",
    ),
    (
        "study.yaml",
        "seeds: [.inf]",
        "Out of range float values are not JSON compliant",
        "must be finite",
        "JSON's values only",
    ),
    # `optlab submit` printed a traceback for these: json.loads reads them, the request cannot carry them.
    ("job.json", '{"steps": NaN}', "Out of range float values", "numbers must be finite", "alias"),
    ("job.json", '{"seed": Infinity}', "Out of range float values", "numbers must be finite", "alias"),
    # Errors of another kind got the finite-and-quote hint, which had nothing to do with them.
    ("study.yaml", "a: &x [*x]", "Circular reference", "a YAML alias may not refer", "finite"),
    ("missing.json", None, "No such file or directory", "", "finite"),
    ("job.json", "{", "cannot read", "", "finite"),
    # These exited 2 without a word (read as None, which meant "already said").
    ("job.json", "null", "holds null", "a JSON object is expected", "finite"),
    ("study.yaml", "", "is empty", "a JSON object is expected", "finite"),
    (
        "study.yaml",
        "# only a comment",
        "holds null (or only comments)",
        "a JSON object is expected",
        "finite",
    ),
    ("job.json", "[1, 2]", "holds a list", "a JSON object is expected", "finite"),
    ("study.yaml", "!!timestamp 2024-01-01", "holds a date", "a JSON object is expected", "finite"),
    # A RecursionError's traceback.
    ("job.json", "[" * 100_000, "nested too deep", "at most 32 levels", "finite"),
    ("study.yaml", "x: " + "[" * 100_000, "nested too deep", "at most 32 levels", "finite"),
    ("job.json", '{"a": ' * 5_000 + "1" + "}" * 5_000, "nested too deep", "at most 32 levels", "finite"),
]


@pytest.mark.parametrize("command", ["study", "submit"])
@pytest.mark.parametrize(
    ("name", "text", "words", "hint", "no_hint"), UNREADABLE, ids=[f"{row[0]}:{row[2]}" for row in UNREADABLE]
)
def test_a_spec_that_cannot_be_read_or_sent_is_a_usage_error_naming_it(
    command: str,
    name: str,
    text: str | None,
    words: str,
    hint: str,
    no_hint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = tmp_path / name
    if text is not None:
        spec.write_text(text + "\n")
    assert cli.main([command, str(spec), "--api", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"optlab {command}: ") and words in err and "Traceback" not in err, err
    assert hint in err and no_hint not in err, err


# (the spec file's name, its text, what follows "cannot read PATH: ", in one line)
NOT_PARSED = [
    # PyYAML's four lines: "<unicode string>", the line quoted, a caret
    (
        "job.yaml",
        "steps: 50\noptimizer:\n\tname: adam\n",
        "line 3, column 1: found character '\\t' that cannot start any token (YAML indents with spaces, "
        "not tabs)",
    ),
    # Both were read, the last silently winning.
    (
        "job.yaml",
        "steps: 50\nsteps: 60\n",
        "line 2, column 1: duplicate key 'steps' (also on line 1): give each key once",
    ),
    (
        "job.yaml",
        "optimizer:\n  name: adam\n  name: lion\n",
        "line 3, column 3: duplicate key 'name' (also on line 2): give each key once",
    ),
    ("job.json", '{"steps": 50, "steps": 60}', "duplicate key 'steps': give each key once"),
    # A bare "Expecting value: line 1 column 1 (char 0)".
    (
        "job.txt",
        "steps: 50\n",
        "line 1, column 1: Expecting value; a spec is JSON, or YAML in a file named .yaml or .yml",
    ),
]


@pytest.mark.parametrize("command", ["study", "submit"])
@pytest.mark.parametrize(("name", "text", "said"), NOT_PARSED, ids=[row[2][:40] for row in NOT_PARSED])
def test_a_spec_that_does_not_parse_is_one_line_naming_where_and_what(
    command: str, name: str, text: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / name
    spec.write_text(text)
    assert cli.main([command, str(spec), "--api", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == f"optlab {command}: cannot read {spec}: {said}\n"


def test_yaml_merge_keys_may_be_given_again_beside_the_merge() -> None:
    """Refusing duplicate keys leaves `<<: *base` alone: a key beside it overrides the merged one."""
    loaded = yaml.load(
        "base: &b {steps: 1, seed: 2}\njob:\n  <<: *b\n  steps: 5\n", Loader=cli._yaml_loader(yaml)
    )
    assert loaded["job"] == {"steps": 5, "seed": 2}


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:9", "127.0.0.1:8000"])
def test_an_address_that_is_not_one_is_a_usage_error_naming_it(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "HTTP 0: cannot reach ..." and exited 1, as if the API were down."""
    client = ApiClient(url, timeout_s=2)
    with pytest.raises(ApiError, match=f"'{url}' is not an address of an optlab API") as raised:
        client.job(1)
    client.close()
    assert raised.value.is_usage_error and not str(raised.value).startswith("HTTP")
    spec = tmp_path / "job.json"
    spec.write_text("{}")
    assert cli.main(["submit", str(spec), "--api", url]) == 2
    assert "is not an address of an optlab API" in capsys.readouterr().err


def test_an_api_that_is_not_there_is_no_http_status(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "job.json"
    spec.write_text("{}")
    assert cli.main(["submit", str(spec), "--api", "http://127.0.0.1:9"]) == 1  # the service, not the input
    assert capsys.readouterr().err.startswith("optlab submit: cannot reach the optlab API at")


@pytest.mark.parametrize("route", ["jobs", "docs"])
def test_an_address_ending_in_a_route_is_told_to_give_the_root(route: str) -> None:
    """`--api http://host:8000/jobs` posted to /jobs/jobs: "HTTP 405: POST is not allowed here" alone;
    and one ending in /docs was told to give it "without /jobs"."""
    import httpx

    client = ApiClient(f"http://api.test/{route}")
    client._http = httpx.Client(
        base_url=client.base_url,
        transport=httpx.MockTransport(lambda request: httpx.Response(405, json={"detail": "not allowed"})),
    )
    with pytest.raises(ApiError) as raised:
        client.job(1)
    assert str(raised.value) == (
        f"HTTP 405: not allowed (the address given is 'http://api.test/{route}': give the API's root, "
        f"without /{route})"
    )


@pytest.mark.parametrize(
    ("address", "detail", "said"),
    [
        # A path the server has no route under: its own "Not Found".
        (
            "http://api.test/api/v1",
            "Not Found",
            "HTTP 404: Not Found (no such route under 'http://api.test/api/v1': give the optlab API's root)",
        ),
        # The API's own 404 of a job it does not hold is told as it is.
        ("http://api.test/api/v1", "job 1 not found", "HTTP 404: job 1 not found"),
        ("http://api.test", "Not Found", "HTTP 404: Not Found"),
    ],
)
def test_an_address_with_a_path_the_server_lacks_is_told_to_give_the_root(
    address: str, detail: str, said: str
) -> None:
    """`--api http://host:8731/api/v1` had said only "HTTP 404: Not Found"."""
    import httpx

    client = ApiClient(address)
    client._http = httpx.Client(
        base_url=client.base_url,
        transport=httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": detail})),
    )
    with pytest.raises(ApiError) as raised:
        client.job(1)
    assert str(raised.value) == said


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


@pytest.mark.parametrize(
    ("counts", "status"),
    [
        ({"succeeded": 4}, 0),
        ({"succeeded": 3, "diverged": 1}, 0),  # a sweep's large rate: a finding, not a failure
        ({"succeeded": 2, "cancelled": 2}, 0),
        ({"succeeded": 3, "failed": 1}, 1),
    ],
)
def test_a_study_exits_1_only_when_a_job_failed(counts: dict[str, int], status: int) -> None:
    assert cli.study_exit_status({"progress": {"counts": counts, "jobs": 4}}) == status


@pytest.mark.parametrize("command", ["submit", "study"])
def test_ctrl_c_while_waiting_says_the_work_goes_on_and_how_to_cancel_it(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It had exited 130 without a word while the job trained on."""
    spec = tmp_path / "spec.json"
    spec.write_text('{"steps": 1}')
    monkeypatch.setattr(
        ApiClient,
        "submit",
        lambda self, body: {"id": 7, "status": "queued", "spec": {"optimizer": {"name": "adam"}}},
    )
    monkeypatch.setattr(
        ApiClient, "submit_study", lambda self, body: {"id": 7, "status": "running", "jobs": []}
    )

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("service.progress.follow_jobs", interrupted)
    monkeypatch.setattr("service.studies.follow.follow_study", interrupted)
    monkeypatch.delenv("OPTLAB_TOKEN", raising=False)
    assert cli.main([command, str(spec), "--wait", "--api", "http://127.0.0.1:9"]) == 130
    what, path = ("job", "jobs") if command == "submit" else ("study", "studies")
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"optlab {command}: stopped waiting; {what} 7 goes on. Follow it at http://127.0.0.1:9/{path}/7; "
            f"cancel it with curl -X POST -H 'Content-Type: application/json' http://127.0.0.1:9/{path}/7/cancel"
        )
    )


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


def test_the_help_says_what_each_argument_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """A spec may be YAML; --style offers torch too; every option of `optlab api` is explained; the
    multi-line example keeps its line break (an unescaped backslash joined its lines)."""
    assert "JSON or YAML" in _help("submit", capsys)
    check = _help("check", capsys)
    style = check.split("--style {torch,keras,tf_legacy}", 2)[2].split("--params", 1)[0]
    assert "torch" in style and "keras" in style and "tf_legacy" in style, style
    assert "  optlab check pytorch_optimizer:Muon \\\n      --param-groups" in check
    api = _help("api", capsys)
    for option in ("--host HOST", "--port PORT"):
        line = next(line for line in api.splitlines() if line.strip().startswith(option))
        assert line.strip() != option, f"{option} has no help"


@pytest.mark.parametrize(("command", "path"), [("submit", "jobs"), ("study", "studies")])
def test_ctrl_c_before_the_api_answered_says_it_may_have_taken_it(
    command: str,
    path: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A submission waits through an API that does not answer: Ctrl-C there had raised a traceback."""
    spec = tmp_path / "spec.json"
    spec.write_text('{"steps": 1}')

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ApiClient, "submit", interrupted)
    monkeypatch.setattr(ApiClient, "submit_study", interrupted)
    assert cli.main([command, str(spec), "--wait", "--api", "http://127.0.0.1:9"]) == 130
    assert capsys.readouterr().err.strip() == (
        f"optlab {command}: interrupted before the API answered; it may have taken it: see "
        f"http://127.0.0.1:9/{path}"
    )
