"""Planted secrets (a job-store password, MLflow credentials, an API token) must appear nowhere a
job or a user can read them: the job's folder, its command line and environment, the logs, the
API's answers. The job program is a stand-in that records what it was given (see test_worker)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service import store
from service.app import create_app
from service.db import make_engine, migrate, session_factory
from service.secrets import job_environment, redact_url, split_credentials
from service.settings import Settings
from service.worker import Worker, produce_catalogue
from tests.postgres import throwaway_database
from tests.service.test_api import GOOD
from tests.service.test_worker import stand_in

DB_SECRET = "planted-db-password-4711"
MLFLOW_SECRET = "planted-mlflow-password-4712"
TOKEN_SECRET = "planted-api-token-4713-abcdefgh"
SECRETS = (DB_SECRET, MLFLOW_SECRET, TOKEN_SECRET)

# Records its arguments and environment (the MLflow password only as "it was given"), then
# reports progress and a result naming the tracking URI it was handed, as jobs.run does.
RECORDER = """\
printf '%s\\n' "$0" "$@" > "$W/argv.txt"
env | grep -v '^MLFLOW_TRACKING_PASSWORD=' > "$W/env.txt"
if [ "$MLFLOW_TRACKING_PASSWORD" = "{password}" ] && [ "$MLFLOW_TRACKING_USERNAME" = "mlflow-user" ]; then
  touch "$W/mlflow-credentials-given"
