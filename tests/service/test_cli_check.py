"""`optlab check`: locally it runs `python -m jobs.checks` in the job environment and passes its
exit status through; with --remote it queues POST /checks and shows the report."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import JobResult, JobStatus
from service import cli, remote_check, store
from service import client as client_module
from service.app import create_app
from service.client import ApiClient
from service.settings import Settings
from tests.conftest import ROOT

FAKE_JOB_PYTHON = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_ARGS_FILE"
case "$FAKE_EXIT_STATUS" in -*) kill "$FAKE_EXIT_STATUS" $$;; esac  # -9: killed by SIGKILL
exit "$FAKE_EXIT_STATUS"
"""


@pytest.fixture
def fake_job_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A job interpreter that records its arguments and exits with $FAKE_EXIT_STATUS (a negative one:
    killed by that signal)."""
    script = tmp_path / "python"
    script.write_text(FAKE_JOB_PYTHON)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPTLAB_JOB_PYTHON", str(script))
    monkeypatch.setenv("FAKE_ARGS_FILE", str(tmp_path / "args"))
    return tmp_path / "args"


@pytest.mark.parametrize("status", [0, 1, 2])
def test_the_checker_runs_in_the_job_environment_and_its_exit_status_passes_through(
    fake_job_python: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    monkeypatch.setenv("FAKE_EXIT_STATUS", str(status))
    argv = ["check", "my_opt.py:Sophia", "--params", '{"lr": 0.1}', "--style", "torch", "--only", "construct"]
    assert cli.main([*argv, "--json", "out.json"]) == status
    forwarded = fake_job_python.read_text().splitlines()
    assert forwarded == [
        "-m", "jobs.checks", "my_opt.py:Sophia", "--params", '{"lr": 0.1}',
        "--style", "torch", "--json", "out.json", "--only", "construct",
    ]  # fmt: skip


# What TensorFlow 2.21 writes on import whatever TF_CPP_MIN_LOG_LEVEL says, and what it must not hide.
CHATTER = """WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796531635.091789    7780 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1796531635.092892    7780 cudart_stub.cc:31] Could not find cuda drivers.
"""
REAL = """W0000 00:00:1796531635.1    7780 gpu_device.cc:2344] Cannot dlopen some GPU libraries.
Traceback (most recent call last):
optlab check: no optimizer named 'nosuch' is registered
"""


def test_tensorflow_s_start_up_chatter_is_dropped_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its INFO lines came before the checker's one-line error (TF_CPP_MIN_LOG_LEVEL no longer hides
    them); a warning, a traceback and the error itself still come through, in order."""
    (tmp_path / "said").write_text(
        CHATTER + REAL.splitlines(keepends=True)[0] + CHATTER + "".join(REAL.splitlines(keepends=True)[1:])
    )
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'said'} >&2\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("OPTLAB_JOB_PYTHON", str(script))
    assert cli.main(["check", "nosuch"]) == 2
    assert capsys.readouterr().err == REAL


