"""A study's jobs read back as `StudyRun`s: who they are from the store, what they logged from MLflow.

From the job row also its own step-time medians (its result), its attempt, and the step an earlier
attempt reached."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from service.models import Job, Study
from service.studies.summary import MetricPoint, StudyRun

# Metric histories are fetched one (run, key) at a time: a few at once, not a few hundred in a row.
FETCH_THREADS = 8

Item = TypeVar("Item")
Value = TypeVar("Value")


# Metrics the summary and the report read point by point (curves, medians, time to a target, the first
# evaluation); of any other (train/lr, train/grad_norm, one point per step each, optim/*) only the last
# value is read, which the run itself holds: their whole histories had been most of a long job's fetch.
WHOLE_HISTORY_KEYS = frozenset({"train/loss"})
WHOLE_HISTORY_PREFIXES = ("val/", "traj/", "perf/")


class ReadProgress:
    """How many of a study's runs have been read from MLflow so far, for the note a slow summary
    shows (`service.studies.finalize`)."""

    def __init__(self) -> None:
        self.total = 0
        self.read = 0
        self._lock = threading.Lock()

    def one_more(self) -> None:
        with self._lock:
            self.read += 1


def collect_runs(
    client: Any,
    study: Study,
    jobs: list[Job],
    *,
    also_whole: frozenset[str] = frozenset(),
    progress: ReadProgress | None = None,
) -> list[StudyRun]:
    """One `StudyRun` per member of the study, in member order; a job that never reached MLflow
    (cancelled while queued, failed at start) has an empty history but is still there. `also_whole`:
    metrics read whole besides `WHOLE_HISTORY_KEYS` (the study's target and selection metrics)."""
    by_id = {job.id: job for job in jobs}
    run_ids = [_run_id(by_id.get(member["job_id"])) for member in study.members]
    progress = progress or ReadProgress()
    progress.total = len(run_ids)

    def read(run_id: str | None) -> dict[str, list[MetricPoint]]:
        history = history_of(client, run_id, whole=WHOLE_HISTORY_KEYS | also_whole)
        progress.one_more()
        return history

    histories = map_on_daemon_threads(read, run_ids, FETCH_THREADS)
    runs = []
    for member, run_id, history in zip(study.members, run_ids, histories, strict=True):
        job = by_id.get(member["job_id"])
        result = (job.result if job is not None else None) or {}
        runs.append(
            StudyRun(
                job_id=member["job_id"],
                optimizer=member["optimizer"],
                grid=member["grid"],
                seed=member["seed"],
                status=str(job.status) if job is not None else "cancelled",
                history=history,
                run_id=run_id,
                error=_error_of(job),
                step_time_ms_median=_float_or_none(result.get("step_time_ms_median")),
                optimizer_step_ms_median=_float_or_none(result.get("optimizer_step_ms_median")),
                attempt=job.attempt if job is not None and job.attempt else 1,
                interrupted_at=_interrupted_at(job),
                resumed_from=_resumed_from(result),
                new_run=_started_afresh(result),
                # A Keras job (its result names the style) times its one compiled step as the update.
                update_timed_apart=result.get("style") is None,
                params_sha256=_str_or_none(result.get("params_sha256")),
            )
        )
    return runs


def map_on_daemon_threads(call: Callable[[Item], Value], items: list[Item], threads: int) -> list[Value]:
    """`[call(item) for item in items]`, `threads` at a time, in order; the first error is raised once
    all have ended. Daemon threads, not a `ThreadPoolExecutor`: the interpreter joins an executor's
    threads at exit, so a worker told to stop while a summary waited on an MLflow server that takes
    connections and never answers had not exited until the server answered (many minutes). A stopped
    worker gives its claim on the study back; the next worker makes the summary again."""
    todo: queue.SimpleQueue[tuple[int, Item]] = queue.SimpleQueue()
    for index, item in enumerate(items):
        todo.put((index, item))
    results: dict[int, Value] = {}
    errors: dict[int, BaseException] = {}

    def work() -> None:
        while True:
            try:
                index, item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = call(item)
            except BaseException as exc:  # re-raised in the caller's thread, in item order
                errors[index] = exc

    workers = [
        threading.Thread(target=work, name=f"optlab-fetch-{n}", daemon=True)
        for n in range(min(threads, len(items)))
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if errors:
        raise errors[min(errors)]
    return [results[index] for index in range(len(items))]


def history_of(
    client: Any, run_id: str | None, *, whole: frozenset[str] = WHOLE_HISTORY_KEYS
) -> dict[str, list[MetricPoint]]:
    """Every metric of the run, each point with its seconds since the run started: whole for the keys
    in `whole` and those under `WHOLE_HISTORY_PREFIXES`, the last point only for the rest."""
    if run_id is None:
        return {}
    run = client.get_run(run_id)
    start_ms = run.info.start_time
    # The run's latest point of each metric (its largest step), as MLflow keeps it with the run.
    latest = {metric.key: metric for metric in getattr(run.data, "_metric_objs", None) or []}
    history: dict[str, list[MetricPoint]] = {}
    for key in sorted(run.data.metrics):
        read_whole = key in whole or key.startswith(WHOLE_HISTORY_PREFIXES) or key not in latest
        points = client.get_metric_history(run_id, key) if read_whole else [latest[key]]
        history[key] = sorted(
            (
                MetricPoint(step=p.step, seconds=(p.timestamp - start_ms) / 1000, value=p.value)
                for p in points
            ),
            key=lambda point: (point.step, point.seconds),
        )
    return history


def _interrupted_at(job: Job | None) -> int | None:
    """The farthest step an earlier attempt of the job reached (`attempt_history`, which also holds the
    attempt that ended the job: not an interruption); None where none ran a step."""
    if job is None:
        return None
    earlier = [record for record in job.attempt_history or [] if (record.get("attempt") or 0) < job.attempt]
    steps = [record.get("step") or 0 for record in earlier]
    farthest = max(steps, default=0)
    return farthest if farthest > 0 else None


def _resumed_from(result: dict[str, Any]) -> int | None:
    """The checkpoint step the job's last attempt resumed from (0: it trained again from the start, in
    the same run); None where its result does not say."""
    resume = result.get("resume")
    step = resume.get("from_step") if isinstance(resume, dict) else result.get("resumed_from_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _started_afresh(result: dict[str, Any]) -> bool:
    """Whether the result says its attempt resumed nothing: a later attempt resumes in the job's MLflow
    run only from a checkpoint (`--resume-run-id`, which records `resume`); with none yet it trains
    from step 0 in a new run. False where there is no result to say."""
    if "status" not in result:
        return False
    return _resumed_from(result) is None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _float_or_none(value: Any) -> float | None:
    """A number from stored JSON; None for anything else (an older result without the key)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _run_id(job: Job | None) -> str | None:
    return (job.mlflow or {}).get("run_id") if job is not None else None


def _error_of(job: Job | None) -> str | None:
    if job is None or not job.error:
        return None
    return f"{job.error.get('type', 'Error')}: {job.error.get('message', '')}"