fi
URI=$(grep -A1 -- '--tracking-uri' "$W/argv.txt" | tail -1)
MLFLOW='"mlflow": {{"tracking_uri": "'$URI'", "experiment_id": "1", "run_id": "r1", '
MLFLOW="$MLFLOW"'"run_url": "'$URI'/#/r1"}}'
echo '{{"step": 1, "total": 300, "loss": 0.5, '"$MLFLOW"'}}' > "$W/progress.json"
sleep 0.5
echo '{{"job_id": "1", "attempt": 1, "workdir": "'$W'", "status": "succeeded", '\
'"steps_completed": 300, '"$MLFLOW"'}}' > "$W/result.json"
"""


@pytest.fixture
def database_with_password() -> Iterator[str]:
    """A throwaway PostgreSQL database reached with a password in its URL (trust auth ignores it)."""
    with throwaway_database("optlab_secrets") as url:
        yield url.replace("postgres@", f"postgres:{DB_SECRET}@", 1)


def test_a_planted_secret_is_nowhere_a_job_or_a_user_can_read_it(
    tmp_path: Path,
    database_with_password: str,
    catalogue_data: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    environment = {
        "OPTLAB_DATA_DIR": str(tmp_path / "data"),
        "OPTLAB_DATABASE_URL": database_with_password,
        "OPTLAB_MLFLOW_TRACKING_URI": f"http://mlflow-user:{MLFLOW_SECRET}@127.0.0.1:9/",
        "OPTLAB_API_TOKENS": f"alice:{TOKEN_SECRET}",
        "OPTLAB_TRUSTED_HOSTS": "testserver",
        "OPTLAB_TOKEN": TOKEN_SECRET,
        "PGPASSWORD": DB_SECRET,
    }
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    engine = make_engine(settings.resolved_database_url)
    migrate(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        store.publish_catalogue(session=session, worker_id="w", catalogue=catalogue_data)
    answers = []
    auth = {"Authorization": f"Bearer {TOKEN_SECRET}"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answers.append(client.post("/jobs", json=GOOD, headers=auth).text)
        fast = settings.model_copy(
            update={
                "job_python": stand_in(tmp_path, RECORDER.format(password=MLFLOW_SECRET)),
                "poll_interval_s": 0.1,
            }
        )
        assert Worker(fast, sessions, worker_id="w").run_next()
        for path in ("/jobs/1", "/jobs", "/healthz", "/optimizers/adam"):
            answers.append(client.get(path, headers=auth).text)
        answers.append(client.get("/jobs/1", headers={"Authorization": "Bearer wrong-but-long-enough"}).text)
        answers.append(client.get("/openapi.json", headers=auth).text)
    engine.dispose()

    job = json.loads(answers[1])
    assert job["status"] == "succeeded", job
    assert job["mlflow"]["tracking_uri"] == "http://127.0.0.1:9"
    workdir = Path(job["result"]["workdir"])
    assert (workdir / "mlflow-credentials-given").exists(), "MLflow credentials must reach the job"
    argv = (workdir / "argv.txt").read_text()
    assert "--tracking-uri\nhttp://127.0.0.1:9\n" in argv
    env = (workdir / "env.txt").read_text()
    assert "OPTLAB_DATABASE_URL" not in env and "OPTLAB_API_TOKENS" not in env and "PGPASSWORD" not in env
    files = [path for path in (tmp_path / "data").rglob("*") if path.is_file()]
    assert len(files) >= 5, files  # spec.json, argv, env, progress, result, job.log ...
    for secret in SECRETS:
        for path in files:
            assert secret not in path.read_text(errors="replace"), f"{secret} in {path}"
        assert secret not in caplog.text, f"{secret} in the logs"
        for answer in answers:
            assert secret not in answer, answer


def test_the_catalogue_child_gets_no_secrets_either(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTLAB_DATABASE_URL", f"postgresql+psycopg://u:{DB_SECRET}@db/x")
    monkeypatch.setenv("OPTLAB_API_TOKENS", f"alice:{TOKEN_SECRET}")
    dump = tmp_path / "env.txt"
    script = stand_in(
        tmp_path, f'env > {dump}\necho \'{{"optimizers": [], "schedules": [], "workloads": []}}\''
    )
    produce_catalogue(Settings(data_dir=tmp_path, job_python=script))
    assert DB_SECRET not in dump.read_text() and TOKEN_SECRET not in dump.read_text()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://u:pw@mlflow.example:5000/x", "https://***@mlflow.example:5000/x"),
        ("https://token@mlflow.example/", "https://***@mlflow.example/"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("https://h/p?api_key=abc&run=1#/x", "https://h/p?api_key=***&run=1#/x"),
        ("http://[::1]:5000/", "http://[::1]:5000/"),
        ("http://u:pw@h:notaport/", "***"),
    ],
)
def test_urls_are_shown_without_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_credentials_leave_the_uri_for_mlflows_variables() -> None:
    assert split_credentials("https://me:p%40ss@h:5000/m") == ("https://h:5000/m", "me", "p@ss")
    env, uri = job_environment(
        {
            "PATH": "/bin",
            "OPTLAB_PLUGIN_DIRS": "/p",
            "OPTLAB_DATA_ROOTS": "/d",
            "OPTLAB_DATABASE_URL": "x",
            "OPTLAB_API_TOKENS": "y",
            # compose's .env (the worker's env_file) holds the PostgreSQL password, and a user's
            # client token may be set where the worker starts; other tools' passwords are not the job's.
            "POSTGRES_PASSWORD": DB_SECRET,
            "POSTGRES_PASSWORD_FILE": "/run/secrets/pg",
            "OPTLAB_TOKEN": TOKEN_SECRET,
            "SMTP_PASSWORD": "z",
            "redis_passwd": "z",
        },
        "https://me:secret@h/",
    )
    assert uri == "https://h/"
    assert env == {
        "PATH": "/bin",
        "OPTLAB_PLUGIN_DIRS": "/p",
        "OPTLAB_DATA_ROOTS": "/d",  # where workloads may read data files
        "MLFLOW_TRACKING_USERNAME": "me",
        "MLFLOW_TRACKING_PASSWORD": "secret",
        "PYTHONUNBUFFERED": "1",
    }
    # MLflow's own credential variables are the job's: it logs to MLflow with them.
    env, _ = job_environment({"MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_TOKEN": "t"}, "http://h/")
    assert env == {"MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_TOKEN": "t", "PYTHONUNBUFFERED": "1"}


def test_a_bad_tracking_uri_is_refused_without_echoing_its_password() -> None:
    with pytest.raises(ValueError) as caught:
        Settings(mlflow_tracking_uri=f"ftp://u:{MLFLOW_SECRET}@h/")
    assert MLFLOW_SECRET not in str(caught.value) and "ftp://***@h/" in str(caught.value)


def test_the_cli_names_a_bad_token_setting_without_showing_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    monkeypatch.setenv("OPTLAB_API_TOKENS", f"alice:{TOKEN_SECRET}:admin")
    assert main(["api"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("optlab: OPTLAB_API_TOKENS entry 1: the scope after the token may only be 'read'")
    assert TOKEN_SECRET not in err and "Value error" not in err


# A process that makes itself private, as its user or (under root) as `nobody`, then waits to be
# looked at. Under root every /proc file is readable anyway, so what is asserted is the kernel's
# mark of a private process: its /proc/PID/environ is owned by root, not by the process's user.
PRIVATE_CHILD = """\
import ctypes, os, sys, time
from service.secrets import keep_process_private
if os.geteuid() == 0:
    os.setuid(65534)  # changing user makes a process private by itself: start from an ordinary one
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
if sys.argv[1] == "private":
    keep_process_private()
