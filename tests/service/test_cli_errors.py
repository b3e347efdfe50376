"""Bad input of any kind gets one line naming what is wrong and what is allowed, never a traceback,
and the documented exit status: a probe's findings, one table per kind of input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from jobs.checks import __main__ as checks_main
from service import cli

Handler = Callable[[httpx.Request], httpx.Response]


def one_line_error(err: str, command: str) -> str:
    line = err.strip()
    assert line.startswith(f"optlab {command}: ") and "\n" not in line and "Traceback" not in line, err
    return line


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> Callable[[Handler], list[httpx.Request]]:
    """The API's answers from a handler instead of a server; returns the requests it saw."""

    def serve(handler: Handler) -> list[httpx.Request]:
        seen: list[httpx.Request] = []
        real = httpx.Client

        def recorded(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return handler(request)

        monkeypatch.setattr(
            httpx, "Client", lambda **kwargs: real(transport=httpx.MockTransport(recorded), **kwargs)
        )
        return seen

    return serve


def spec_file(tmp_path: Path) -> str:
    spec = tmp_path / "job.json"
    spec.write_text('{"steps": 1}')
    return str(spec)


# -- 2: a file that exits when imported ---------------------------------------------------------------


def test_a_file_that_exits_when_imported_is_a_usage_error_not_a_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A training script ending `sys.exit(main())` exited 0 with no table: a false pass in CI."""
    script = tmp_path / "train_script.py"
    script.write_text("import sys\n\nclass MyOpt:\n    pass\n\nsys.exit(0)\n")
    report = tmp_path / "r.json"
    assert checks_main.main([f"{script}:MyOpt", "--json", str(report)]) == 2
    line = one_line_error(capsys.readouterr().err, "check")
    assert f"{script} exited when imported (SystemExit: 0)" in line
    assert 'if __name__ == "__main__":' in line and not report.exists()


# -- 5: answers that are not the API's JSON -----------------------------------------------------------

NOT_JSON = [
    # (status, headers, body, exit status, what the line says)
    (
        308,
        {"location": "https://api.example/jobs"},
        b"",
        2,
        "answered HTTP 308, a redirect to https://api.example/jobs: give that address instead "
        "(https://api.example)",
    ),
    (
        200,
        {"content-type": "text/html"},
        b"<html>Please log in</html>",
        2,
        "answered text/html, not the API's",
    ),
    (201, {"content-type": "application/json"}, b"[1]", 2, "answered a JSON list, not the API's JSON object"),
    (
        400,
        {"content-type": "application/json"},
        b"[1, 2]",
        2,
        "HTTP 400: POST http://api.test/jobs answered a JSON list",
    ),
    (
        404,
        {"content-type": "text/html"},
        b"<html><h1>Not here</h1></html>",
        2,
        "HTTP 404: POST http://api.test/jobs answered text/html",
    ),
    (500, {"content-type": "text/plain"}, b"Internal Server Error", 1, "HTTP 500: Internal Server Error"),
    # 18: the message says the address is wrong, so a usage error (it exited 1)
    (405, {"content-type": "application/json"}, b'{"detail": "Method Not Allowed"}', 2, "HTTP 405: Method"),
]


@pytest.mark.parametrize(("status", "headers", "body", "exit_status", "words"), NOT_JSON)
def test_an_answer_that_is_not_the_api_s_json_is_one_line_naming_it(
    status: int,
    headers: dict[str, str],
    body: bytes,
    exit_status: int,
    words: str,
    answers: Callable[[Handler], list[httpx.Request]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A JSONDecodeError or AttributeError traceback before."""
    answers(lambda request: httpx.Response(status, headers=headers, content=body))
    assert cli.main(["submit", spec_file(tmp_path), "--api", "http://api.test"]) == exit_status
    assert words in one_line_error(capsys.readouterr().err, "submit")


# -- 6, 17: addresses that are not ones ---------------------------------------------------------------

BAD_ADDRESSES = [
    ("http://h:abc", "'http://h:abc' is not an address of an optlab API"),
    ("http://[::1", "'http://[::1' is not an address of an optlab API"),
    ("", "the API address is empty"),  # --remote "" ran the checks here
    ("http://user:pw@h:abc", "'***' is not an address"),  # unparseable: no part of it shown
    # "cannot reach the optlab API at http:" and exit 1, as if the API were down
    ("http://", "'http://' is not an address of an optlab API (it names no host)"),
]


@pytest.mark.parametrize("command", ["submit", "study", "check"])
@pytest.mark.parametrize(("url", "words"), BAD_ADDRESSES)
def test_an_address_that_cannot_be_parsed_is_a_usage_error(
    command: str,
    url: str,
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """httpx.InvalidURL's traceback before (the client was built outside any try)."""
    monkeypatch.setattr(cli, "run_local_check", lambda *args: pytest.fail("ran the checks here"))
    argv = (
        ["check", "lion", "--remote", url]
        if command == "check"
        else [command, spec_file(tmp_path), "--api", url]
    )
    assert cli.main(argv) == 2
    line = one_line_error(capsys.readouterr().err, command)
    assert words in line and "pw" not in line, line


def test_an_https_address_of_a_plain_http_server_says_it_did_not_speak_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "cannot reach ...; is `optlab serve` running?" of a server that was running."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # its "Bad request" line is not the CLI's
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert cli.main(["submit", spec_file(tmp_path), "--api", f"https://127.0.0.1:{port}"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    line = one_line_error(capsys.readouterr().err, "submit")
    assert f"the server at https://127.0.0.1:{port} did not speak TLS" in line, line
    assert line.endswith(f"if it serves plain HTTP, give http://127.0.0.1:{port}"), line


# -- 3, 4: Ctrl-C -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "done", "where"),
    [
        ([], 0, "interrupted before the checks started (while loading the target)"),
        (["construct", "dense_step"], 1, "interrupted at check dense_step (2/2)"),
    ],
)
def test_ctrl_c_in_the_checker_says_where_it_stopped(
    ids: list[str], done: int, where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 35-line KeyboardInterrupt traceback from the frameworks before."""

    def interrupted(*args: object) -> None:
        checks_main._PROGRESS.ids, checks_main._PROGRESS.done = ids, done
        raise KeyboardInterrupt

    monkeypatch.setattr(checks_main, "_PROGRESS", checks_main._Progress())
    monkeypatch.setattr(checks_main, "check", interrupted)
    assert checks_main.main(["lion"]) == 130
    assert one_line_error(capsys.readouterr().err, "check") == f"optlab check: {where}"


SLOW_TO_STOP = """#!/bin/sh
trap 'sleep 1; echo "optlab check: interrupted at check construct (1/1)" >&2; exit 130' INT
touch "$STARTED"
while :; do sleep 0.1; done
"""


def test_ctrl_c_lets_the_checker_say_where_it_stopped(tmp_path: Path) -> None:
    """`optlab check` killed its checker 0.25 s after a Ctrl-C (subprocess.run), before it could."""
    returncode, err = ctrl_c_once_started(tmp_path, SLOW_TO_STOP, ["check", "lion"])
    assert returncode == 130
    assert one_line_error(err, "check") == "optlab check: interrupted at check construct (1/1)"


def ctrl_c_once_started(
    tmp_path: Path, job_python: str, argv: list[str], env: dict[str, str] | None = None
) -> tuple[int, str]:
    """`optlab ARGV` with `job_python` (a script that touches $STARTED) as its job environment's
    Python, sent a terminal's Ctrl-C once that has started: its exit status and stderr."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    python = tmp_path / "python"
    python.write_text(job_python)
    python.chmod(0o755)
    started = tmp_path / "started"
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {}), "OPTLAB_JOB_PYTHON": str(python), "STARTED": str(started)},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, to send the group a terminal's Ctrl-C
    )
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)
    return process.returncode, err


