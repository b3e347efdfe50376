"""The worker daemon: publish the catalogue, then claim jobs and run each in a fresh process.

A job runs as `python -m jobs.run` in its own process group, so a crash, leak or hang
in user code never takes the worker down, and cancellation ends the whole group. With the warm
pool (OPTLAB_WARM_POOL, service/warm_pool.py) that process was started before the claim, its
framework already imported, and runs the job the same way; everything below holds for it too.
The worker relays progress from the job's `progress.json` to the store and reads
`result.json` when the process exits. It runs up to `slots` jobs at once (one GPU each on a
GPU host), each supervised by a thread of its own.

Durability (issue 12): every store write is fenced by the job's attempt (service.store); a
store outage does not stop supervision (progress and the result are kept and written when the
store answers again); limits (time, memory) end a job `failed`; an MLflow run the job process
could not end (killed, died) is ended by the worker.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from jobs.checkpoint_files import (
    CHECKPOINT_DIR_ENV,
    KEEP_CHECKPOINTS_ENV,
    attempt_leftovers,
    earlier_attempts,
    remove_checkpoint,
)
from jobs.processes import (
    how_it_ended,
    is_stopped,
    session_processes,
    session_stopped,
    signal_group,
    start_in_own_group,
    terminate_group,
    thread_environment,
    write_alive,
)
from jobs.result import (
    FROZEN_FILE,
    LOG_FILE,
    RANK_KILLED,
    RESULT_FILE,
    TRACKING_UNREACHABLE,
    WORKER_ALIVE_FILE,
    WORKER_SILENCE_ENV,
    ErrorRecord,
    JobResult,
    JobStatus,
    MlflowInfo,
    Progress,
    read_progress,
    read_result,
)
from jobs.spec import default_style
from service import job_log, store
from service.capabilities import (
    JobNeeds,
    OfferedOptimizers,
    catalogue_frameworks,
    catalogue_sha256,
    gpu_index_refusal,
    needs_of,
    offered_optimizers,
    visible_gpus,
)
from service.mlflow_import import mlflow_client
from service.models import Job
from service.plugins import (
    PLUGIN_SOURCE,
    PluginWatcher,
    fingerprint,
    plugin_dirs_from_environment,
    plugin_files_by_name,
)
from service.secrets import job_environment, split_credentials
from service.settings import Settings
from service.stall import StallWatch
from service.store import ClaimFilter, Lease
from service.studies import store as study_store
from service.studies.finalize import finalize_next_study
from service.studies.runs import child_arguments
from service.warm_pool import WarmPool, hand_over, style_of_stored_spec

log = logging.getLogger("optlab.worker")

LOG_TAIL_CHARS = 4000
ALL_FRAMEWORKS = ("torch", "tensorflow")  # before the catalogue is known: claim any
# Progress (a new step or loss) is written at most this often; a new MLflow run or checkpoint at
# once; with nothing new only the lease renewal every heartbeat_s (was: a row every 0.5 s per job).
PROGRESS_WRITE_S = 2.0
# The waiting reason of a job whose process someone stopped (SIGSTOP); cancel still ends it.
STOPPED_FROM_OUTSIDE = (
    "its process is stopped (SIGSTOP, or a debugger) and makes no progress until it is continued (SIGCONT)"
)
# A job process writes its stacks within this long of being asked (faulthandler, from C).
STACKS_WRITTEN_S = 2.0
# The job is paused this long before its lease could expire (see Supervision._keep_lease_safe).
PAUSE_MARGIN_S = 2.0
# Store outage: retry after 0.5 s, doubling up to this.
MAX_STORE_BACKOFF_S = 5.0
# A result kept through an outage is retried this long after the worker was asked to stop.
RESULT_RETRY_WHEN_STOPPING_S = 30.0
STORE_ERRORS = (OperationalError, DBAPIError)
# After a failed re-publish of the catalogue (the job environment broke), wait this long.
REPUBLISH_RETRY_S = 30.0
# How long a stopping worker lets a summary being made finish before it gives the study back.
FINISH_SUMMARY_S = 5.0
# The outcome tag of an attempt's MLflow run that the job's next attempt started afresh beside: its
# process, stopped by a worker shutting down or a SIGTERM from outside, had tagged it `cancelled`.
INTERRUPTED = "interrupted"


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
            f"`{settings.job_python} -m jobs.catalogue` {how_it_ended(completed.returncode)}:\n"
            f"{completed.stderr[-LOG_TAIL_CHARS:]}"
        )
    try:
        data: dict[str, Any] = json.loads(completed.stdout)
    except ValueError as exc:
        raise CatalogueError(
            f"`jobs.catalogue` printed no valid JSON ({exc}); stderr: {completed.stderr[-2000:]}"
        ) from None
    return data


class Stop(StrEnum):
    """Why the worker stopped a job process (none: it ended by itself)."""

    CANCELLED = "cancelled"
    WORKER_STOPPING = "worker stopping"
    LEASE_LOST = "lease lost"
    TIME_LIMIT = "time limit"
    MEMORY_LIMIT = "memory limit"


@dataclass(frozen=True)
class Slot:
    index: int
    gpu: str | None  # the GPU id this slot hands its job (CUDA_VISIBLE_DEVICES), None: CPU only


def slots_for(needs: JobNeeds, free: list[Slot]) -> list[Slot]:
    """The slots a job the store let this worker claim takes of `free`: all of one kind, as
    `JobNeeds.takes` says (CPU-only slots first, except for a GPU job); a `cpu` job may mix them."""
    cpu = [slot for slot in free if slot.gpu is None]
    gpu = [slot for slot in free if slot.gpu is not None]
    kind = needs.takes(len(cpu), len(gpu))
    if kind == "cpu":
        return cpu[: needs.slots]
    if kind == "gpu":
        return gpu[: needs.slots]
    return (cpu + gpu)[: needs.slots]  # "mixed": a `cpu` job, which uses no GPU


class Worker:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        worker_id: str | None = None,
        slots: int | None = None,
        gpus: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stopping = threading.Event()
        self.plugins = PluginWatcher(plugin_dirs_from_environment())
        self.plugin_files: dict[str, list[str]] = {}  # from the catalogue: what each job reads first
        self.gpus = visible_gpus() if gpus is None else gpus
        count = slots or max(1, len(self.gpus))
        self.slots = [Slot(i, self.gpus[i] if i < len(self.gpus) else None) for i in range(count)]
        self.free = set(range(count))
        # Busy slots whose job has taken its first step: their next warm process may start now (it
        # would slow the job's own start-up on a host with few cores).
        self.past_first_step: set[int] = set()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.finalizing: set[int] = set()  # studies whose summary its finalizer is making
        self.frameworks: tuple[str, ...] = ALL_FRAMEWORKS
        self.optimizers: OfferedOptimizers | None = None  # before the catalogue is known: claim any
        self.seen_at = 0.0
        self.job_threads = settings.job_threads or default_job_threads(count)
        self.pool = WarmPool(settings.job_python) if settings.warm_pool else None
        self.pool_failing = False  # the last fill failed (logged once, not on every poll)
        self.disk_full = False  # the jobs' folder had no space at the last look (logged once)
        # Why it claims nothing now (its disk is full), told to the store with each heartbeat, so a
        # queued job's waiting_reason says so.
        self.not_claiming: str | None = None

    def publish_catalogue(self) -> dict[str, Any]:
        # Taken before producing: a file changed meanwhile is published again on the next poll.
        fingerprinted = fingerprint(self.plugins.folders)
        catalogue = produce_catalogue(self.settings)
        self.frameworks = tuple(catalogue_frameworks(catalogue))
        # Its own names, current with its plugins: it claims only jobs of optimizers it can build.
        self.optimizers = offered_optimizers(catalogue)
        self.plugin_files = plugin_files_by_name(catalogue)  # before jobs can be submitted against it
        with self.sessions() as session:
            store.publish_catalogue(session=session, worker_id=self.worker_id, catalogue=catalogue)
            store.register_worker(
                session=session,
                worker_id=self.worker_id,
                frameworks=list(self.frameworks),
                devices=["cpu", "cuda"] if self.gpus else ["cpu"],
                gpus=sum(1 for slot in self.slots if slot.gpu is not None),
                slots=len(self.slots),
                catalogue_sha256=catalogue_sha256(catalogue),
            )
        self.seen_at = time.monotonic()
        self.plugins.published = fingerprinted
        for failure in catalogue.get("errors", []):
            log.warning("optimizer plugin failed to load: %s: %s", failure["source"], failure["error"])
        return catalogue

    def job_environment(self, slots: list[Slot]) -> tuple[dict[str, str], str]:
        """The environment of a job on `slots` (before its style's own switch) and its tracking URI."""
        env, tracking_uri = job_environment(os.environ, self.settings.mlflow_tracking_uri)
        env.update(thread_environment(self.job_threads))
        if self.settings.keep_checkpoints is not None:
            env[KEEP_CHECKPOINTS_ENV] = str(self.settings.keep_checkpoints)
        # A job freezes itself when this worker is silent for as long as its own lease rule allows
        # (jobs.processes.watch_the_worker); not where the worker looks in on it less often than that.
        silence = self.settings.lease_s - PAUSE_MARGIN_S
        if self.settings.poll_interval_s < silence / 2:
            env[WORKER_SILENCE_ENV] = f"{silence:g}"
        gpus = [slot.gpu for slot in slots if slot.gpu is not None]
        if gpus or self.gpus:  # a CPU slot on a GPU host sees no GPU
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return env, tracking_uri

    def fill_pool(self) -> None:
        """A warm process for every slot that has none; torch first where the worker runs torch."""
        if self.pool is None:
            return
        first = "torch" if "torch" in self.frameworks else default_style(self.frameworks[0])
        with self.lock:
            ready = sorted(self.free | self.past_first_step)
        try:
            self.pool.fill(
                ready, lambda index: self.job_environment([self.slots[index]])[0], first_style=first
            )
        except Exception:  # no warm process (fork failed, say): jobs start cold, claims go on
            if not self.pool_failing:
                log.exception(
                    "worker %s: could not start a warm job process; jobs start cold", self.worker_id
                )
            self.pool_failing = True
        else:
            self.pool_failing = False

    def run_forever(self) -> None:
        log.info(
            "worker %s polling for jobs with %d slot(s), %d CPU thread(s) per job, warm pool %s",
            self.worker_id,
            len(self.slots),
            self.job_threads,
            "on" if self.pool else "off",
        )
        refresher = threading.Thread(target=self.refresh_catalogue_forever, name="plugin-watch", daemon=True)
        refresher.start()
        closer = threading.Thread(target=self.close_runs_forever, name="run-closer", daemon=True)
        closer.start()
        finalizer = threading.Thread(
            target=self.finalize_studies_forever, name="study-finalizer", daemon=True
        )
        finalizer.start()
        unreachable = False
        while not self.stopping.is_set():
            try:
                self._stay_registered()
                self.fill_pool()  # here only: this thread outlives the processes it starts
                started = self.start_next()
                unreachable = False
            except STORE_ERRORS as exc:  # an outage: running jobs are supervised on; claim later
                if not unreachable:
                    log.warning("worker %s: the job store is unreachable (%s); retrying", self.worker_id, exc)
                unreachable, started = True, False
            except Exception:  # anything else must not end the worker either: log, wait, retry
                log.exception("worker %s: error while claiming a job", self.worker_id)
                started = False
            if not started:
                self.stopping.wait(MAX_STORE_BACKOFF_S if unreachable else self.settings.poll_interval_s)
        if self.pool is not None:
            self.pool.close()
        for thread in self.threads:  # each hands its job back (or records how it ended)
            thread.join()
        finalizer.join(FINISH_SUMMARY_S)  # a summary nearly made is finished
        self._give_back_studies()
        self._sign_off()

    def _give_back_studies(self) -> None:
        """The studies whose summaries this worker leaves unfinished (its finalizer, a daemon thread,
        waits on MLflow, say), for the next worker to make at once: it had waited for the claim to
        expire, the study reading "summarizing" with no reason meanwhile."""
        unfinished = set(self.finalizing)
        if not unfinished:
            return
        try:
            with self.sessions() as session:
                study_store.release_finalize_claims(session=session, study_ids=unfinished)
            self.finalizing.difference_update(unfinished)  # its finalizer renews them no more
            log.info(
                "worker %s: left the summaries of studies %s to the next worker",
                self.worker_id,
                sorted(unfinished),
            )
        except STORE_ERRORS:  # the store away: the claims expire (FINALIZE_LEASE_S)
            log.warning(
                "worker %s: could not give back its claims on studies %s", self.worker_id, sorted(unfinished)
            )

    def _sign_off(self) -> None:
        """No longer live, at once: a job it handed back had read as waiting its turn for a lease
        (no waiting reason), and the API had validated against its catalogue meanwhile."""
        try:
            with self.sessions() as session:
                store.worker_stopped(session=session, worker_id=self.worker_id)
        except STORE_ERRORS:  # the store away: it is no longer live once its lease has passed
            log.warning(
                "worker %s: could not sign off in the job store; it reads as live for a lease", self.worker_id
            )

    def _stay_registered(self) -> None:
        """Live workers are the ones seen within a lease: say so every heartbeat."""
        if time.monotonic() - self.seen_at < self.settings.heartbeat_s:
            return
        with self.sessions() as session:
            store.touch_worker(session=session, worker_id=self.worker_id, not_claiming=self.not_claiming)
        self.seen_at = time.monotonic()

    def close_runs_forever(self) -> None:
        """`close_runs_left_open` every heartbeat, on a thread of its own: MLflow's client retries a
        server that does not answer for minutes, which must delay no claim."""
        self._keep_doing(
            self.close_runs_left_open, "look for MLflow runs left open", self.settings.heartbeat_s
        )

    def finalize_studies_forever(self) -> None:
        """Summarize the studies whose jobs have all ended, one after another, on a thread of its own:
        a summary reads every job's run from MLflow, whose client waits out a server that takes
        connections and never answers (stopped, overloaded) for many minutes; in the polling loop it
        had held up every claim and heartbeat, so the worker read as gone."""

        def finalize() -> bool:
            return finalize_next_study(
                sessions=self.sessions,
                tracking_uri=self.settings.mlflow_tracking_uri,
                within_s=self.settings.lease_s,
                holding=self.finalizing,
            )

        self._keep_doing(finalize, "summarize ended studies", self.settings.poll_interval_s)

    def _keep_doing(self, work: Callable[[], bool | None], what: str, every_s: float) -> None:
        """`work` until the worker stops, again at once after a round that did something (True), else
        after `every_s`. An error is said once with its traceback (a store outage in a line), again
        only when it changes, and its end is said too."""
        failing: str | None = None
        while not self.stopping.is_set():
            try:
                busy = work()
            except Exception as exc:  # the store away, say: the next round tries again
                said = f"{type(exc).__name__}: {exc}".splitlines()[0]
                if failing is None and isinstance(exc, STORE_ERRORS):  # an outage: its line is enough
                    log.warning("worker %s: cannot %s: %s", self.worker_id, what, said)
                elif failing is None:
                    log.exception("worker %s: could not %s", self.worker_id, what)
                elif said != failing:
                    log.warning("worker %s: still cannot %s: %s", self.worker_id, what, said)
                failing, busy = said, False
            else:
                if failing is not None:
                    log.info("worker %s: can %s again", self.worker_id, what)
                    failing = None
            if not busy:
                self.stopping.wait(every_s)

    def close_runs_left_open(self) -> None:
        """End KILLED the MLflow runs that cancelled jobs may have left open: one cancelled while
        queued to run again (an earlier attempt left its run open for the next), or whose worker died
        as it was cancelled. A run already ended is left as it is."""
        with self.sessions() as session:
            left = store.runs_left_open(session=session)
        for job_id, run_id in left:
            if not end_mlflow_run(self.settings.mlflow_tracking_uri, job_id, run_id, "KILLED", force=False):
                return  # the server does not answer: the rest at a later heartbeat
            with self.sessions() as session:
                store.run_closed(session=session, job_id=job_id)

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

    def claim(self) -> tuple[Job, list[Slot], float] | None:
        """Claim the oldest job that fits the free slots, and take the slots it needs; also when
        the claim was sent (its lease runs from then: see Supervision._keep_lease_safe)."""
        with self.lock:
            self.threads = [t for t in self.threads if t.is_alive()]
            free = [self.slots[i] for i in sorted(self.free)]
            if not free or self._disk_is_full():
                return None
            fits = ClaimFilter(
                frameworks=self.frameworks,
                free_slots=len(free),
                free_gpu_slots=sum(1 for slot in free if slot.gpu is not None),
                optimizers=self.optimizers,
                slots=len(self.slots),
                gpu_slots=sum(1 for slot in self.slots if slot.gpu is not None),
            )
            sent = time.monotonic()
            with self.sessions() as session:
                job = store.claim_next(
                    session=session, worker_id=self.worker_id, lease_s=self.settings.lease_s, fits=fits
                )
            if job is None:
                return None
            taken = slots_for(needs_of(job.spec), free)
            self.free -= {slot.index for slot in taken}
            self.past_first_step -= {slot.index for slot in taken}
            return job, taken, sent

    def _disk_is_full(self) -> bool:
        """Whether the file system of the jobs' folder (or of OPTLAB_CHECKPOINT_DIR) is full: a job
        claimed now could write nothing, and every queued job had failed within a second, one after
        another ("No space left on device"), where another worker could have run them. Said once
        when it fills and once when it has space again."""
        shared = os.environ.get(CHECKPOINT_DIR_ENV)
        folders = [self.settings.jobs_dir, *([Path(shared)] if shared else [])]
        lowest = min((free_bytes(folder), str(folder)) for folder in folders)
        full = lowest[0] < FULL_DISK_BYTES
        if full and not self.disk_full:
            log.error(
                "worker %s: the file system of %s has %d bytes free: it claims no job until space is "
                "freed (queued jobs wait for this or another worker)",
                self.worker_id,
                lowest[1],
                lowest[0],
            )
        elif self.disk_full and not full:
            log.info("worker %s: %s has space again: it claims jobs again", self.worker_id, lowest[1])
        if full != self.disk_full:
            self.seen_at = -float("inf")  # said with the next heartbeat, now, not a heartbeat later
        self.disk_full = full
        self.not_claiming = (
            f"the file system of {lowest[1]} is full ({lowest[0]} bytes free)" if full else None
        )
        return full

    def start_next(self) -> bool:
        """Claim a job and supervise it in a thread of its own; False when none was claimed."""
        claimed = self.claim()
        if claimed is None:
            return False
        thread = threading.Thread(target=self._run_claimed, args=claimed, name=f"job-{claimed[0].id}")
        with self.lock:
            self.threads.append(thread)
        thread.start()
        return True

    def run_next(self) -> bool:
        """Claim and run one job in this thread; False when there was none to claim."""
        claimed = self.claim()
        if claimed is None:
            return False
        self._run_claimed(*claimed)
        return True

    def _run_claimed(self, job: Job, slots: list[Slot], claimed_at: float) -> None:
        log.info("job %s: attempt %s started on slot(s) %s", job.id, job.attempt, [s.index for s in slots])
        supervision = Supervision(self, job, slots, claimed_at)
        try:
            outcome = supervision.run()
        except Exception as exc:
            # Spawning or watching failed (disk full, a malformed progress.json...): never leave it running.
            log.exception("job %s: the worker failed to run it", job.id)
            if no_space_left(exc) and supervision.hand_back(f"its worker's disk is full ({exc})"):
                outcome = "requeued: its worker's disk is full"  # another worker, or this one with space
            else:
                error = ErrorRecord(type="WorkerError", message=f"{type(exc).__name__}: {exc}")
                supervision.record(JobStatus.FAILED, None, error)
                outcome = JobStatus.FAILED
        finally:
            with self.lock:
                self.free |= {slot.index for slot in slots}
        log.info("job %s: %s", job.id, outcome)


class Supervision:
    """One job process from start to recorded outcome, through store outages and limits."""

    def __init__(self, worker: Worker, job: Job, slots: list[Slot], claimed_at: float) -> None:
        self.worker, self.job, self.slots = worker, job, slots
        self.settings = worker.settings
        self.workdir = (self.settings.jobs_dir / str(job.id) / f"attempt-{job.attempt}").resolve()
        self.claimed_at = claimed_at  # the time limit counts from here (a warm process began earlier)
        self.renewed_at = claimed_at  # when the last successful lease renewal (or the claim) was sent
        self.written: Progress | None = None  # the progress the store has
        self.written_at = 0.0
        self.store_retry_at = 0.0
        self.store_backoff_s = 0.0
        self.paused = False
        self.last_progress: Progress | None = None
        self.rss_mb = 0.0
        timeout = job.spec.get("timeout_s")
        limit = self.settings.max_job_seconds
        self.time_limit_s = min(float(timeout), limit) if isinstance(timeout, int | float) else limit
        self.stall = StallWatch(self.settings.stall_notice_s, claimed_at)
        self.stall_failed = False  # the stall watch raised once (logged once)
        self.own_progress: Progress | None = None  # the progress the job wrote, as it wrote it
        self.thaw_told = False  # the job froze itself and was continued: said once per freeze

    # -- the store, through outages -------------------------------------------------------------

    def _store(self, call: Callable[[Session], Any]) -> Any:
        """`call(session)`, or None while the store is unreachable (retried with backoff)."""
        if time.monotonic() < self.store_retry_at:
            return None
        try:
            with self.worker.sessions() as session:
                answer = call(session)
        except STORE_ERRORS as exc:
            if self.store_backoff_s == 0:
                log.warning("job %s: the job store is unreachable (%s); supervising on", self.job.id, exc)
            self.store_backoff_s = min(max(0.5, 2 * self.store_backoff_s), MAX_STORE_BACKOFF_S)
            self.store_retry_at = time.monotonic() + self.store_backoff_s
            return None
        if self.store_backoff_s:
            log.info("job %s: the job store answers again", self.job.id)
        self.store_backoff_s = 0.0
        return answer

    def _heartbeat(self, progress: Progress | None) -> Lease | None:
        """Write progress and renew the lease when needed, else only read the lease (no write)."""
        now = time.monotonic()
        changed = progress is not None and progress != self.written
        urgent = progress is not None and (
            (progress.mlflow and (self.written is None or progress.mlflow != self.written.mlflow))
            or progress.checkpoint != (self.written.checkpoint if self.written else None)
        )
        # The first write (at once: the job's workdir for GET /jobs), then one per heartbeat.
        renewal_due = now - self.renewed_at >= self.settings.heartbeat_s or self.written_at == 0
        if not (renewal_due or urgent or (changed and now - self.written_at >= PROGRESS_WRITE_S)):
            return self._store(
                lambda s: store.lease_of(
                    session=s, job_id=self.job.id, worker_id=self.worker.worker_id, attempt=self.job.attempt
                )
            )
        sent = time.monotonic()
        lease: Lease | None = self._store(
            lambda s: store.record_progress(
                session=s,
                job_id=self.job.id,
                worker_id=self.worker.worker_id,
                attempt=self.job.attempt,
                progress=progress if changed else None,
                workdir=str(self.workdir),
                lease_s=self.settings.lease_s,
                resumed_from=self.resumed_from(),
            )
        )
        if lease is not None and lease is not Lease.LOST:
            self.renewed_at, self.written_at = sent, sent
            self.written = progress if changed else self.written
        return lease

    def _keep_lease_safe(self, process: subprocess.Popen[bytes]) -> None:
        """Never two live attempts: pause the job before its lease could expire unrenewed.

        The timing argument: a renewal sent at monotonic time t sets the lease to expire at
        (the store write's wall clock, no earlier than t) + lease_s; another worker claims the
        job only once its wall clock passes that expiry. So at t + lease_s - PAUSE_MARGIN_S,
        still unrenewed, this worker SIGSTOPs the job's process group (immediate; no handler
        runs): the job is frozen before anyone may take over, given clocks (NTP) within the
        margin. When the store answers again the fenced write decides: still ours -> SIGCONT
        and go on (a store-wide outage ends with the job finished once, in one MLflow run);
        another attempt exists -> SIGKILL the frozen group and discard whatever it did.
        Freezing rather than killing keeps the work done and the process, which an outage of
        the whole store (no one can take over) would otherwise cost.
        """
        overdue = time.monotonic() - self.renewed_at > self.settings.lease_s - PAUSE_MARGIN_S
        if overdue and not self.paused:
            signal_group(process, signal.SIGSTOP)
            self.paused = True
            log.warning(
                "job %s: lease not renewed for %.0f s (store unreachable); job paused until the store "
                "says whether it is still ours",
                self.job.id,
                time.monotonic() - self.renewed_at,
            )

    def hand_back(self, reason: str) -> bool:
        """The job back to the queue with `reason`, where the store answers and it is still ours."""
        return bool(
            self._store(
                lambda s: store.requeue_job(
                    session=s,
                    job_id=self.job.id,
                    worker_id=self.worker.worker_id,
                    attempt=self.job.attempt,
                    reason=reason,
                )
            )
        )

    def _show_alive(self) -> None:
        """A sign of life for the job's watch of this worker (jobs.processes.watch_the_worker): this
        host's monotonic clock, which no clock step or file server's clock moves."""
        try:
            write_alive(self.workdir / WORKER_ALIVE_FILE)
        except OSError:  # a full disk: the job freezes itself, as it would for a silent worker
            pass

    def _stop_gracefully(self, process: subprocess.Popen[bytes], grace_s: float) -> None:
        """`terminate_group`, its grace unbroken: the job's watch of this worker stands down first (it
        would freeze the job while the worker waits, and lose the end the grace is for)."""
        (self.workdir / WORKER_ALIVE_FILE).unlink(missing_ok=True)
        terminate_group(process, grace_s)

    def _thaw(self, process: subprocess.Popen[bytes]) -> None:
        """A job that froze itself while this worker was silent, its lease still ours: continued, at
        every look until its watch, running again, takes its file away (a SIGCONT sent between its
        writing the file and stopping would otherwise be lost, and the job stay stopped)."""
        frozen = self.workdir / FROZEN_FILE
        if not frozen.exists():
            self.thaw_told = False
            return
        signal_group(process, signal.SIGCONT)
        self.stall.restart(time.monotonic())
        if not self.thaw_told:
            self.thaw_told = True
            log.warning(
                "job %s: its process froze itself after this worker was silent for %s s (stopped, its "
                "host paused, or held up by the job store); the lease is still ours: continued",
                self.job.id,
                frozen.read_text().strip() or "?",
            )

    def _resume_paused(self, process: subprocess.Popen[bytes]) -> None:
        if self.paused:
            signal_group(process, signal.SIGCONT)
            self.paused = False
            self.stall.restart(time.monotonic())  # the pause was the store's, not a stall of the job's
            log.info("job %s: lease renewed; job resumed", self.job.id)

    def record(self, status: JobStatus, result: JobResult | None, error: ErrorRecord | None) -> bool:
        """The outcome, written once the store answers (kept through an outage); False when the
        lease was lost meanwhile (the outcome is then discarded, with a log note)."""
        give_up_at: float | None = None
        latest = self._latest_progress()
        while True:
            recorded = self._store(
                lambda s: store.finish_job(
                    session=s,
                    job_id=self.job.id,
                    worker_id=self.worker.worker_id,
                    attempt=self.job.attempt,
                    status=status,
                    result=result,
                    error=error,
                    step=latest.step if latest else None,
                )
            )
            if recorded is not None:
                break
            if self.worker.stopping.is_set():
                give_up_at = give_up_at or time.monotonic() + RESULT_RETRY_WHEN_STOPPING_S
                if time.monotonic() > give_up_at:
                    log.error(
                        "job %s: the store stayed unreachable; its %s outcome is lost", self.job.id, status
                    )
                    return False
            time.sleep(
                min(self.settings.poll_interval_s, max(0.0, self.store_retry_at - time.monotonic())) + 0.05
            )
        if not recorded:
            log.warning(
                "job %s: attempt %s is no longer this worker's (%s); its %s outcome was discarded",
                self.job.id,
                self.job.attempt,
                self._why_lost(),
                status,
            )
        return bool(recorded)

    def _why_lost(self) -> str:
        """Why the store no longer takes this attempt's outcome, as the job's row says now: its lease
        expired while this worker was silent, and the job was cancelled meanwhile or taken over."""
        try:
            with self.worker.sessions() as session:
                job = store.get_job(session=session, job_id=self.job.id)
        except STORE_ERRORS:
            return "its lease was lost"
        if job is None:
            return "the job is gone from the store"
        if job.status is JobStatus.CANCELLED:
            return "its lease expired while this worker did not answer, and the job was cancelled meanwhile"
        if job.attempt > self.job.attempt:
            return f"its lease expired while this worker did not answer, and attempt {job.attempt} took over"
        return "its lease was lost"

    # -- the job process ------------------------------------------------------------------------

    def command(self, spec_path: Path, tracking_uri: str) -> list[str]:
        """`python -m jobs.run` and its arguments."""
        return [self.settings.job_python, "-m", "jobs.run", *self.arguments(spec_path, tracking_uri)]

    def plugin_file_arguments(self) -> list[str]:
        """Where the job's optimizer and its base are, if plugins define them: the file the job was
        validated against (its spec records it), else where this worker's catalogue found the name.
        The job reads those files and not every plugin file (optimizers.registry.load_registry), and
        fails at its start if the name now runs another class (jobs.optimizer_source)."""
        optimizer = self.job.spec.get("optimizer") or {}
        files = [
            file for choice in (optimizer, optimizer.get("base")) if choice for file in self._files_of(choice)
        ]
        return [argument for file in dict.fromkeys(files) for argument in ("--plugin-file", file)]

    def _files_of(self, choice: dict[str, Any]) -> list[str]:
        recorded = str((choice.get("source") or {}).get("source") or "")
        found_here = self.worker.plugin_files.get(str(choice.get("name")), [])
        # A host that keeps its plugin folder elsewhere reads its own copy; the job then holds it to
        # the recorded class and file text.
        if recorded.startswith(PLUGIN_SOURCE) and Path(recorded.removeprefix(PLUGIN_SOURCE)).is_file():
            return [recorded.removeprefix(PLUGIN_SOURCE)]
        return found_here

    def arguments(self, spec_path: Path, tracking_uri: str) -> list[str]:
        """The arguments of `python -m jobs.run` for this job."""
        job = self.job
        study = child_arguments(
            sessions=self.worker.sessions, tracking_uri=self.settings.mlflow_tracking_uri, job=job
        )
        command = [
            str(spec_path),
            "--workdir", str(self.workdir),
            "--tracking-uri", tracking_uri,
            "--job-id", str(job.id),
            "--attempt", str(job.attempt),
            *(["--submitted-by", job.submitted_by] if job.submitted_by else []),
            *study,  # a study's job: its run's name, tags and parent run
            *self.plugin_file_arguments(),
        ]  # fmt: skip
        run_id = self.resumed_run_id()
        if run_id is not None:
            # DURABLE_INTERFACE.md: resume from the last verified checkpoint, in the same MLflow run.
            command += ["--resume", str(job.checkpoint_ref), "--resume-run-id", run_id]
        return command

    def _local_checkpoint_ref(self) -> Path | None:
        """The checkpoint this attempt resumes from, where it lies in a folder (no tracking server)."""
        ref = self.job.checkpoint_ref
        return Path(ref) if ref and not str(ref).startswith("runs:/") else None

    def resumed_run_id(self) -> str | None:
        """The MLflow run a later attempt resumes in (from the job's last verified checkpoint); None
        for a first attempt, a check job, or one with no checkpoint to resume from."""
        job = self.job
        run_id = (job.mlflow or {}).get("run_id")
        if job.attempt > 1 and job.kind == "train" and job.checkpoint_ref and run_id:
            return str(run_id)
        return None

    def resumed_from(self) -> int | None:
        """The checkpoint's step a resumed attempt starts at (its process reports step 0 until it has
        loaded it); None where the attempt resumes nothing."""
        return self.job.checkpoint_step if self.resumed_run_id() else None

    def environment(self) -> tuple[dict[str, str], str]:
        return self.worker.job_environment(self.slots)

    def run(self) -> str:
        """Run the job's process to its recorded end; whatever goes wrong, it does not outlive this."""
        refusal = gpu_index_refusal(self.job.spec.get("device"))
        if refusal is not None:
            # Stored before the API refused such a device: its process would fail on the GPU it
            # cannot see. Failed at once, saying what to write, with no process started.
            message = f"{refusal} (queued before the API refused such a device: submit it again)"
            self.record(JobStatus.FAILED, None, ErrorRecord(type="DeviceRefused", message=message))
            self._end_mlflow_run("FAILED", force=False)  # one an earlier attempt left open, if any
            return JobStatus.FAILED
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._remove_earlier_attempts_leftovers(keep=self._local_checkpoint_ref())
        spec_path = self.workdir / "spec.json"
        spec_path.write_text(json.dumps(self.job.spec, indent=2))
        env, tracking_uri = self.environment()
        if self.job.attempt > 1 and self.job.mlflow and self.resumed_run_id() is None:
            # The attempt before died with no checkpoint to resume from: this one starts afresh in a
            # run of its own, and that one must not stay RUNNING (or be taken for a job's second run).
            # On a thread: MLflow's client retries for minutes when the server is down, and the lease
            # this attempt holds is renewed only once its process is watched.
            # Its run id now: this attempt's own is in its progress soon.
            predecessor = str((self.job.mlflow or {}).get("run_id"))
            # Tagged `interrupted`: its process, stopped, had tagged it `cancelled`, and the job goes on.
            threading.Thread(
                target=self._end_run,
                args=(predecessor, "KILLED"),
                kwargs={"force": False, "outcome": INTERRUPTED},
                daemon=True,
            ).start()
        arguments = self.arguments(spec_path, tracking_uri)
        self._show_alive()  # before the job starts: its watch begins only where the file is there
        process = self._start_warm(arguments, env) or self._start_cold(arguments, env)
        # Just after the job: a worker killed in between leaves the job only its SIGTERM, which a
        # real job gets before it could have loaded a plugin that ignores it.
        reaper = start_reaper(process.pid, self.settings.cancel_grace_s)
        try:
            stop = self._watch(process)
        finally:  # e.g. a progress.json that does not match jobs.result.Progress: loud, and no orphan
            if process.poll() is None:
                signal_group(process, signal.SIGCONT)
                self._stop_gracefully(process, 0 if self.paused else self.settings.cancel_grace_s)
            terminate_group(reaper, 0)
            for bookkeeping in (WORKER_ALIVE_FILE, FROZEN_FILE):  # the job's folder holds the job's files
                (self.workdir / bookkeeping).unlink(missing_ok=True)
        outcome = self._conclude(process, stop)
        self._remove_checkpoint_leftovers()
        if outcome == JobStatus.SUCCEEDED:  # no attempt resumes from an earlier one's checkpoint now
            self._remove_earlier_attempts_leftovers(keep=None)
        if outcome != "lease lost":  # else the run is the new attempt's, and so is what it holds
            self._copy_log_to_run()
        return outcome

    def _remove_earlier_attempts_leftovers(self, *, keep: Path | None) -> None:
        """What earlier attempts of the job on this host left of checkpoints, but `keep`: an attempt
        whose worker was killed with it (kill -9, the host's out-of-memory killer) had no supervisor
        left to remove them, and a write cut short (a whole model) stayed for good. Disk it could
        not free is logged, never the job's outcome."""
        try:
            for folder in earlier_attempts(self.workdir.parent, self.job.attempt):
                for leftover in attempt_leftovers(folder, keep=keep):
                    remove_checkpoint(leftover)
        except Exception as exc:
            log.warning("job %s: could not remove what its earlier attempts left: %s", self.job.id, exc)

    def _remove_checkpoint_leftovers(self) -> None:
        """Its processes are gone: what they left of checkpoints that nothing will read
        (jobs.checkpoint_files), a whole model each, goes. A job that ends in order leaves none; one
        killed (out of memory, kill -9, its lease lost) left a write cut short, the local copy of the
        last checkpoint its MLflow run holds, the one it had downloaded to resume from, a DDP job's
        other ranks' own. A checkpoint its progress names in its folder (no tracking server) is what
        a retry resumes from: it stays. Disk it could not free is logged, never the job's outcome
        (recorded before)."""
        try:
            progress = self._latest_progress()
            reported = progress.checkpoint if progress else None
            keep = Path(reported.path) if reported and not reported.path.startswith("runs:/") else None
            for leftover in attempt_leftovers(self.workdir, keep=keep):
                remove_checkpoint(leftover)
        except Exception as exc:
            log.warning(
                "job %s: could not remove what its attempt left in %s: %s", self.job.id, self.workdir, exc
            )

    def _start_warm(self, arguments: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The slot's warm process, handed this job; None when there is none fit for it (a job on
        several slots always starts cold: its CUDA_VISIBLE_DEVICES is no single slot's)."""
        pool = self.worker.pool
        if pool is None or len(self.slots) != 1:
            return None
        process = pool.take(self.slots[0].index, style_of_stored_spec(self.job.spec), env)
        if process is None or not hand_over(process, arguments, self.workdir / LOG_FILE):
            return None
        log.info("job %s: runs in a warm process (pid %s)", self.job.id, process.pid)
        return process

    def _start_cold(self, arguments: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / LOG_FILE, "ab") as log_file:
            process: subprocess.Popen[bytes] = start_in_own_group(
                [self.settings.job_python, "-m", "jobs.run", *arguments],
                die_with_parent=True,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        return process

    def _stopped(self, process: subprocess.Popen[bytes]) -> bool:
        """Whether the job's process, or one of a DDP job's ranks, is stopped (SIGSTOP, a debugger): the
        ranks' states are read only for a job that has them (reading every process's costs a scan of
        /proc, at every look)."""
        if (self.job.spec.get("distribution") or {}).get("devices", 1) > 1:
            return session_stopped(process.pid)
        return is_stopped(process.pid)

    def _cap_logs(self) -> None:
        """Keep the job's logs under OPTLAB_JOB_LOG_MB: its process's, and a DDP job's other ranks'
        (`rank-N/log.txt`), which print as much as rank 0 (a plugin printing every step)."""
        limit = int(self.settings.job_log_mb * job_log.MB)
        for path, _ in attempt_logs(self.workdir, self.job.attempt):
            job_log.cap(path, limit)

    def _watch(self, process: subprocess.Popen[bytes]) -> Stop | None:
        """Relay progress until the process exits; return why we stopped it, if we did."""
        started = self.claimed_at  # the time limit counts from the claim, for a warm process too
        while process.poll() is None:
            self._show_alive()
            self._cap_logs()
            progress = read_progress(self.workdir)
            self.last_progress = progress or self.last_progress
            self.own_progress = progress or self.own_progress
            if (self.workdir / FROZEN_FILE).exists():
                self.stall.restart(time.monotonic())  # frozen while this worker was silent: no stall
            elif self.last_progress is not None and not self.paused and self._stopped(process):
                # Stopped by someone else (this worker pauses it only while the store is away): it
                # read as running well, the same step for as long as it stayed stopped. Any of its
                # processes: a DDP job's rank stopped holds up every rank (its stacks cannot come).
                self.last_progress = self.last_progress.model_copy(update={"waiting": STOPPED_FROM_OUTSIDE})
                self.stall.restart(time.monotonic())  # a stop from outside is no stall of its own
            elif not self.paused and (progress is None or progress.waiting is None):
                self._tell_a_stall(process)  # what the job waits on, where it says, is told instead
            if progress is not None and progress.step >= 1:
                with self.worker.lock:
                    self.worker.past_first_step |= {slot.index for slot in self.slots}
            lease = self._heartbeat(self.last_progress)
            if lease is Lease.LOST:
                terminate_group(process, 0)  # at once: the job is another attempt's now
                return Stop.LEASE_LOST
            if lease is not None:
                self._resume_paused(process)
                self._thaw(process)
            else:
                self._keep_lease_safe(process)
            if self.paused:  # until the store decides, nothing else may run it or end it gracefully
                if self.worker.stopping.is_set():
                    terminate_group(process, 0)
                    return Stop.WORKER_STOPPING
                time.sleep(self.settings.poll_interval_s)
                continue
            stop = self._stop_reason(lease, started, process)
            if stop is not None:
                # Memory: at once (waiting could exhaust the host); otherwise the job's grace.
                self._stop_gracefully(
                    process, 0 if stop is Stop.MEMORY_LIMIT else self.settings.cancel_grace_s
                )
                return stop
            time.sleep(self.settings.poll_interval_s)
        return None

    def _tell_a_stall(self, process: subprocess.Popen[bytes]) -> None:
        """A job whose progress has not moved for long says so, and its stacks go to its log
        (service/stall.py); the notice goes once the progress moves again. A notice only: whatever
        goes wrong in it (a full disk refusing the log's line) is logged, and the job goes on."""
        now = time.monotonic()
        self.stall.see(self.own_progress, now)  # what the job wrote, never the notice shown with it
        try:
            notice = self.stall.notice(now, process.pid, self.workdir / LOG_FILE)
        except Exception:
            if not self.stall_failed:
                log.exception("job %s: could not tell whether it stalls; it runs on", self.job.id)
            self.stall_failed = True
            return
        if notice is None:
            return
        if self.stall.asked:
            log.warning("job %s: %s", self.job.id, notice)
            if self.stall.stacks_line:
                self._copy_log_to_run(after_s=STACKS_WRITTEN_S)  # with the stacks
        shown = self.last_progress or Progress(step=self.job.step, total=self.job.total_steps)
        self.last_progress = shown.model_copy(update={"waiting": notice})

    def _stop_reason(
        self, lease: Lease | None, started: float, process: subprocess.Popen[bytes]
    ) -> Stop | None:
        if lease is Lease.CANCEL:
            return Stop.CANCELLED
        if self.worker.stopping.is_set():
            return Stop.WORKER_STOPPING
        if time.monotonic() - started > self.time_limit_s:
            return Stop.TIME_LIMIT
        limit_mb = self.settings.job_memory_mb
        if limit_mb is not None:
            self.rss_mb = group_rss_mb(process.pid)
            if self.rss_mb > limit_mb:
                return Stop.MEMORY_LIMIT
        return None

    def _conclude(self, process: subprocess.Popen[bytes], stop: Stop | None) -> str:
        result, error = read_outcome(process, self.workdir)
        if stop is Stop.LEASE_LOST:
            log.warning(
                "job %s: attempt %s lost its lease (another attempt holds the job); its process was "
                "killed and its result discarded",
                self.job.id,
                self.job.attempt,
            )
            return "lease lost"  # the MLflow run is the new attempt's now: leave it alone
        if stop is Stop.WORKER_STOPPING and (result is None or result.status is JobStatus.CANCELLED):
            # The checkpoint the job published while it stopped: what the next attempt resumes from.
            self._heartbeat(read_progress(self.workdir) or self.last_progress)
            requeued = self._store(
                lambda s: store.requeue_job(
                    session=s,
                    job_id=self.job.id,
                    worker_id=self.worker.worker_id,
                    attempt=self.job.attempt,
                    reason="its worker stopped while it ran",
                )
            )
            return "requeued" if requeued else "left to its lease (not requeued)"
        status: JobStatus
        if stop in (Stop.TIME_LIMIT, Stop.MEMORY_LIMIT):
            status, error = JobStatus.FAILED, self._limit_error(stop)
            self._end_mlflow_run("FAILED", force=True)
        elif stop is Stop.CANCELLED:
            if result and result.status not in (JobStatus.CANCELLED, JobStatus.FAILED):
                status, error = result.status, result.error  # it ended first
            else:
                status = JobStatus.CANCELLED
                # The worker knows it was a cancel (the job only that its worker stopped it), and a
                # stop asked for needs no traceback; a job that failed as it stopped keeps its error.
                if result is not None and result.status is JobStatus.FAILED and result.error:
                    error = result.error
                else:
                    error = self._cancelled_error()
                self._end_mlflow_run("KILLED", force=False)  # SIGKILLed after the grace: still RUNNING
        elif self._stopped_from_outside(process, result):
            if self.job.retries < self.settings.job_retries:
                return self._retry(process, result)
            said = error or (result.error if result else None)  # a DDP job's: its rank killed
            status, error = JobStatus.FAILED, self._retries_spent(process, said)
            # Even where an earlier attempt's stop left it KILLED and this one died before resuming it.
            self._end_mlflow_run("FAILED", force=True)
        elif result is None:
            status = JobStatus.FAILED
            self._end_mlflow_run("FAILED", force=False)  # died (a crash) before ending its run
        else:
            status, error = result.status, result.error
        self.record(status, result, error)
        return status

    @staticmethod
    def _stopped_from_outside(process: subprocess.Popen[bytes], result: JobResult | None) -> bool:
        """Stopped by a signal no one here sent (the worker's own stops are `Stop`s, handled before):
        killed (SIGKILL: the kernel's out-of-memory killer; SIGTERM before the job could handle it),
        or a SIGTERM the job handled, stopping as if cancelled (an operator, a container runtime's
        eviction), a DDP rank killed so (RANK_KILLED: the job's other ranks then fail), or an MLflow
        server that did not answer as the job started (TRACKING_UNREACHABLE). A crash
        (SIGSEGV, an exit code) is not."""
        if result is not None:
            return result.status is JobStatus.CANCELLED or _stopped_by_a_cause_outside(result) is not None
        return process.returncode in (-signal.SIGKILL, -signal.SIGTERM)

    def _retry(self, process: subprocess.Popen[bytes], result: JobResult | None) -> str:
        """Queue the job again (retries + 1), to resume from the last checkpoint it published; one
        cancelled meanwhile ends there, and so does its MLflow run, which no attempt resumes now."""
        self._heartbeat(read_progress(self.workdir) or self.last_progress)  # that checkpoint, relayed
        number, allowed = self.job.retries + 1, self.settings.job_retries
        what = _stopped_by_a_cause_outside(result) or f"its process {_stopped_by(process.returncode)}"
        reason = f"{what} before it ended; retry {number} of {allowed} (OPTLAB_JOB_RETRIES)"
        log.warning("job %s: %s", self.job.id, reason)
        requeued = self._store(
            lambda s: store.requeue_job(
                session=s,
                job_id=self.job.id,
                worker_id=self.worker.worker_id,
                attempt=self.job.attempt,
                reason=reason,
                retry=True,
            )
        )
        if not requeued:
            return "left to its lease (not requeued)"
        ended = self._store(lambda s: store.get_job(session=s, job_id=self.job.id))
        if ended is not None and ended.status is JobStatus.CANCELLED:
            self._end_mlflow_run("KILLED", force=True)
            return JobStatus.CANCELLED
        return "requeued"

    def _retries_spent(self, process: subprocess.Popen[bytes], error: ErrorRecord | None) -> ErrorRecord:
        """The error of a job stopped from outside with no retry left."""
        own = error is not None and error.type != "Cancelled"  # a killed job's, with its log's tail
        what = error.message if own and error else f"the job process {_stopped_by(process.returncode)}"
        retries = self.job.retries
        if retries == 0:
            tried = " (OPTLAB_JOB_RETRIES is 0: it was not started again)"
        else:
            times = "once" if retries == 1 else f"{retries} times"
            unanswered = error is not None and error.type == TRACKING_UNREACHABLE
            advice = (
                "the MLflow server must answer before a job can start its run"
                if unanswered
                else "if it runs out of memory, give it a smaller batch or model, or a host with more"
            )
            tried = (
                f"; it had been started again {times} after the same, as many times as OPTLAB_JOB_RETRIES "
                f"allows: {advice}"
            )
        return ErrorRecord(
            type="JobProcessDied", message=what + tried, traceback=error.traceback if error else None
        )

    def _latest_progress(self) -> Progress | None:
        """The job's last progress, read once more from its folder: the last heartbeat may have
        written an older one (progress is written at most every PROGRESS_WRITE_S). A file that does
        not match `Progress` is what the job's error says already: the last good one stands."""
        try:
            self.last_progress = read_progress(self.workdir) or self.last_progress
        except ValidationError:
            pass
        return self.last_progress

    def _cancelled_error(self) -> ErrorRecord:
        progress = self._latest_progress()
        # As the store records the step (`record_progress`): a resumed attempt is at its checkpoint's
        # step before its process says so, and "at step 0" had contradicted its progress and history.
        step = max(progress.step, self.resumed_from() or 0) if progress else None
        where = f" at step {step} of {progress.total}" if progress else ""
        return ErrorRecord(type="Cancelled", message=f"cancelled while running{where}")

    def _limit_error(self, stop: Stop) -> ErrorRecord:
        if stop is Stop.TIME_LIMIT:
            message = (
                f"the job ran over its time limit of {self.time_limit_s:g} s (spec timeout_s, at most "
                f"OPTLAB_MAX_JOB_SECONDS {self.settings.max_job_seconds:g}); its processes were stopped"
            )
            return ErrorRecord(
                type="TimeLimitExceeded", message=message, traceback=_tail(self.workdir / LOG_FILE)
            )
        message = (
            f"the job's processes used {self.rss_mb:.0f} MiB of memory, over the limit of "
            f"{self.settings.job_memory_mb} MiB (OPTLAB_JOB_MEMORY_MB); they were killed"
        )
        return ErrorRecord(
            type="MemoryLimitExceeded", message=message, traceback=_tail(self.workdir / LOG_FILE)
        )

    def _end_mlflow_run(self, status: str, *, force: bool) -> None:
        """End the job's MLflow run as `status` if the job process could not (`force`: even if it did)."""
        run_id = self._run_id()
        if run_id:
            self._end_run(run_id, status, force=force)

    def _run_id(self) -> str | None:
        """The MLflow run this attempt logs to, once its process said (else an earlier attempt's)."""
        info = (self.last_progress.mlflow if self.last_progress else None) or self.job.mlflow
        run_id = info.run_id if isinstance(info, MlflowInfo) else (info or {}).get("run_id")
        return str(run_id) if run_id else None

    def _copy_log_to_run(self, after_s: float = 0.0) -> None:
        """Copy the attempt's log to its MLflow run (`logs/attempt-N.txt`) on a thread of its own, so
        a user without the worker's disk reads what the job printed, and a stalled job's stacks:
        MLflow's client retries for minutes when the server is down, and nothing waits on this."""
        run_id = self._run_id()
        if run_id is None:
            return
        workdir, attempt, ask = self.workdir, self.job.attempt, self.stall.asks

        def copy() -> None:
            time.sleep(after_s)
            logs = attempt_logs(workdir, attempt)
            if all(
                copy_log(self.settings.mlflow_tracking_uri, self.job.id, run_id, path, name)
                for path, name in logs
            ):
                ranks = " with its other ranks' logs beside it" if len(logs) > 1 else ""
                self.stall.copied(ask, f"logs/{logs[0][1]} in its MLflow run{ranks}")

        threading.Thread(target=copy, name=f"optlab-log-copy-{self.job.id}", daemon=True).start()

    def _end_run(self, run_id: str, status: str, *, force: bool, outcome: str | None = None) -> None:
        end_mlflow_run(
            self.settings.mlflow_tracking_uri, self.job.id, run_id, status, force=force, outcome=outcome
        )


def attempt_logs(workdir: Path, attempt: int) -> list[tuple[Path, str]]:
    """The logs of an attempt and their names in its run: its process's (`attempt-N.txt`), then a
    data-parallel job's other ranks' (`attempt-N-rank-R.txt`, from `rank-R/`), where they printed
    what rank 0 did not (their own faults, their stacks when stalled)."""
    ranks = sorted(
        (int(folder.name.removeprefix("rank-")), folder / LOG_FILE)
        for folder in workdir.glob("rank-*")
        if folder.name.removeprefix("rank-").isdigit() and (folder / LOG_FILE).is_file()
    )
    return [
        (workdir / LOG_FILE, f"attempt-{attempt}.txt"),
        *((path, f"attempt-{attempt}-rank-{rank}.txt") for rank, path in ranks),
    ]


def copy_log(tracking_uri: str, job_id: int, run_id: str, log_path: Path, name: str) -> bool:
    """Copy `log_path` (its excerpt: service.job_log) to the run's artifacts as `logs/<name>`; False
    where it could not (the server down: the job's outcome stands all the same)."""
    client = None
    try:
        client = mlflow_client(split_credentials(tracking_uri)[0])
        with tempfile.TemporaryDirectory(prefix="optlab-log-") as folder:
            copy = Path(folder) / name
            copy.write_bytes(job_log.excerpt(log_path))
            client.log_artifact(run_id, str(copy), "logs")
    except Exception:
        if client is not None and _run_deleted(client, run_id):  # in MLflow's UI, say: no fault of ours
            log.info("job %s: MLflow run %s was deleted: its log %s not copied there", job_id, run_id, name)
        else:
            log.exception("job %s: could not copy its log to MLflow run %s", job_id, run_id)
        return False
    return True


def _run_deleted(client: Any, run_id: str) -> bool:
    """Whether the run is deleted (or gone from the server); False where that cannot be told."""
    try:
        return bool(client.get_run(run_id).info.lifecycle_stage == "deleted")
    except Exception as exc:
        return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def end_mlflow_run(
    tracking_uri: str, job_id: int, run_id: str, status: str, *, force: bool, outcome: str | None = None
) -> bool:
    """End a job's MLflow run as `status` if it is still RUNNING (`force`: whatever it is); False
    where the server could not be asked (down: the job's outcome is recorded all the same). An
    `outcome` given is its tag whether or not the run had ended."""
    try:
        from jobs.tracking import OUTCOME_TAG, end_run

        client = mlflow_client(split_credentials(tracking_uri)[0])
        run = client.get_run(run_id)
        if run.info.lifecycle_stage == "deleted":  # MLflow refuses to end it; the UI lists it nowhere
            log.info("job %s: MLflow run %s was deleted: not ended %s", job_id, run_id, status)
        elif force or run.info.status == "RUNNING":
            # The worker ends a run FAILED for a failure of its own finding (a limit, a crash, retries
            # spent), never for a divergence, which the job reports itself.
            failed = JobStatus.FAILED.value if status == "FAILED" else None
            end_run(client, run_id, status, outcome=outcome or failed)
            log.info("job %s: MLflow run %s ended %s by the worker", job_id, run_id, status)
        elif outcome is not None:
            client.set_tag(run_id, OUTCOME_TAG, outcome)
    except Exception:
        log.exception("job %s: could not end MLflow run %s as %s", job_id, run_id, status)
        return False
    return True


# Outlives a worker killed with -9 by the grace: the job got SIGTERM then (die_with_parent), and
# flushes its points and ends its run; one that ignores SIGTERM is SIGKILLed here after the grace,
# well within the lease, so it cannot train on beside the attempt that takes the job over.
REAPER = """
trap 'sleep "$2"; kill -KILL -"$1" 2>/dev/null; kill $! 2>/dev/null; exit 0' TERM
while :; do sleep 3600 & wait $!; done
"""


def default_job_threads(slots: int) -> int:
    """The cores this worker may use, shared by its slots: at least one thread per job.

    Torch's default (a thread per core in every job) makes jobs that share the cores fight over
    them: benchmarks/README.md, tracking_overhead, measured a loop ~8x slower when another
    process held one of two cores.
    """
    return max(1, len(os.sched_getaffinity(0)) // slots)


def start_reaper(job_group: int, grace_s: float) -> subprocess.Popen[bytes]:
    """A tiny process that SIGKILLs the job's group `grace_s` after this worker dies (SIGTERM on
    the worker's death, like the job); stopped with the job when the worker lives on."""
    return start_in_own_group(
        ["/bin/sh", "-c", REAPER, "optlab-reaper", str(job_group), f"{grace_s:g}"],
        die_with_parent=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def read_outcome(
    process: subprocess.Popen[bytes], workdir: Path
) -> tuple[JobResult | None, ErrorRecord | None]:
    """The job's result, or None and why there is none (it died first, or wrote a malformed one)."""
    try:
        result = read_result(workdir)
    except ValidationError as exc:
        message = f"the job process wrote a {RESULT_FILE} that does not match jobs.result.JobResult: {exc}"
        return None, ErrorRecord(type="InvalidResult", message=message, traceback=_tail(workdir / LOG_FILE))
    if result is not None:
        return result, None
    message = f"the job process {how_it_ended(process.returncode)} before writing a result"
    return None, ErrorRecord(
        type="JobProcessDied", message=message + _full_disk(workdir), traceback=_tail(workdir / LOG_FILE)
    )


# Under this much free space the job's folder is taken to be why a job died without a word: it can
# write neither its result nor its log (an empty log is then all there is).
FULL_DISK_BYTES = 1024 * 1024


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system of `folder` (or of its nearest existing parent); a large number
    where that cannot be read."""
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 2**63


def no_space_left(error: BaseException) -> bool:
    """Whether `error`, or what caused it, is a full disk (ENOSPC) or quota (EDQUOT)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _full_disk(workdir: Path) -> str:
    """Why a job left no result and no log, when its folder's file system is (nearly) full."""
    free = free_bytes(workdir)
    if free >= FULL_DISK_BYTES:
        return ""
    return (
        f"; the file system of its folder {workdir} has {free} bytes free: a full disk keeps a job from "
        "writing its checkpoints, its log and its result"
    )


def group_rss_mb(session_id: int) -> float:
    """Resident memory of every process in the job's session (the job, its data loaders, DDP ranks).

    Why not RLIMIT_AS: CUDA and TensorFlow reserve virtual address ranges far beyond the memory
    they use (CUDA's unified addressing maps tens of GiB at init), so an address-space limit set
    to a memory figure kills GPU jobs at start; and it is per process, not per job. Resident
    memory read from /proc each poll is what the host actually gives; the cost is that a job
    can overshoot by what it allocates within one poll interval.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    total = sum(int(fields[21]) for _, fields in session_processes(session_id)) * page  # field 24
    return total / 2**20


def _stopped_by_a_cause_outside(result: JobResult | None) -> str | None:
    """Why a job stopped for a cause outside it that a new attempt may not meet, else None: another
    DDP rank killed from outside (out of memory), or an MLflow server that gave no answer while the
    job's run was started (the job ran nothing)."""
    if (
        result is not None
        and result.error is not None
        and result.error.type in (RANK_KILLED, TRACKING_UNREACHABLE)
    ):
        return result.error.message
    return None


def _stopped_by(code: int | None) -> str:
    """How a job process stopped by someone else ended: killed by a signal, or stopped by SIGTERM
    (which the job handles: it exits in order)."""
    if code is not None and code < 0:
        return f"{how_it_ended(code)} (out of memory, or from outside)"
    return "was stopped by a SIGTERM it was sent from outside (an operator, a container runtime)"


def _tail(path: Path) -> str:
    return job_log.tail(path, LOG_TAIL_CHARS)


def install_stop_handlers(stop: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())
