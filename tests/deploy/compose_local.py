"""docker-compose.yml without Docker: each service's exact command and environment, as a real Compose
implementation resolves them (`docker-compose config`), started as local processes in the file's
dependency order, each waited on with its own healthcheck.

What differs from the containers, and only that (`LocalMapping`): host names become 127.0.0.1
(`mlflow:5000` -> `127.0.0.1:<free port>`), each published port a free one, `0.0.0.0` 127.0.0.1,
each volume's container path a temporary folder, `db` this machine's PostgreSQL with a fresh
database for each one the file names (user `postgres`, trust auth), and the image's executables
(`optlab`, `mlflow`, `python`) the running interpreter's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import create_engine, make_url, text

from jobs.processes import start_in_own_group, terminate_group
from tests.conftest import ROOT, free_port
from tests.postgres import POSTGRES_ADMIN_URL

COMPOSE_FILE = ROOT / "docker-compose.yml"
DB_INIT = ROOT / "deploy" / "db-init"
# The secrets a user writes into .env (README "Running on a GPU host").
TOKEN = "compose-test-token-0123456789"
SECRETS = {"POSTGRES_PASSWORD": "compose-test-password", "OPTLAB_API_TOKENS": f"alice:{TOKEN}"}
# The image's executables -> this machine's (`optlab` is the script of `service.cli:main`).
EXECUTABLES = {
    "optlab": [sys.executable, "-m", "service.cli"],
    "mlflow": [sys.executable, "-m", "mlflow"],
    "python": [sys.executable],
}
ADMIN = make_url(POSTGRES_ADMIN_URL).set(port=make_url(POSTGRES_ADMIN_URL).port or 5432)
POSTGRES_URL = re.compile(r"postgresql\+psycopg://[^@/]*@db:5432/(\w+)")


def write_env_file(project: Path, secrets: dict[str, str] = SECRETS) -> Path:
    """`.env` as the README says to make it: .env.example with the secrets filled in."""
    lines = []
    for line in (ROOT / ".env.example").read_text().splitlines():
        name = line.split("=", 1)[0]
        lines.append(f"{name}={secrets[name]}" if name in secrets and not line.startswith("#") else line)
    env_file = project / ".env"
    env_file.write_text("\n".join(lines) + "\n")
    return env_file


def compose_config(project: Path) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` of the repository's file, with `project` (holding .env) as the
    project directory: the file resolved, variables interpolated, env_file merged."""
    return subprocess.run(
        ["docker-compose", "--project-directory", str(project), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def resolved_config(project: Path) -> dict[str, Any]:
    completed = compose_config(project)
    assert completed.returncode == 0, completed.stderr
    config: dict[str, Any] = yaml.safe_load(completed.stdout)
    return config


def start_order(services: dict[str, Any]) -> list[str]:
    """Services in dependency order (depends_on), ties by name, as Compose starts them."""
    order: list[str] = []
    while len(order) < len(services):
        ready = sorted(
            name
            for name, service in services.items()
            if name not in order and all(dep in order for dep in service.get("depends_on", {}))
        )
        assert ready, f"a dependency cycle among {set(services) - set(order)}"
        order.append(ready[0])
    return order


@dataclass
class LocalMapping:
    """How a container's names, ports and paths are found on this machine."""

    ports: dict[str, dict[int, int]]  # service -> container port -> local port
    paths: dict[str, Path]  # container path -> local folder
    databases: dict[str, str]  # database named in the file -> fresh local database

    def value(self, value: str, service: str) -> str:
        def local_database(match: re.Match[str]) -> str:
            return (
                f"postgresql+psycopg://{ADMIN.username}@{ADMIN.host}:{ADMIN.port}/{self.databases[match[1]]}"
            )

        value = POSTGRES_URL.sub(local_database, value)
        for other, ports in self.ports.items():
            for container, local in ports.items():
                value = value.replace(f"{other}:{container}", f"127.0.0.1:{local}")
        for container, local in self.ports.get(service, {}).items():
            value = value.replace(f"127.0.0.1:{container}", f"127.0.0.1:{local}")
            if value == str(container):
                value = str(local)
        if value == "0.0.0.0":
            value = "127.0.0.1"
        for container_path, folder in self.paths.items():
            if value == container_path or value.startswith(container_path + "/"):
                value = str(folder) + value[len(container_path) :]
        return value

    def command(self, command: list[str], service: str) -> list[str]:
        head, *rest = command
        return EXECUTABLES.get(head, [head]) + [self.value(part, service) for part in rest]

    def environment(self, environment: dict[str, Any], service: str) -> dict[str, str]:
        return {name: self.value(str(value), service) for name, value in environment.items()}


@dataclass
class Started:
    name: str
    process: subprocess.Popen[bytes] | None  # None: `db`, this machine's PostgreSQL
    log: Path
    healthy_after_s: float | None = None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class LocalStack:
    """The compose services as local processes; `api_url` and `mlflow_url` as the host sees them."""

    config: dict[str, Any]
    mapping: LocalMapping
    folder: Path
    started: dict[str, Started] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.mapping.ports['api'][8000]}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mapping.ports['mlflow'][5000]}"

    def start(self, timeout_s: float = 240) -> None:
        began = time.monotonic()
        services = self.config["services"]
        for name in start_order(services):
            for dependency, condition in services[name].get("depends_on", {}).items():
                if condition.get("condition") == "service_healthy":
                    self.wait_healthy(dependency, began + timeout_s)
            self.started[name] = self._start(name, services[name])
            self.order.append(name)
        for name in self.order:
            self.wait_healthy(name, began + timeout_s)

    def _start(self, name: str, service: dict[str, Any]) -> Started:
        log = self.folder / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if name == "db":  # this machine's PostgreSQL stands in for the container
            return Started(name, None, log)
        # What a container's process would have of its own: a PATH and a home, no OPTLAB_* of ours.
        base = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
        own = self.mapping.environment(service.get("environment") or {}, name)
        env = {**base, "PYTHONPATH": str(ROOT), **own}
        with open(log, "wb") as out:
            process = start_in_own_group(
                self.mapping.command(service["command"], name),
                die_with_parent=True,
                cwd=self.folder,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return Started(name, process, log)

    def wait_healthy(self, name: str, deadline: float) -> None:
        started = self.started[name]
        if started.healthy_after_s is not None:
            return
        check = self.config["services"][name].get("healthcheck", {}).get("test")
        begin = time.monotonic()
        if check is None or check[0] == "NONE":  # no healthcheck: started is all Compose waits for
            started.healthy_after_s = 0.0
            return
        while not self._healthcheck_passes(name, check):
            if started.process is not None and started.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {started.process.returncode}:\n{started.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never passed its healthcheck {check}:\n{started.log_tail()}")
            time.sleep(0.5)
        started.healthy_after_s = round(time.monotonic() - begin, 1)

    def _healthcheck_passes(self, name: str, check: list[str]) -> bool:
        kind, *command = check
        if kind == "CMD-SHELL":
            command = ["sh", "-c", self.mapping.value(command[0], name)]
        else:
            command = self.mapping.command(command, name)
        env = {**os.environ, "PGHOST": str(ADMIN.host), "PGPORT": str(ADMIN.port)}  # `db`: this machine's
        try:
            return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        # As `docker compose down`: in reverse order, each given its stop_grace_period.
        for name in reversed(self.order):
            process = self.started[name].process
            if process is not None and process.poll() is None:
                terminate_group(process, grace_s=30)


@dataclass
class Databases:
    names: dict[str, str]

    @classmethod
    def create(cls, config: dict[str, Any]) -> Databases:
        """A fresh database for POSTGRES_DB and each one deploy/db-init creates."""
        wanted = [config["services"]["db"]["environment"]["POSTGRES_DB"]]
        for sql in sorted(DB_INIT.glob("*.sql")):
            wanted += re.findall(r"CREATE DATABASE (\w+)", sql.read_text(), flags=re.IGNORECASE)
        suffix = uuid.uuid4().hex[:8]
        names = {name: f"compose_{name}_{suffix}" for name in wanted}
        admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            for local in names.values():
                connection.execute(text(f'CREATE DATABASE "{local}"'))
        admin.dispose()
        return cls(names)

    def drop(self) -> None:
        admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as connection:
            for local in self.names.values():
                connection.execute(text(f'DROP DATABASE IF EXISTS "{local}" WITH (FORCE)'))
        admin.dispose()


def local_stack(folder: Path) -> Iterator[LocalStack]:
    """Start the stack the compose file describes; yield it; stop it and drop its databases."""
    project = folder / "project"
    project.mkdir()
    write_env_file(project)
    config = resolved_config(project)
    databases = Databases.create(config)
    paths: dict[str, Path] = {}
    for name, service in config["services"].items():
        for volume in service.get("volumes", []):
            target = volume.split(":")[1]
            paths[target] = folder / "volumes" / f"{name}{target.replace('/', '_')}"
            paths[target].mkdir(parents=True, exist_ok=True)
    ports = {
        name: {int(port["target"]): free_port() for port in service.get("ports", [])}
        for name, service in config["services"].items()
    }
    stack = LocalStack(config, LocalMapping(ports, paths, databases.names), folder)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        databases.drop()