@pytest.mark.parametrize(
    ("status", "ended"), [(3, "exited with code 3"), (-9, "was killed by signal SIGKILL")]
)
def test_a_checker_that_ends_without_a_word_is_said_to(
    status: int,
    ended: str,
    fake_job_python: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A class whose step calls os._exit(3) (or a checker the kernel killed) ended `optlab check` with
    that status and no line at all."""
    monkeypatch.setenv("FAKE_EXIT_STATUS", str(status))
    assert cli.main(["check", "my_opt.py:Sophia"]) == (status if status > 0 else 128 - status)
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"optlab check: the checker's process {ended} before its report: "), line
    assert "\n" not in line


def test_a_check_timeout_passes_through_and_is_refused_where_it_cannot_apply(
    fake_job_python: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_EXIT_STATUS", "0")
    assert cli.main(["check", "lion", "--check-timeout", "90"]) == 0
    assert fake_job_python.read_text().splitlines()[-2:] == ["--check-timeout", "90.0"]
    capsys.readouterr()
    assert cli.main(["check", "lion", "--check-timeout", "90", "--remote", "http://optlab.test"]) == 2
    assert capsys.readouterr().err.startswith("optlab check: --check-timeout is for checks run here; ")
    for bad in ("0", "nan", "soon", "1e10"):  # 1e10 s: more than a timer takes (it had been a traceback)
        with pytest.raises(SystemExit) as usage:
            cli.main(["check", "lion", "--check-timeout", bad])
        assert usage.value.code == 2
        said = f"--check-timeout: seconds, a number > 0 and at most 86400 (a day); received '{bad}'"
        assert said in capsys.readouterr().err


RECIPE = (
    '[{"match": {"ndim": ">=2"}, "params": {"use_muon": true}}, '
    '{"match": "rest", "params": {"use_muon": false}}]'
)


def test_stated_needs_a_recipe_and_a_base_pass_through_as_given(
    fake_job_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_EXIT_STATUS", "0")
    setup = ["--needs", '{"closure": true}', "--param-groups", RECIPE, "--base", '{"name": "adamw"}']
    assert cli.main(["check", "lookahead", *setup]) == 0
    forwarded = fake_job_python.read_text().splitlines()
    assert forwarded == ["-m", "jobs.checks", "lookahead", "--params", "{}", *setup]


def optlab_check(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "service.cli", "check", *args]
    environment = {**os.environ, "COLUMNS": "160"}
    environment.pop("OPTLAB_JOB_PYTHON", None)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment)


def test_a_real_check_run_and_a_usage_error(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    ran = optlab_check("torch.optim:SGD", "--only", "construct", "--json", str(report_path))
    assert ran.returncode in (0, 1), ran.stderr
    assert "construct" in ran.stdout
    assert json.loads(report_path.read_text())["checks"][0]["id"] == "construct"

    missing = optlab_check(str(tmp_path / "nowhere.py") + ":Sophia")
    assert missing.returncode == 2
    assert "file not found" in missing.stderr


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", "lion", "--framework", "jax"])
    assert exited.value.code == 2


# -- --remote ---------------------------------------------------------------------------------------


def remote_args(*args: str) -> Any:
    return cli.build_parser().parse_args(["check", *args, "--remote", "http://optlab.test"])


def test_the_remote_body_mirrors_the_local_arguments() -> None:
    body = remote_check.check_body(remote_args("lion", "--style", "keras", "--params", '{"lr": 0.01}'))
    assert body == {
        "framework": "tensorflow",
        "optimizer": {"name": "lion", "params": {"lr": 0.01}, "style": "keras"},
    }
    body = remote_check.check_body(remote_args("lion", "--only", "construct, sparse"))
    assert body == {
        "framework": "torch",
        "optimizer": {"name": "lion", "params": {}},
        "checks": ["construct", "sparse"],
    }
    with pytest.raises(ValueError, match="registered optimizer by name"):
        remote_check.check_body(remote_args("my_opt.py:Sophia"))
    with pytest.raises(ValueError, match="JSON object"):
        remote_check.check_body(remote_args("lion", "--params", "[1]"))


def test_the_remote_body_carries_needs_a_recipe_and_a_base_where_a_check_spec_has_them() -> None:
    args = remote_args(
        "lookahead", "--needs", '{"closure": true}', "--param-groups", RECIPE, "--base", '{"name": "adamw"}'
    )
    assert remote_check.check_body(args)["optimizer"] == {
        "name": "lookahead",
        "params": {},
        "needs": {"closure": True},
        "param_groups": [
            {"match": {"ndim": ">=2"}, "params": {"use_muon": True}},
            {"match": "rest", "params": {"use_muon": False}},
        ],
        "base": {"name": "adamw", "params": {}},
    }
    with pytest.raises(ValueError, match="--needs: unknown need 'closur'; known: closure, create_graph"):
        remote_check.check_body(remote_args("lion", "--needs", '{"closur": true}'))


def test_a_check_spec_with_a_recipe_is_run_with_it(client: TestClient) -> None:
    """The POST /checks body `--remote` sends is validated by the API (a group key adamw never reads is a
    422) and stored; the check job hands the checks the same setup as `python -m jobs.checks` gets."""
    from jobs.check_job import setup_of
    from jobs.spec import CheckSpec

    recipe = '[{"match": {"ndim": "<2"}, "params": {"weight_decay": 0.0}}]'
    body = remote_check.check_body(
        remote_args("adamw", "--param-groups", recipe, "--needs", '{"closure": true}')
    )
    queued = client.post("/checks", json=body)
    assert queued.status_code == 201, queued.text
    setup = setup_of(CheckSpec.model_validate(queued.json()["spec"]))
    assert list(setup.param_groups) == [{"match": {"ndim": "<2"}, "params": {"weight_decay": 0.0}}]
    assert setup.needs == {"closure": True} and setup.base is None
    wrapper = {"name": "lookahead", "params": {"k": 5}, "base": {"name": "adamw", "params": {"lr": 0.01}}}
    assert setup_of(CheckSpec.model_validate({"optimizer": wrapper})).base == wrapper["base"]
    typo = remote_check.check_body(
        remote_args("adamw", "--param-groups", '[{"match": "rest", "params": {"nope": 1}}]')
    )
    refused = client.post("/checks", json=typo)
    assert refused.status_code == 422 and "reads no group key 'nope'" in refused.text


@pytest.fixture
def remote(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    """`optlab check --remote` talks to the test app instead of a server."""

    def api_client(base_url: str) -> ApiClient:
        api = ApiClient(base_url)
        api._http = client
        return api

    monkeypatch.setattr(client_module, "ApiClient", api_client)
    return client


def test_a_refused_remote_check_is_a_usage_error(
    remote: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["check", "nope", "--remote", "http://optlab.test"]) == 2
    assert "unknown optimizer 'nope'" in capsys.readouterr().err


def test_a_remote_check_shows_the_report_and_fails_when_a_check_does(
    remote: TestClient,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checks = [
        {"id": "construct", "status": "pass", "detail": "builds", "figure": None},
        {"id": "sparse", "status": "fail", "detail": "densified the table", "figure": 1000.0},
    ]
    summary = {"pass": 1, "fail": 1, "warn": 0, "skip": 0, "failed": ["sparse"], "warned": []}
    report = {"optimizer": "lion", "style": "torch", "class": "Lion", "checks": checks, "summary": summary}

    def worker_runs_it(client: ApiClient, labels: dict[int, str]) -> dict[int, dict[str, Any]]:
        (job_id,) = labels
        with sessions() as session:
            store.claim_next(session=session, worker_id="w", lease_s=30)
            result = JobResult(
                job_id=str(job_id),
                attempt=1,
                workdir="/tmp/w",
                status=JobStatus.SUCCEEDED,
                report={**report, "duration_s": 1.5},
                steps_completed=2,
            )
            store.finish_job(
                session=session,
                job_id=job_id,
                worker_id="w",
                attempt=1,
                status=JobStatus.SUCCEEDED,
                result=result,
                error=None,
            )
        return {job_id: client.job(job_id)}

    monkeypatch.setattr(remote_check, "follow_jobs", worker_runs_it)
    saved = tmp_path / "report.json"
    argv = [
        "check",
        "lion",
        "--only",
        "construct,sparse",
        "--json",
        str(saved),
        "--remote",
        "http://optlab.test",
    ]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "densified the table" in out and "1 pass, 1 fail, 0 warn, 0 skip" in out
    assert json.loads(saved.read_text())["summary"]["failed"] == ["sparse"]
    with sessions() as session:
        (job,), _ = store.list_jobs(session=session, status=None, kind="check", limit=10, offset=0)
    assert job.spec["checks"] == ["construct", "sparse"]


@pytest.fixture
def remote_with_keras_only(
    settings: Settings,
    sessions: sessionmaker[Session],
    catalogue_data: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[TestClient]:
    """The test app, its catalogue holding `keras_sign_adam` for Keras only and `legacy_lion` for
    tf_legacy only (a user's plugins; the built-ins all exist for torch)."""
    keras = next(o for o in catalogue_data["optimizers"] if o["style"] == "keras")
    legacy = next(o for o in catalogue_data["optimizers"] if o["style"] == "tf_legacy")
    extra = [{**keras, "name": "keras_sign_adam"}, {**legacy, "name": "legacy_lion"}]
    catalogue = {**catalogue_data, "optimizers": [*catalogue_data["optimizers"], *extra]}
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id="test-worker", catalogue=catalogue)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:

        def api_client(base_url: str) -> ApiClient:
            api = ApiClient(base_url)
            api._http = KeptOpen(test_client)  # each `optlab check` closes its client as it ends
            return api

        monkeypatch.setattr(client_module, "ApiClient", api_client)
        yield test_client


class KeptOpen:
    """The test app's client, which one command's close must leave open for the next."""

    def __init__(self, client: TestClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def close(self) -> None:
        pass


def test_a_remote_check_of_a_name_registered_for_tensorflow_only_says_how_to_ask_for_it(
    remote_with_keras_only: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """The service probe: `optlab check probe_sign_adam --remote URL` answered "HTTP 422: ... exists for
    tensorflow only; this job's framework is 'torch'" and no word of --framework."""
    assert cli.main(["check", "keras_sign_adam", "--remote", "http://optlab.test"]) == 2
    err = capsys.readouterr().err
    assert "exists for tensorflow only" in err  # the API's refusal, as it was
    assert (
        "'keras_sign_adam' is registered for tensorflow (style keras), not for torch: check it there with "
        "--framework tensorflow"
    ) in err
    # a name only in tf_legacy: --framework tensorflow would ask for keras; its style says where
    assert cli.main(["check", "legacy_lion", "--remote", "http://optlab.test"]) == 2
    assert "check it there with --style tf_legacy" in capsys.readouterr().err
    # a name the service does not hold, or a refusal about something else: nothing added
    assert cli.main(["check", "nope", "--remote", "http://optlab.test"]) == 2
    assert "registered for" not in capsys.readouterr().err
    bad = [
        "check",
        "keras_sign_adam",
        "--framework",
        "tensorflow",
        "--params",
        '{"nope": 1}',
        "--remote",
        "x",
    ]
    assert cli.main([*bad[:-1], "http://optlab.test"]) == 2
    assert "registered for" not in capsys.readouterr().err
