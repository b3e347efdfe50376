"""The worker daemon: publish the catalogue, then claim jobs and run each in a fresh process.

A job runs as `python -m jobs.run` in its own process group, so a crash, leak or hang
in user code never takes the worker down, and cancellation ends the whole group.
The worker relays progress from the job's `progress.json` to the store and reads
`result.json` when the process exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from jobs.processes import start_in_own_group, terminate_group
from jobs.result import (
    LOG_FILE,
    RESULT_FILE,
    ErrorRecord,
    JobResult,
    JobStatus,
    Progress,
    read_progress,
    read_result,
)
from service import store
from service.models import Job
from service.plugins import PluginWatcher, fingerprint, plugin_dirs_from_environment
from service.secrets import job_environment
from service.settings import Settings
from service.studies.finalize import finalize_next_study
from service.studies.runs import child_arguments

log = logging.getLogger("optlab.worker")

LOG_TAIL_CHARS = 4000
LEASE_S = 60.0
# After a failed re-publish of the catalogue (the job environment broke), wait this long.
REPUBLISH_RETRY_S = 30.0


class CatalogueError(RuntimeError):
    """The job environment could not produce the optimizer catalogue."""


def produce_catalogue(settings: Settings) -> dict[str, Any]:
    """Run `python -m jobs.catalogue` in the job environment (frameworks stay out of this process)."""
    try:
        completed = subprocess.run(
            [settings.job_python, "-m", "jobs.catalogue"],
            env=job_environment(os.environ, "")[0],  # plugin code runs there: no secrets for it either
            capture_output=True,
            text=True,
            timeout=settings.catalogue_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise CatalogueError(
            f"`{settings.job_python} -m jobs.catalogue` took over {settings.catalogue_timeout_s:.0f}s "
            "(OPTLAB_CATALOGUE_TIMEOUT_S); a plugin may hang at import"
        ) from None
    if completed.returncode != 0:
        raise CatalogueError(
            f"`{settings.job_python} -m jobs.catalogue` exited with {completed.returncode}:\n"
            f"{completed.stderr[-LOG_TAIL_CHARS:]}"
        )
    try:
        data: dict[str, Any] = json.loads(completed.stdout)
    except ValueError as exc:
        raise CatalogueError(
            f"`jobs.catalogue` printed no valid JSON ({exc}); stderr: {completed.stderr[-2000:]}"
        ) from None
    return data


class Worker:
    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session], *, worker_id: str | None = None
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stopping = threading.Event()
        self.plugins = PluginWatcher(plugin_dirs_from_environment())

    def publish_catalogue(self) -> dict[str, Any]:
        # Taken before producing: a file changed meanwhile is published again on the next poll.
        plugin_files = fingerprint(self.plugins.folders)
        catalogue = produce_catalogue(self.settings)
        with self.sessions() as session:
            store.publish_catalogue(session=session, worker_id=self.worker_id, catalogue=catalogue)
        self.plugins.published = plugin_files
        for failure in catalogue.get("errors", []):
            log.warning("optimizer plugin failed to load: %s: %s", failure["source"], failure["error"])
        return catalogue

    def run_forever(self) -> None:
        log.info("worker %s polling for jobs", self.worker_id)
        refresher = threading.Thread(target=self.refresh_catalogue_forever, name="plugin-watch", daemon=True)
        refresher.start()
        while not self.stopping.is_set():
            try:
                # A study whose jobs have all ended gets its summary before the next job starts.
                finalize_next_study(sessions=self.sessions, tracking_uri=self.settings.mlflow_tracking_uri)
                busy = self.run_next()
            except Exception:  # a database hiccup must not end the worker: log, wait, retry
                log.exception("worker %s: error while claiming or running a job", self.worker_id)
                busy = False
            if not busy:
                self.stopping.wait(self.settings.poll_interval_s)

    def refresh_catalogue_forever(self) -> None:
        """Publish the catalogue again whenever plugin files change, while jobs keep running.

        A thread of its own: producing the catalogue takes seconds (it imports the frameworks in
        a child), which must delay neither claims nor a running job's supervision. A failed
        publish keeps the old catalogue and is tried again after a pause.
        """
        while not self.stopping.wait(self.settings.plugin_poll_s):
            if self.plugins.poll() is None:
                continue
            log.info("worker %s: plugin files changed; publishing the catalogue again", self.worker_id)
            try:
                self.publish_catalogue()
            except Exception:  # a broken environment must not end the worker
                log.exception("worker %s: could not publish the catalogue again", self.worker_id)
                self.stopping.wait(REPUBLISH_RETRY_S)

    def run_next(self) -> bool:
        """Claim and run one job; False when there was none to claim."""
        with self.sessions() as session:
            job = store.claim_next(session=session, worker_id=self.worker_id, lease_s=LEASE_S)
        if job is None:
            return False
        log.info("job %s: attempt %s started", job.id, job.attempt)
        try:
            outcome = self._run_job(job)
        except Exception as exc:
            # Spawning or watching failed (disk full, database gone...): never leave it running.
            log.exception("job %s: the worker failed to run it", job.id)
            with self.sessions() as session:
                store.finish_job(
                    session=session,
                    job_id=job.id,
                    worker_id=self.worker_id,
                    status=JobStatus.FAILED,
                    result=None,
                    error=ErrorRecord(type="WorkerError", message=f"{type(exc).__name__}: {exc}"),
                )
            outcome = JobStatus.FAILED
        log.info("job %s: %s", job.id, outcome)
        return True

    def _run_job(self, job: Job) -> str:
        """Run the job's process to its end; whatever goes wrong here, the process does not outlive it."""
        workdir = (self.settings.jobs_dir / str(job.id) / f"attempt-{job.attempt}").resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(job.spec, indent=2))
        env, tracking_uri = job_environment(os.environ, self.settings.mlflow_tracking_uri)
        command = [
            self.settings.job_python, "-m", "jobs.run", str(spec_path),
            "--workdir", str(workdir),
            "--tracking-uri", tracking_uri,
            "--job-id", str(job.id),
            "--attempt", str(job.attempt),
            *(["--submitted-by", job.submitted_by] if job.submitted_by else []),
            *child_arguments(sessions=self.sessions, tracking_uri=self.settings.mlflow_tracking_uri, job=job),
        ]  # fmt: skip
        with open(workdir / LOG_FILE, "ab") as log_file:
            process: subprocess.Popen[bytes] = start_in_own_group(
                command,
                die_with_parent=True,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        try:
            stop_reason = self._watch(job.id, process, workdir)
        finally:  # e.g. a progress.json that does not match jobs.result.Progress: loud, and no orphan
            if process.poll() is None:
                terminate_group(process, self.settings.cancel_grace_s)
        return self._conclude(job.id, process, workdir, stop_reason)

    def _watch(self, job_id: int, process: subprocess.Popen[bytes], workdir: Path) -> str | None:
        """Relay progress until the process exits; return why we stopped it, if we did."""
        last_progress: Progress | None = None
        while process.poll() is None:
            progress = read_progress(workdir)
            changed = progress is not None and progress != last_progress
            last_progress = progress or last_progress
            with self.sessions() as session:
                cancel = store.record_progress(
                    session=session,
                    job_id=job_id,
                    worker_id=self.worker_id,
                    progress=progress if changed else None,
                    workdir=str(workdir),
                    lease_s=LEASE_S,
                )
            if cancel:
                terminate_group(process, self.settings.cancel_grace_s)
                return "cancelled"
            if self.stopping.is_set():
                terminate_group(process, self.settings.cancel_grace_s)
                return "worker stopping"
            time.sleep(self.settings.poll_interval_s)
        return None

    def _conclude(
        self, job_id: int, process: subprocess.Popen[bytes], workdir: Path, stop_reason: str | None
    ) -> str:
        result, error = self._read_result(process, workdir)
        with self.sessions() as session:
            if stop_reason == "worker stopping" and (result is None or result.status is JobStatus.CANCELLED):
                store.requeue_job(
                    session=session,
                    job_id=job_id,
                    worker_id=self.worker_id,
                    reason="its worker stopped while it ran; it will run again from the start",
                )
                return "requeued"
            if stop_reason == "cancelled":
                status: JobStatus
                if result and result.status not in (JobStatus.CANCELLED, JobStatus.FAILED):
                    status, error = result.status, result.error  # it ended first
                else:
                    status = JobStatus.CANCELLED
                    cancelled = ErrorRecord(type="Cancelled", message="cancelled while running")
                    error = (result.error if result else None) or cancelled
                self._finish(session, job_id, status, result, error)
                return status
            if result is None:
                self._finish(session, job_id, JobStatus.FAILED, None, error)
                return JobStatus.FAILED
            self._finish(session, job_id, result.status, result, result.error)
            return result.status

    def _read_result(
        self, process: subprocess.Popen[bytes], workdir: Path
    ) -> tuple[JobResult | None, ErrorRecord | None]:
        """The job's result, or None and why there is none (it died first, or wrote a malformed one)."""
        try:
            result = read_result(workdir)
        except ValidationError as exc:
            message = (
                f"the job process wrote a {RESULT_FILE} that does not match jobs.result.JobResult: {exc}"
            )
            return None, ErrorRecord(
                type="InvalidResult", message=message, traceback=_tail(workdir / LOG_FILE)
            )
        if result is not None:
            return result, None
        message = f"the job process ended with {_describe_exit(process.returncode)} before writing a result"
        return None, ErrorRecord(type="JobProcessDied", message=message, traceback=_tail(workdir / LOG_FILE))

    def _finish(
        self,
        session: Session,
        job_id: int,
        status: JobStatus,
        result: JobResult | None,
        error: ErrorRecord | None,
    ) -> None:
        recorded = store.finish_job(
            session=session,
            job_id=job_id,
            worker_id=self.worker_id,
            status=status,
            result=result,
            error=error,
        )
        if not recorded:
            log.warning(
                "job %s: no longer this worker's (lease lost); its %s outcome was not recorded",
                job_id,
                status,
            )


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def install_stop_handlers(stop: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())