print(os.geteuid(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["private", "ordinary"])
def test_a_private_process_keeps_its_environment_from_other_processes_of_its_user(mode: str) -> None:
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", PRIVATE_CHILD, mode], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        user = int(child.stdout.readline())
        owner = os.stat(f"/proc/{child.pid}/environ").st_uid
    finally:
        child.kill()
        child.wait()
    assert user != 0
    assert owner == (0 if mode == "private" else user)


def test_serve_starts_only_the_api_with_the_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service import supervisor as supervisor_module

    started: dict[str, dict[str, str]] = {}

    def start(command: list[str], **popen: Any) -> Any:
        started[command[-1] if command[-1] in ("api", "worker") else "mlflow"] = popen["env"]
        raise supervisor_module.ServeError("stop here")

    monkeypatch.setenv("OPTLAB_API_TOKENS", f"alice:{TOKEN_SECRET}")
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"bob:{TOKEN_SECRET[::-1]}\n")
    monkeypatch.setenv("OPTLAB_API_TOKENS_FILE", str(tokens_file))
    monkeypatch.setenv("PGPASSWORD", DB_SECRET)
    monkeypatch.setattr(supervisor_module, "start_in_own_group", start)
    serve = supervisor_module.Supervisor(Settings(data_dir=tmp_path))
    serve.logs.mkdir()
    (serve.logs / "api.log").write_text("an earlier version's log\n")
    (serve.logs / "api.log").chmod(0o644)
    for name, command in (
        ("mlflow", serve._mlflow_command()),
        ("api", ["python", "-m", "service.cli", "api"]),
        ("worker", ["python", "-m", "service.cli", "worker"]),
    ):
        with pytest.raises(supervisor_module.ServeError):
            serve._start(name, command, {}, [])
    assert started["api"]["OPTLAB_API_TOKENS"] == f"alice:{TOKEN_SECRET}"
    assert {(serve.logs / f"{part}.log").stat().st_mode & 0o777 for part in started} == {0o600}
    for part in ("mlflow", "worker"):
        assert "OPTLAB_API_TOKENS" not in started[part] and "OPTLAB_API_TOKENS_FILE" not in started[part]
    # MLflow is not made private: it gets no optlab setting and no other credential either.
    assert not [name for name in started["mlflow"] if name.startswith("OPTLAB_") or name == "PGPASSWORD"]
    assert started["worker"]["PGPASSWORD"] == DB_SECRET  # the worker's own store may need it


def test_optlab_api_makes_its_process_private_as_every_command_listed_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service import cli, secrets

    made_private: list[bool] = []
    monkeypatch.setattr(secrets, "keep_process_private", lambda: made_private.append(True))
    monkeypatch.delenv("OPTLAB_API_TOKENS", raising=False)
    monkeypatch.setenv("OPTLAB_DATA_DIR", str(tmp_path))
    assert cli.main(["api", "--host", "0.0.0.0"]) == 2  # refused at once, after it was made private
    assert made_private == [True]
    assert cli.PRIVATE_COMMANDS == {"serve", "api", "worker", "demo"}
