"""`optlab serve`: run MLflow, the API and one worker together, and stop them together.

Each part is a child process in its own process group, so Ctrl-C stops them in order
(worker, API, MLflow) and nothing is orphaned; each also gets SIGTERM if this
supervisor dies without cleaning up. A part that exits once all are up (killed for memory, a
crash) is started again, up to RESTARTS_ALLOWED times in RESTART_WINDOW_S: the jobs its worker ran
are requeued once their leases expire and resume from their last verified checkpoints, and jobs
wait for an MLflow server that is away (docker-compose restarts its services the same way).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from jobs.processes import how_it_ended, start_in_own_group, terminate_group
from service.job_log import tail
from service.secrets import without_optlab_secrets, without_tokens
from service.settings import Settings


class ServeError(RuntimeError):
    """A part could not start, or keeps exiting: `optlab serve` stops everything and says why."""


# More exits than this within the window is a crash loop (a bad setting, a full disk, a port taken
# meanwhile) that starting again cannot mend.
RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 600.0


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str]
    env: dict[str, str]
    restarted_at: list[float] = field(default_factory=list)  # time.monotonic() of each restart

    def log_tail(self, chars: int = 3000) -> str:
        return tail(self.log_path, chars)

    def exit_said(self, code: int) -> str:
        return f"{self.name} {how_it_ended(code)}"


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.data_dir.resolve()
        self.logs = self.data_dir / "logs"
        self.children: list[Child] = []
        self.api_url = f"http://{settings.api_host}:{settings.api_port}"
        self.mlflow_url = settings.mlflow_tracking_uri

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        try:  # the data folder must take the logs, databases and jobs: a clear line, not a traceback
            self.logs.mkdir(parents=True, exist_ok=True)
            probe = self.data_dir / ".optlab-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ServeError(
                f"cannot write to the data folder {self.data_dir} ({exc.strerror or exc}): give a "
                "writable --data-dir (or OPTLAB_DATA_DIR)"
            ) from None
        s = self.settings
        if s.api_port == s.mlflow_port:  # each check below finds it free: the second part died of it
            raise ServeError(
                f"--port and --mlflow-port are both {s.api_port}: the API and MLflow need a port each"
            )
        for host, port, what in (
            (s.mlflow_host, s.mlflow_port, "--mlflow-port"),
            (s.api_host, s.api_port, "--port"),
        ):
            ensure_port_free(host, port, what)
        try:
            self._spawn("mlflow", self._mlflow_command(), {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
            self._spawn("api", [sys.executable, "-m", "service.cli", "api"], self._env())
            self._spawn("worker", [sys.executable, "-m", "service.cli", "worker"], self._env())
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until MLflow answers, the API answers and a worker published the catalogue."""
        deadline = time.monotonic() + timeout_s
        waiting_for = ["mlflow", "api", "catalogue"]
        with httpx.Client(timeout=2.0) as client:
            while waiting_for:
                self.check_children()
                if time.monotonic() > deadline:
                    raise ServeError(
                        f"timed out after {timeout_s:.0f}s waiting for {waiting_for[0]}; logs in {self.logs}"
                    )
                if _answers(client, f"{self.mlflow_url}/health") and "mlflow" in waiting_for:
                    waiting_for.remove("mlflow")
                health = _json(client, f"{self.api_url}/healthz")
                if health is not None and "api" in waiting_for:
                    waiting_for.remove("api")
                if health and health.get("catalogue_published_at") and "catalogue" in waiting_for:
                    waiting_for.remove("catalogue")
                time.sleep(0.3)

    def check_children(self) -> None:
        """ServeError if any part has exited (while starting: nothing is started again then)."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise ServeError(
                    f"{child.exit_said(code)}; last lines of {child.log_path}:\n{child.log_tail()}"
                )

    def restart_exited(self) -> list[str]:
        """Start again each part that has exited, saying so (a line each); ServeError for one that
        exited more than RESTARTS_ALLOWED times within RESTART_WINDOW_S."""
        said = []
        for index, child in enumerate(self.children):
            code = child.process.poll()
            if code is None:
                continue
            now = time.monotonic()
            recent = [at for at in child.restarted_at if now - at < RESTART_WINDOW_S]
            window = f"{RESTART_WINDOW_S / 60:g} minutes"
            if len(recent) >= RESTARTS_ALLOWED:
                raise ServeError(
                    f"{child.exit_said(code)}, after {len(recent)} restarts within {window}: stopping "
                    f"everything. Last lines of {child.log_path}:\n{child.log_tail()}"
                )
            terminate_group(child.process, grace_s=0)  # what it left in its group (MLflow's workers)
            self.children[index] = self._start(child.name, child.command, child.env, [*recent, now])
            said.append(
                f"{child.exit_said(code)}; started it again (restart {len(recent) + 1} of at most "
                f"{RESTARTS_ALLOWED} within {window}). Last lines of {child.log_path}:\n"
                f"{child.log_tail(1500)}"
            )
        return said

    def stop(self) -> None:
        for child in reversed(self.children):  # worker first, MLflow last
            if child.process.poll() is None:
                terminate_group(child.process, grace_s=15.0)
        self.children.clear()

    def _spawn(self, name: str, command: list[str], extra_env: dict[str, str]) -> None:
        self.children.append(self._start(name, command, extra_env, []))

    def _start(
        self, name: str, command: list[str], extra_env: dict[str, str], restarted_at: list[float]
    ) -> Child:
        log_path = self.logs / f"{name}.log"
        # Readable by this user only: a part's log may hold what a user sent by mistake.
        descriptor = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(descriptor, 0o600)  # a log an earlier version left readable to all, too
        with os.fdopen(descriptor, "ab") as log_file:
            if restarted_at:  # where the last lines of this start begin, in the log the part keeps
                log_file.write(f"--- optlab serve: {name} started again ({len(restarted_at)}) ---\n".encode())
            process: subprocess.Popen[bytes] = start_in_own_group(
                command,
                die_with_parent=True,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**inherited_environment(name, os.environ), **extra_env},
            )
        return Child(name, process, log_path, command, extra_env, restarted_at)

    def _mlflow_command(self) -> list[str]:
        return [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.data_dir / 'mlflow.db'}",
            "--artifacts-destination", str(self.data_dir / "mlartifacts"),
            "--serve-artifacts",
            "--host", self.settings.mlflow_host,
            "--port", str(self.settings.mlflow_port),
            "--workers", "1",
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        s = self.settings
        return {
            "OPTLAB_DATA_DIR": str(self.data_dir),
            "OPTLAB_DATABASE_URL": s.resolved_database_url,
            "OPTLAB_MLFLOW_TRACKING_URI": s.mlflow_tracking_uri,
            "OPTLAB_API_HOST": s.api_host,
            "OPTLAB_API_PORT": str(s.api_port),
        }


def inherited_environment(part: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What a part gets of serve's environment: only the API the tokens (the worker's jobs run
    anyone's code), and MLflow, which is not made private, no optlab setting or credential at all."""
    if part == "api":
        return dict(environ)
    if part == "mlflow":
        return without_optlab_secrets(environ)
    return without_tokens(environ)


def ensure_port_free(host: str, port: int, option: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServeError(
                f"{host}:{port} is already in use ({exc.strerror}); another optlab or MLflow may be "
                f"running there: stop it, or choose another port with {option}"
            ) from None


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _json(client: httpx.Client, url: str) -> dict[str, object] | None:
    try:
        response = client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    data = response.json()
    return data if isinstance(data, dict) else None
