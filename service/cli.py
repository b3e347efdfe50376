"""`optlab` command line: serve | api | worker | db upgrade | submit | check | study | demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from jobs.checks.report import CHECK_IDS, add_check_timeout
from jobs.result import JobResult, JobStatus
from jobs.spec import styled_optimizer_label
from service.settings import Settings, token_names

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from service.client import ApiClient

# The commands whose processes hold secrets (tokens, the job store's URL) while jobs run other
# people's code as the same user: their environment and memory are kept from other processes.
PRIVATE_COMMANDS = frozenset({"serve", "api", "worker", "demo"})


# Commands that talk to an API as clients ($OPTLAB_TOKEN): an API's token settings in the same
# shell (a bad one, a file only the API may read) are not theirs.
CLIENT_COMMANDS = frozenset({"submit", "study", "check"})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in PRIVATE_COMMANDS:  # before the settings (and a tokens file) are read
        from service.secrets import keep_process_private

        keep_process_private()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll drowns the progress
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # 9 "setup plugin" lines a start
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        for error in exc.errors():  # the message only: the input may be a secret
            print(f"optlab: {setting_error(error)}", file=sys.stderr)
        return 2
    handler = {
        "serve": cmd_serve,
        "api": cmd_api,
        "worker": cmd_worker,
        "submit": cmd_submit,
        "check": cmd_check,
        "study": cmd_study,
        "demo": cmd_demo,
        "db": cmd_db,
    }
    try:
        return handler[args.command](args, settings)
    except KeyboardInterrupt:
        return 130


def setting_error(error: ErrorDetails) -> str:
    """One refused setting in words: the variable and pydantic's message, or a check over several
    settings, whose message names its variables itself (without pydantic's "Value error, ")."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    return f"invalid OPTLAB_{str(error['loc'][0]).upper()}: {message}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optlab", description="Train and compare custom optimizers.")
    commands = parser.add_subparsers(dest="command", required=True)

    for name, help_text in (
        ("serve", "run the API, one worker and a local MLflow server together"),
        ("demo", "start everything, train three optimizers over HTTP, compare them, stop"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--host", help="API host (default 127.0.0.1)")
        sub.add_argument("--port", type=int, help="API port (default 8000)")
        sub.add_argument("--mlflow-port", type=int, help="MLflow port (default 5000)")
        sub.add_argument("--data-dir", type=Path, help="where jobs, databases and artifacts live")
    commands.choices["demo"].add_argument(
        "--specs", type=Path, default=Path("examples/demo"), help="folder of job spec JSON files"
    )

    api = commands.add_parser("api", help="run the HTTP API only")
    api.add_argument(
        "--host",
        help="address to listen on (default $OPTLAB_API_HOST or 127.0.0.1; another needs OPTLAB_API_TOKENS)",
    )
    api.add_argument("--port", type=int, help="port to listen on (default $OPTLAB_API_PORT or 8000)")
    api.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="API processes sharing the port (default 1; one per core uses them all: the queue "
        "quotas hold across processes)",
    )
    worker = commands.add_parser("worker", help="run one worker only (it runs up to --slots jobs at once)")
    worker.add_argument(
        "--slots",
        type=positive_int,
        help="jobs at once (default: one per visible GPU: CUDA_VISIBLE_DEVICES or nvidia-smi -L; else 1)",
    )
    db = commands.add_parser("db", help="the job store: `optlab db upgrade` applies the migrations")
    db.add_argument("action", choices=("upgrade",), help="upgrade: bring the schema to the latest revision")

    submit = commands.add_parser("submit", help="submit a job spec over HTTP")
    submit.add_argument("spec", type=Path, help="job spec, JSON or YAML (.yaml, .yml)")
    submit.add_argument("--wait", action="store_true", help="show progress until the job ends")
    submit.add_argument("--api", help="API URL (default $OPTLAB_API_URL or http://127.0.0.1:8000)")
    add_check_parser(commands)
    study = commands.add_parser("study", help="submit a study (optimizers x grid x seeds) over HTTP")
    study.add_argument("spec", type=Path, help="study spec, JSON or YAML (.yaml, .yml)")
    study.add_argument("--wait", action="store_true", help="show progress, then the ranking and the report")
    study.add_argument("--api", help="API URL (default $OPTLAB_API_URL or http://127.0.0.1:8000)")
    return parser


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1; received {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; received {value}")
    return value


CHECK_HELP = """\
Run the conformance checks on one optimizer class: each known custom-optimizer pitfall
(state lost in a checkpoint, a hyperparameter missing from get_config, sparse gradients,
graph mode, ...) is one check that passes, fails, warns or is skipped, with a one-line
explanation. Locally, the checks run in the job environment ($OPTLAB_JOB_PYTHON) with the
same arguments as `python -m jobs.checks`; with --remote, the optlab API queues a check
job (POST /checks) for a registered optimizer and this follows it.

exit status: 0 when no check fails, 1 when one does, 2 for a usage error
(unknown target, file not found, class not an optimizer, a file that exits when
imported, a --json path that cannot be written, a refused request), 130 for Ctrl-C,
141 when stdout's reader closed the pipe.
"""

CHECK_EXAMPLES = """\
examples:
  optlab check lion
  optlab check my_optimizers.py:Sophia --params '{"lr": 0.001}' --json report.json
  optlab check keras.optimizers:Adam --style keras --only construct,config_roundtrip
  optlab check lion --remote http://127.0.0.1:8000 --framework tensorflow
  optlab check my_optimizers.py:MySAM --needs '{"closure": true}'
  optlab check pytorch_optimizer:Muon \\
      --param-groups '[{"match": {"ndim": ">=2"}, "params": {"use_muon": true}},
                       {"match": "rest", "params": {"use_muon": false}}]'
  optlab check pytorch_optimizer:Lookahead --base '{"name": "adamw", "params": {"lr": 0.001}}'
"""

# What a job spec's optimizer states beyond params, in the same JSON forms (`python -m jobs.checks`
# validates them; with --remote they go into the POST /checks body and the API does).
SETUP_OPTIONS = (
    ("--needs", "needs", "what the loop must do that detection missed, as a job spec's optimizer.needs"),
    ("--param-groups", "param_groups", "torch: a param-group recipe, as a job spec's optimizer.param_groups"),
    ("--base", "base", "torch wrappers: the optimizer they wrap, as a job spec's optimizer.base"),
)


def add_check_parser(commands: Any) -> None:
    check = commands.add_parser(
        "check",
        help="run the conformance checks on an optimizer class (locally, or on the service with --remote)",
        description=CHECK_HELP,
        epilog=CHECK_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "target",
        help="a registered optimizer name, path/to/file.py:ClassName or package.module:ClassName "
        "(--remote: a registered name)",
    )
    check.add_argument("--framework", choices=("torch", "tensorflow"), help="for a name registered in both")
    check.add_argument(
        "--style",
        choices=("torch", "keras", "tf_legacy"),
        help="the class's optimizer API: torch, keras (Keras 3) or tf_legacy (tf.keras.optimizers.legacy); "
        "default: found from the class",
    )
    check.add_argument(
        "--params", default="{}", metavar="JSON", help="hyperparameters as JSON, e.g. '{\"lr\": 0.01}'"
    )
    for option, dest, help_text in SETUP_OPTIONS:
        check.add_argument(option, dest=dest, metavar="JSON", help=help_text)
    check.add_argument(
        "--json", type=Path, dest="json_path", metavar="FILE", help="also write the report (JSON) here"
    )
    check.add_argument(
        "--only", metavar="IDS", help=f"comma-separated check ids (default all: {', '.join(CHECK_IDS)})"
    )
    add_check_timeout(check)
    check.add_argument(
        "--remote",
        metavar="URL",
        help="run on the optlab API at URL (POST /checks) instead of here, and follow its progress",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if getattr(args, "host", None):
        overrides["api_host"] = args.host
    if getattr(args, "port", None):
        overrides["api_port"] = args.port
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    if args.command in CLIENT_COMMANDS:  # the server's tokens are not theirs to read (nor to refuse)
        overrides.update(api_tokens="", api_tokens_file=None)
    settings = Settings(**overrides)
    if args.command in ("serve", "demo"):
        # serve runs its own MLflow, so the tracking URI is where that server listens.
        port = args.mlflow_port or settings.mlflow_port
        settings = settings.model_copy(
            update={"mlflow_port": port, "mlflow_tracking_uri": f"http://{settings.mlflow_host}:{port}"}
        )
    return settings


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from service.secrets import redact_url
    from service.supervisor import ServeError, Supervisor

    supervisor = Supervisor(settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("starting MLflow, the API and a worker (the first start takes a minute)...", flush=True)
    try:
        supervisor.start()
    except ServeError as exc:
        print(f"optlab serve: {exc}", file=sys.stderr)
        return 1
    # From here Ctrl-C only asks to stop: a KeyboardInterrupt raised between the banner and the
    # loop (a signal sent as soon as the banner is read) would skip the orderly stop below.
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        f"\noptlab is up\n  API       {supervisor.api_url}\n  API docs  {supervisor.api_url}/docs\n"
        f"  MLflow UI {redact_url(supervisor.mlflow_url)}\n  data      {supervisor.data_dir}\n"
        f"  access    {access_line(settings)}\n"
        "Ctrl-C stops everything.",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            for line in supervisor.restart_exited():
                print(f"optlab serve: {line}", file=sys.stderr, flush=True)
    except ServeError as exc:
        print(f"optlab serve: {exc}", file=sys.stderr)
        supervisor.stop()
        return 1
    print("stopping...", flush=True)
    supervisor.stop()
    return 0


def access_line(settings: Settings) -> str:
    """Who may use the API, for serve's banner (names and scopes, never a token)."""
    if not settings.tokens:
        return "open: no OPTLAB_API_TOKENS, so anyone on this machine may submit, cancel and read"
    return f"bearer tokens of {token_names(settings.tokens)}"


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from service.app import create_app
    from service.settings import LOOPBACK_HOSTS

    if not settings.tokens and settings.api_host not in LOOPBACK_HOSTS:
        print(
            f"optlab api: refusing to listen on {settings.api_host} without access control: anyone "
            "who reaches it could submit, cancel and read every job. Set OPTLAB_API_TOKENS (or "
            "OPTLAB_API_TOKENS_FILE), or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    engine = open_store(settings, "optlab api")  # a bad URL in one line, before any process starts
    if engine is None:
        return 2
    engine.dispose()
    if args.workers == 1:
        uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port, log_level="info")
        return 0
    # Each worker process builds its own app from the same environment (only host and port come
    # from the command line, and uvicorn applies those).
    uvicorn.run(
        "service.app:create_private_app",
        factory=True,
        workers=args.workers,
        host=settings.api_host,
        port=settings.api_port,
        log_level="info",
    )
    return 0


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from service.db import migrate, session_factory
    from service.secrets import redact_url
    from service.worker import CatalogueError, Worker, install_stop_handlers

    engine = open_store(settings, "optlab worker")
    if engine is None:
        return 2
    try:
        migrate(engine)
    except Exception as exc:  # unreachable database, no permission: one line, as `db upgrade` says it
        print(f"optlab worker: {redact_url(settings.resolved_database_url)}: {exc}", file=sys.stderr)
        return 1
    worker = Worker(settings, session_factory(engine), slots=args.slots)
    install_stop_handlers(worker.stopping.set)
    try:
        worker.publish_catalogue()
    except CatalogueError as exc:
        if worker.stopping.is_set():  # Ctrl-C reached the catalogue's child too: not its fault
            print("optlab worker: stopped before it had listed its optimizers", file=sys.stderr)
            return 130
        print(f"optlab worker: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. the database refused the catalogue: say so, not a traceback
        print(f"optlab worker: could not publish the optimizer catalogue: {exc}", file=sys.stderr)
        return 1
    worker.run_forever()
    return 0


def open_store(settings: Settings, command: str) -> Engine | None:
    """The job store's engine; None, with one line naming the setting, for a URL SQLAlchemy cannot
    take (not a URL, a driver not installed) or a data folder that cannot be made."""
    from sqlalchemy.exc import ArgumentError

    from service.db import make_engine
    from service.secrets import redact_url

    setting = "OPTLAB_DATABASE_URL" if settings.database_url else "OPTLAB_DATA_DIR"
    shown = f"{command}: invalid {setting} {redact_url(settings.resolved_database_url)}"
    try:
        return make_engine(settings.resolved_database_url)
    except ArgumentError as exc:  # its message may quote the URL, and so a password: not shown
        problem = str(exc) if "plugin" in str(exc) else "not a database URL"
        allowed = "sqlite:////path/to/optlab.db or postgresql+psycopg://user:password@host/optlab"
        print(f"{shown}: {problem} (as in {allowed})", file=sys.stderr)
    except ImportError as exc:  # mysql:// without its driver
        print(f"{shown}: its database driver is not installed ({exc})", file=sys.stderr)
    except (OSError, ValueError) as exc:  # a data folder that cannot be made, a port that is not a number
        print(f"{shown}: {exc}", file=sys.stderr)
    return None


def cmd_db(args: argparse.Namespace, settings: Settings) -> int:
    """Migrations on demand (the API and workers still apply them when they start)."""
    from service.db import migrate
    from service.secrets import redact_url

    engine = open_store(settings, "optlab db upgrade")
    if engine is None:
        return 2
    try:
        migrate(engine)
    except Exception as exc:  # unreachable database, no permission: one line, no traceback
        print(f"optlab db upgrade: {redact_url(settings.resolved_database_url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    print(f"optlab db upgrade: {redact_url(settings.resolved_database_url)} is at the latest revision")
    return 0


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from service.client import ApiError, error_of, result_of, status_of
    from service.progress import follow_jobs

    spec = read_spec(args.spec, "optlab submit")
    if spec is None:
        return 2
    client = api_client(args, settings, "optlab submit")
    if client is None:
        return 2
    url = client.base_url  # without credentials: it is printed
    job: dict[str, Any] | None = None
    try:
        job = client.submit(spec)
        print(f"job {job['id']} {job['status']}: {url}/jobs/{job['id']}")
        notice = failed_check_notice(client, job["spec"])
        if notice:
            print(f"  note: {notice}")
        if not args.wait:
            return 0
        label = styled_optimizer_label(job["spec"]["optimizer"], job["spec"].get("framework", "torch"))
        final = follow_jobs(client, {job["id"]: label})[job["id"]]
    except ApiError as exc:
        print(f"optlab submit: {exc}", file=sys.stderr)
        if job is not None and exc.status_code != 404:  # the waiting failed, not the job (a token revoked)
            print(f"  job {job['id']} goes on: {url}/jobs/{job['id']}", file=sys.stderr)
        return 2 if exc.is_usage_error else 1
    except KeyboardInterrupt:
        what = None if job is None else (f"job {job['id']}", f"{url}/jobs/{job['id']}")
        print(stopped_waiting("optlab submit", what, f"{url}/jobs"), file=sys.stderr)
        return 130
    finally:
        client.close()
    status, error = status_of(final), error_of(final)
    print(f"job {final['id']} {status}{final_metrics(result_of(final))}")
    if error is not None:
        print(f"  {error.type}: {error.message}")
    if final.get("mlflow"):
        print(f"  MLflow run: {final['mlflow']['run_url']}")
    return 0 if status is JobStatus.SUCCEEDED else 1


def study_check_notices(client: ApiClient, spec: dict[str, Any]) -> list[str]:
    """`failed_check_notice` for each optimizer of a study, once per name and style; none more after
    a question the API did not answer (each could wait NOTICE_TIMEOUT_S)."""
    from service.client import ApiError

    framework = spec.get("framework", "torch")
    chosen = {(o.get("name"), o.get("style")) for o in spec.get("optimizers", []) if isinstance(o, dict)}
    notices = []
    for name, style in sorted(chosen, key=str):
        if not isinstance(name, str):
            continue
        try:
            notice = check_notice(
                client, {"framework": framework, "optimizer": {"name": name, "style": style}}
            )
        except ApiError:
            break
        if notice:
            notices.append(notice)
    return notices


# How long the job's submission waits to say its optimizer failed its latest check: a notice.
NOTICE_TIMEOUT_S = 5.0


def failed_check_notice(client: ApiClient, spec: dict[str, Any]) -> str | None:
    """That the job's optimizer failed its latest conformance check, where it did: nothing had said
    so at submission, and the job ran into what the check had found. None where it passed, was never
    checked, or the API cannot say (a notice, never the submission's outcome)."""
    from service.client import ApiError

    try:
        return check_notice(client, spec)
    except ApiError:
        return None


def check_notice(client: ApiClient, spec: dict[str, Any]) -> str | None:
    """`failed_check_notice`, raising ApiError where the API does not answer."""
    optimizer = spec["optimizer"]
    name, framework = optimizer["name"], spec.get("framework", "torch")
    implementations = client.optimizer(name, timeout_s=NOTICE_TIMEOUT_S).get("implementations", [])
    style = optimizer.get("style") or ("torch" if framework == "torch" else None)
    chosen = [
        i for i in implementations if i.get("framework") == framework and style in (None, i.get("style"))
    ]
    latest = (chosen[0].get("latest_check") if chosen else None) or {}
    if not latest.get("fail"):
        return None
    return (
        f"optimizer {name!r} ({chosen[0].get('style')}) failed its latest conformance check (check job "
        f"{latest.get('job_id')}: {', '.join(latest.get('failed', []))}): {client.base_url}/optimizers/{name}"
    )


def final_metrics(result: JobResult | None) -> str:
    """`: val/accuracy 0.9611, val/loss 0.1234, train/loss 0.0987`, the job's last evaluation (validation
    first), as MLflow names them; empty for a job that reached none. "job 7 succeeded" alone had
    sent the user to MLflow for the one figure they waited for."""
    final = (result.final if result is not None else None) or {}
    keys = sorted(final, key=lambda key: (not key.startswith("val_"), key))
    shown = [f"{key.replace('_', '/', 1)} {final[key]:.4g}" for key in keys]
    return f": {', '.join(shown)}" if shown else ""


def cmd_study(args: argparse.Namespace, settings: Settings) -> int:
    from service.client import ApiError
    from service.studies.follow import comparison_lines, follow_study, problem_lines, ranking_table
    from service.studies.summary import StudySummary

    spec = read_spec(args.spec, "optlab study")
    if spec is None:
        return 2
    client = api_client(args, settings, "optlab study")
    if client is None:
        return 2
    url = client.base_url  # without credentials: it is printed
    study: dict[str, Any] | None = None
    try:
        study = client.submit_study(spec)
        print(
            f"study {study['id']} {study['status']}: {len(study['jobs'])} jobs, {url}/studies/{study['id']}"
        )
        for notice in study_check_notices(client, spec):
            print(f"  note: {notice}")
        if not args.wait:
            return 0
        study = follow_study(client, study["id"])
    except ApiError as exc:
        print(f"optlab study: {exc}", file=sys.stderr)
        if study is not None and exc.status_code != 404:  # the waiting failed, not the study
            print(f"  study {study['id']} goes on: {url}/studies/{study['id']}", file=sys.stderr)
        return 2 if exc.is_usage_error else 1
    except KeyboardInterrupt:
        what = None if study is None else (f"study {study['id']}", f"{url}/studies/{study['id']}")
        print(stopped_waiting("optlab study", what, f"{url}/studies"), file=sys.stderr)
        return 130
    finally:
        client.close()
    import shutil

    from rich.console import Console
    from rich.text import Text

    # Wide enough for the ranking's columns whole, also when the output is not a terminal.
    console = Console(width=max(shutil.get_terminal_size().columns, 120))
    if study.get("summary"):
        summary = StudySummary.model_validate(study["summary"])
        console.print(ranking_table(summary))
        for line in [*comparison_lines(summary), *summary.notes, *problem_lines(summary)]:
            console.print(Text(line))  # not markup: a note may quote brackets
    print(f"report: {url}{study['report_url']}")  # plain print: an address is never wrapped
    if study.get("mlflow"):
        print(f"MLflow: {study['mlflow']['url']}")
    return study_exit_status(study)


def api_client(args: argparse.Namespace, settings: Settings, command: str) -> ApiClient | None:
    """The client of the API `api_url` names; None, said in a line, for an address that is not one."""
    from service.client import connect

    return connect(api_url(args, settings), command)


def api_url(args: argparse.Namespace, settings: Settings) -> str:
    """--api, else $OPTLAB_API_URL, else the API's own settings; an empty --api is kept, to be refused
    (it had meant the default)."""
    if args.api is not None:
        return str(args.api)
    return os.environ.get("OPTLAB_API_URL") or f"http://{settings.api_host}:{settings.api_port}"


def stopped_waiting(command: str, what: tuple[str, str] | None, listing: str) -> str:
    """Ctrl-C stops the waiting, not the work: say so, and how to follow or cancel it (it had exited
    130 without a word while the job trained on). `what`: its name and address; None when the
    submission itself was interrupted, so whether the API took it is not known."""
    if what is None:
        return f"\n{command}: interrupted before the API answered; it may have taken it: see {listing}"
    name, address = what
    auth = ' -H "Authorization: Bearer $OPTLAB_TOKEN"' if os.environ.get("OPTLAB_TOKEN") else ""
    return (
        f"\n{command}: stopped waiting; {name} goes on. Follow it at {address}; cancel it with "
        f"curl -X POST -H 'Content-Type: application/json'{auth} {address}/cancel"
    )


def study_exit_status(study: dict[str, Any]) -> int:
    """1 when a job of the ended study failed (an error: the optimizer's code, or the machine's), else
    0: a rate that diverged is a finding of a learning-rate sweep, and a cancel was asked for, and the
    summary says of both. (It had been 1 for anything but every job succeeding.)"""
    return 1 if study["progress"]["counts"].get("failed") else 0


def read_spec(path: Path, command: str) -> Any:
    """A spec file as the request will send it (JSON, or YAML by its suffix); None, with the reason
    printed, when it cannot be read or holds a value JSON cannot carry. A hint only where it fits the
    problem: a non-finite number, a YAML alias inside itself, a tagged value JSON has not."""
    import yaml  # type: ignore[import-untyped]  # PyYAML comes with mlflow

    try:
        text = path.read_text()
        spec = (
            yaml.load(text, Loader=_yaml_loader(yaml))
            if path.suffix in YAML_SUFFIXES
            else json.loads(text, object_pairs_hook=_keys_once)
        )
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"{command}: cannot read {path}: {parse_problem(path, exc, yaml)}", file=sys.stderr)
        return None
    except RecursionError:
        print(f"{command}: cannot read {path}: {NESTED_TOO_DEEP}", file=sys.stderr)
        return None
    if not isinstance(spec, dict):  # an empty file, `null`, a comment-only YAML: None said nothing
        kinds = {list: "a list", str: "text", bool: "a boolean", int: "a number", float: "a number"}
        held = f"holds {kinds.get(type(spec), f'a {type(spec).__name__}')}"
        if spec is None:
            held = "holds null (or only comments)" if text.strip() else "is empty"
        print(f"{command}: spec file {path} {held}; a JSON object is expected", file=sys.stderr)
        return None
    try:
        json.dumps(spec, allow_nan=False)
    except RecursionError:
        print(f"{command}: {path}: {NESTED_TOO_DEEP}", file=sys.stderr)
        return None
    except ValueError as exc:  # NaN or an infinity (json.loads reads them), or a YAML alias inside itself
        finite = "numbers must be finite (JSON has no NaN or Infinity)"
        hint = finite if "float" in str(exc) else "a YAML alias may not refer to what contains it"
        print(f"{command}: {path}: {exc}: {hint}", file=sys.stderr)
        return None
    except TypeError as exc:  # a value tagged as one JSON has not (`!!binary`, `!!timestamp`)
        print(f"{command}: {path}: {exc}: a spec holds JSON's values only", file=sys.stderr)
        return None
    return spec


NESTED_TOO_DEEP = "nested too deep to read (the API takes at most 32 levels)"
YAML_SUFFIXES = (".yaml", ".yml")


def parse_problem(path: Path, exc: Exception, yaml: Any) -> str:
    """Why a spec file did not parse, in one line: where (line, column) and what. PyYAML's own message
    took four lines, naming "<unicode string>" and drawing a caret; JSON's named no file kind, so a
    YAML spec in a .txt file read as a bare "Expecting value"."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = str(exc.problem)
        if "'\\t'" in problem:  # PyYAML says '\t' of a tab: the fix is what a reader needs
            problem += " (YAML indents with spaces, not tabs)"
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if isinstance(exc, json.JSONDecodeError):
        said = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
        if path.suffix not in (".json", *YAML_SUFFIXES):
            said += "; a spec is JSON, or YAML in a file named .yaml or .yml"
        return said
    return str(exc)


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (json.loads keeps the last of two silently)."""
    spec: dict[str, Any] = {}
    for key, value in pairs:
        if key in spec:
            raise ValueError(f"duplicate key {key!r}: give each key once")
        spec[key] = value
    return spec


def _yaml_loader(yaml: Any) -> Any:
    """PyYAML's safe loader, reading plain values as YAML 1.2 and JSON read them. PyYAML follows
    YAML 1.1: a float needs a dot there (`1e-3` reached the API as the text "1e-3"), `on`, `off`,
    `yes` and `no` are booleans (`name: on` was refused as "received true"), and `2024-01-01` is a
    date (which JSON cannot carry). Here only true and false are booleans, and there are no dates."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            """Refuse a key given twice in one mapping: PyYAML keeps the last silently, so
            `steps: 50` then `steps: 60` trained 60 steps without a word."""
            first_lines: dict[str, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges keys that may be given again beside it
                line = key_node.start_mark.line + 1
                if key_node.value in first_lines:
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {key_node.value!r} (also on line "
                        f"{first_lines[key_node.value]}): give each key once",
                        problem_mark=key_node.start_mark,
                    )
                first_lines[key_node.value] = line
            return super().construct_mapping(node, deep=deep)

    dropped = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    Loader.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag not in dropped]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    booleans = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", booleans, list("tTfF"))
    exponent_only = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_only, list("-+0123456789"))
    return Loader


def cmd_check(args: argparse.Namespace, settings: Settings) -> int:
    problem = args.json_path is not None and report_path_problem(args.json_path)
    if problem:  # said before the run, not in a traceback after it
        print(f"optlab check: {problem}", file=sys.stderr)
        return 2
    if args.remote is not None:  # an empty one too: a usage error, not a local run
        from service.remote_check import run_remote_check

        return run_remote_check(args)
    return run_local_check(args, settings)


def report_path_problem(path: Path) -> str | None:
    """Why the report cannot be written at --json's path, or None."""
    if path.is_dir():
        return f"--json {path} is a folder; give a file name for the report, as in {path / 'report.json'}"
    folder = path.parent
    if not folder.is_dir():
        return f"--json {path}: the folder {folder} does not exist; create it or give another path"
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"--json {path}: permission denied; give a path you may write to"
    return None


def run_local_check(args: argparse.Namespace, settings: Settings) -> int:
    """`python -m jobs.checks` in the job environment: the frameworks never load in this process."""
    command = [settings.job_python, "-m", "jobs.checks", args.target, "--params", args.params]
    for option, value in (
        ("--framework", args.framework),
        ("--style", args.style),
        ("--json", args.json_path),
        ("--only", args.only),
        ("--check-timeout", args.check_timeout),
        *((option, getattr(args, dest)) for option, dest, _ in SETUP_OPTIONS),
    ):
        if value is not None:
            command += [option, str(value)]
    try:
        process = subprocess.Popen(command, stderr=subprocess.PIPE)
    except OSError as exc:  # no such interpreter, or not one that can be run
        print(
            f"optlab check: cannot run the job environment's Python {settings.job_python!r} "
            f"(OPTLAB_JOB_PYTHON): {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    assert process.stderr is not None
    relay = relay_stderr(process.stderr)
    try:
        returncode = process.wait()
    except KeyboardInterrupt:  # the checker got the Ctrl-C too (one process group): it says where
        try:
            returncode = process.wait(timeout=CHECKER_STOP_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
            with contextlib.suppress(KeyboardInterrupt):
                relay.join(RELAY_DRAIN_S)
            print("\noptlab check: interrupted", file=sys.stderr)
            return 130
    try:
        relay.join(RELAY_DRAIN_S)  # its last lines before this process's own
    except KeyboardInterrupt:  # while a process the checker left holds its stderr open
        print("\noptlab check: interrupted", file=sys.stderr)
        return 130
    if returncode not in CHECKER_EXIT_STATUSES:  # it ended without a word (os._exit, a crash, the OOM killer)
        from jobs.processes import how_it_ended

        print(
            f"optlab check: the checker's process {how_it_ended(returncode)} before its report: code the "
            "checks ran ended it (os._exit, a crash in native code, the kernel's out-of-memory killer), in "
            "the check after the last one shown",
            file=sys.stderr,
        )
    return returncode if returncode >= 0 else 128 - returncode  # killed by a signal: as a shell says


# TensorFlow's C++ start-up lines ("oneDNN custom operations are on", "cudart_stub ... Could not find
# cuda drivers"): TensorFlow 2.21 writes them before absl::InitializeLog, where the checker's
# TF_CPP_MIN_LOG_LEVEL=2 no longer reaches, so they came before a one-line error. Only absl's INFO
# lines (`I0000 00:00:... file.cc:153] ...`) and the banner before them are dropped; warnings and
# errors pass.
TENSORFLOW_CHATTER = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+\s+\d+ [\w.-]+:\d+\] .*"
)
# How long the checker's last stderr lines may take to arrive once it has ended (a process it left
# behind may hold the pipe open).
RELAY_DRAIN_S = 5.0


def relay_stderr(source: IO[bytes]) -> threading.Thread:
    """Copy the checker's stderr to ours as it comes, a line at a time, less TensorFlow's start-up
    chatter."""

    def relay() -> None:
        writable = True
        with source:
            for raw in iter(source.readline, b""):  # read to the end: a full pipe would stall the checker
                line = raw.decode(errors="replace")
                if writable and not TENSORFLOW_CHATTER.fullmatch(line.rstrip("\r\n")):
                    try:
                        sys.stderr.write(line)
                        sys.stderr.flush()
                    except OSError:  # our stderr's reader went away
                        writable = False

    thread = threading.Thread(target=relay, name="checker-stderr", daemon=True)
    thread.start()
    return thread


# What the checker says itself: passed, a check failed, a usage error, Ctrl-C, a closed pipe.
CHECKER_EXIT_STATUSES = frozenset({0, 1, 2, 130, 141})


# How long a Ctrl-C'd checker has to say where it stopped before it is killed.
CHECKER_STOP_S = 10.0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from service.demo import run_demo

    return run_demo(settings, args.specs)


if __name__ == "__main__":
    raise SystemExit(main())