LISTING_FOREVER = """#!/bin/sh
touch "$STARTED"
exec sleep 60
"""


def test_ctrl_c_while_the_worker_lists_its_optimizers_is_one_line(tmp_path: Path) -> None:
    """The catalogue's child got the Ctrl-C too (one process group): its KeyboardInterrupt traceback
    was the worker's error, as if the job environment were broken."""
    returncode, err = ctrl_c_once_started(
        tmp_path, LISTING_FOREVER, ["worker"], {"OPTLAB_DATA_DIR": str(tmp_path)}
    )
    assert returncode == 130, err
    assert "Traceback" not in err and "alembic.runtime.plugins" not in err, err
    assert err.strip().splitlines()[-1] == "optlab worker: stopped before it had listed its optimizers"


@pytest.mark.parametrize("answered", [True, False])
def test_ctrl_c_while_following_a_remote_check_says_it_goes_on(
    answered: bool,
    answers: Callable[[Handler], list[httpx.Request]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It exited 130 without a word while the check job ran on."""
    from service import remote_check

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    if answered:
        answers(lambda request: httpx.Response(201, json={"id": 7, "status": "queued"}))
        monkeypatch.setattr(remote_check, "follow_jobs", interrupted)
    else:
        answers(interrupted)  # type: ignore[arg-type]
    monkeypatch.delenv("OPTLAB_TOKEN", raising=False)
    assert cli.main(["check", "lion", "--remote", "http://api.test"]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    if answered:
        assert err == (
            "optlab check: stopped waiting; check job 7 goes on. Follow it at http://api.test/jobs/7; "
            "cancel it with curl -X POST -H 'Content-Type: application/json' http://api.test/jobs/7/cancel"
        )
    else:
        assert (
            err
            == "optlab check: interrupted before the API answered; it may have taken it: see http://api.test/jobs"
        )


# -- 8: a --json path that cannot be written ----------------------------------------------------------


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize(
    ("path", "words"),
    [("missing/r.json", "the folder {tmp}/missing does not exist"), ("", "is a folder; give a file name")],
)
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(
    remote: bool,
    path: str,
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    answers: Callable[[Handler], list[httpx.Request]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A traceback after the whole run before."""
    monkeypatch.setattr(cli, "run_local_check", lambda *args: pytest.fail("ran the checks"))
    seen = answers(lambda request: pytest.fail("submitted the check job"))
    where = ["--remote", "http://api.test"] if remote else []
    assert cli.main(["check", "lion", "--json", str(tmp_path / path), *where]) == 2
    assert words.format(tmp=tmp_path) in one_line_error(capsys.readouterr().err, "check")
    assert not seen


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jobs.checks.report import CheckReport

    report = CheckReport(
        optimizer="lion", framework="torch", style="torch", target="lion", cls="Lion", params={}
    )
    monkeypatch.setattr(checks_main, "check", lambda *args: report)
    assert checks_main.main(["lion", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"optlab check: cannot write the report to {tmp_path}: Is a directory", err


# -- 7: numbers JSON cannot carry, for --remote -------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "text", "words"),
    [
        ("--params", '{"lr": NaN}', "--params: lr must be a finite number; received NaN"),
        ("--params", '{"lr": 1e999}', "--params: lr must be a finite number; received Infinity"),
        (
            "--params",
            '{"betas": [0.9, -Infinity]}',
            "--params: betas.1 must be a finite number; received -Infinity",
        ),
    ],
)
def test_a_remote_check_refuses_numbers_json_cannot_carry(
    option: str,
    text: str,
    words: str,
    answers: Callable[[Handler], list[httpx.Request]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ValueError traceback from the request's encoder before; locally a clean error."""
    seen = answers(lambda request: pytest.fail("submitted"))
    assert cli.main(["check", "lookahead", option, text, "--remote", "http://api.test"]) == 2
    assert one_line_error(capsys.readouterr().err, "check") == f"optlab check: {words}"
    assert not seen


# -- 14: credentials in the API's address -------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "exit_status"),
    [(201, {"id": 1, "status": "queued"}, 0), (404, {"detail": "Not Found"}, 2), (503, None, 1)],
)
def test_credentials_in_the_address_are_never_shown_nor_sent_over_the_token(
    status: int,
    body: dict[str, object] | None,
    exit_status: int,
    answers: Callable[[Handler], list[httpx.Request]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They were printed in messages, and httpx made them a Basic header that replaced the bearer
    token (the API takes bearer tokens only): they are left out, and said to be."""
    from service import client as client_module

    monkeypatch.setattr(client_module, "UNREACHABLE_GRACE_S", 0.0)
    monkeypatch.setattr(client_module, "UNREACHABLE_POLL_S", 0.0)
    monkeypatch.setenv("OPTLAB_TOKEN", "tok-123")
    job = {**(body or {}), "spec": {"optimizer": {"name": "adam"}}}
    seen = answers(
        lambda request: httpx.Response(status, json=job if body else None, text=None if body else "down")
    )
    assert (
        cli.main(["submit", spec_file(tmp_path), "--api", "http://user:s3cret@api.test:8000"]) == exit_status
    )
    out, err = capsys.readouterr()
    assert "s3cret" not in out + err and "user" not in out + err, out + err
    # Said, so that a proxy that asks for them is not a riddle (they had been dropped without a word).
    assert err.startswith(
        "optlab submit: the credentials in the API address are not sent: the API takes a bearer token"
    ), err
    assert status != 201 or out.startswith("job 1 queued: http://api.test:8000/jobs/1")
    assert seen and all(request.headers["authorization"] == "Bearer tok-123" for request in seen)
    assert all(request.url.userinfo == b"" for request in seen)


# -- 12: a job store the settings name wrongly --------------------------------------------------------

BAD_STORES = [
    ({"OPTLAB_DATABASE_URL": "notaurl"}, "invalid OPTLAB_DATABASE_URL notaurl: not a database URL (as in"),
    ({"OPTLAB_DATABASE_URL": "nosuch://h/db"}, "Can't load plugin: sqlalchemy.dialects:nosuch"),
    (
        {"OPTLAB_DATABASE_URL": "mysql://u:s3cret@h/db"},
        "invalid OPTLAB_DATABASE_URL mysql://***@h/db: its database driver is not installed",
    ),
    ({"OPTLAB_DATABASE_URL": "postgresql://u:s3cret@h:abc/db"}, "invalid OPTLAB_DATABASE_URL ***: "),
    ({"OPTLAB_DATA_DIR": "/proc/nope"}, "invalid OPTLAB_DATA_DIR sqlite:////proc/nope/optlab.db: [Errno 2]"),
]


@pytest.mark.parametrize(("env", "words"), BAD_STORES)
def test_a_job_store_url_that_cannot_be_used_is_one_line_naming_the_setting(
    env: dict[str, str], words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLAlchemy's or FileNotFoundError's traceback before (the engine was made outside any try)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["db", "upgrade"]) == 2
    line = one_line_error(capsys.readouterr().err, "db upgrade")
    assert words in line and "s3cret" not in line, line


@pytest.mark.parametrize("command", ["worker", "api"])
def test_the_worker_and_the_api_say_so_too(command: str) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "OPTLAB_DATABASE_URL": "notaurl"}
    ran = subprocess.run(
        [sys.executable, "-m", "service.cli", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    last = ran.stderr.strip().splitlines()[-1]  # after alembic's and the worker's log lines
    assert last.startswith(f"optlab {command}: invalid OPTLAB_DATABASE_URL notaurl: not a database URL"), last


# -- 13: a job environment's Python that cannot be run ------------------------------------------------


@pytest.mark.parametrize("name", ["nowhere/python", "python"])
def test_a_job_python_that_cannot_be_run_is_one_line_naming_the_setting(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FileNotFoundError (or PermissionError) traceback before."""
    python = tmp_path / name
    if name == "python":
        python.write_text("not a program")  # there, but not executable
    monkeypatch.setenv("OPTLAB_JOB_PYTHON", str(python))
    assert cli.main(["check", "lion"]) == 2
    line = one_line_error(capsys.readouterr().err, "check")
    assert line.startswith(
        f"optlab check: cannot run the job environment's Python '{python}' (OPTLAB_JOB_PYTHON): "
    )


# -- 19: a reader that closes the pipe ----------------------------------------------------------------


def test_a_closed_pipe_ends_the_check_quietly_with_141() -> None:
    """`optlab check ... | head -c 10` exited 1 (rich's SystemExit on EPIPE): a failed check, it read."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    process = subprocess.Popen(
        [sys.executable, "-m", "jobs.checks", "torch.optim:SGD", "--only", "construct"],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "160"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.close()  # the reader went away before the table came
    _, err = process.communicate(timeout=300)
    assert process.returncode == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
