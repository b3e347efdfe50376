"""A study's end, done once: summary, report, both logged to the parent run, which then ends.

The worker does it, in its polling loop, for any study whose jobs have all ended (so also one
cancelled while every job was still queued, which no job's end would announce). A study is claimed
for a lease with a conditional update, so two workers never finalize it at once; `finalized_at`
records that it is done, so it is never done twice. A finalizer that dies mid-way leaves its claim to
expire and the next worker does it all again: every step is idempotent (metrics logged at one fixed
timestamp, artifacts overwritten, the run ended again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jobs.result import JobStatus
from jobs.spec import Catalogue, StudySpec, default_style
from jobs.workloads.surfaces import surface_for
from service import store
from service.models import Job, Study
from service.studies import store as study_store
from service.studies.collect import ReadProgress, collect_runs
from service.studies.report import Report, StudySetup, Surface, render_report
from service.studies.runs import (
    ensure_parent_run,
    log_missing_params,
    mlflow_client,
    shown_tracking_uri,
    study_runs_url,
    target_params,
)
from service.studies.summary import StudySummary, TargetRule, summarize

log = logging.getLogger("optlab.worker")

# A claim renewed every `SLOW_SUMMARY_NOTE_S` while its summary is being made: a worker killed then
# holds the study for this long at most (it had been ten minutes of "summarizing" with no reason).
FINALIZE_LEASE_S = 120.0
# After this long, and as long again each time, a summary being made says on its study how far it is.
SLOW_SUMMARY_NOTE_S = 30.0
RETRY_AFTER_ERROR_S = 30.0
NOT_IN_MLFLOW = "The summary and the report are kept by optlab only, not in MLflow"
# Without a target, the best grid point is the one with the lowest final validation loss.
DEFAULT_SELECTION: tuple[str, Literal["min", "max"]] = ("val/loss", "min")


def finalize_next_study(
    *, sessions: Any, tracking_uri: str, within_s: float, holding: set[int] | None = None
) -> bool:
    """Finalize one ended study, if there is one; False when there was none. `within_s`: the lease
    within which a worker is live (its catalogue counts: `store.catalogue_version`). `holding`: the
    caller's set of studies claimed and not yet done, for a worker that stops to give back."""
    with sessions() as session:
        study = study_store.claim_study_to_finalize(session=session, lease_s=FINALIZE_LEASE_S)
        # Read only for a claimed study: this runs on every poll of every worker, and the catalogue
        # is the store's largest row.
        catalogue = store.latest_catalogue(session=session, within_s=within_s) if study is not None else None
    if study is None:
        return False
    holding = holding if holding is not None else set()
    holding.add(study.id)
    try:
        _finalize_claimed(
            sessions,
            tracking_uri,
            study,
            catalogue.catalogue if catalogue else None,
            held=lambda: study.id in holding,
        )
    finally:
        holding.discard(study.id)
    return True


def _finalize_claimed(
    sessions: Any, tracking_uri: str, study: Study, catalogue: Catalogue | None, *, held: Callable[[], bool]
) -> None:
    progress = ReadProgress()
    try:
        with _said_while_slow(sessions, study.id, tracking_uri, progress, held=held):
            finalized = finalize(
                sessions=sessions,
                tracking_uri=tracking_uri,
                study=study,
                catalogue=catalogue,
                progress=progress,
            )
    except Exception as exc:  # MLflow unreachable, say: shown on the study and tried again
        log.exception("study %s: could not compute its summary", study.id)
        with sessions() as session:
            study_store.record_finalize_error(
                session=session,
                study_id=study.id,
                error=f"{type(exc).__name__}: {exc}",
                retry_s=RETRY_AFTER_ERROR_S,
            )
        return
    with sessions() as session:
        study_store.record_summary(
            session=session,
            study_id=study.id,
            summary=finalized.summary.model_dump(mode="json"),
            report_html=finalized.report.html,
            not_in_mlflow=finalized.not_in_mlflow,
        )
    if finalized.not_in_mlflow:
        log.warning("study %s: summary recorded, not in MLflow: %s", study.id, finalized.not_in_mlflow)
    else:
        log.info("study %s: summary recorded", study.id)


@contextlib.contextmanager
def _said_while_slow(
    sessions: Any, study_id: int, tracking_uri: str, progress: ReadProgress, *, held: Callable[[], bool]
) -> Iterator[None]:
    """Every `SLOW_SUMMARY_NOTE_S` while its summary is being made and the claim is `held` (a worker
    that stops gives it back): renew the study's claim, and say on it for how long it has been made
    and how many runs are read (a long job's runs take a while), and, where none was read since the
    last note, that MLflow's client waits out a server that takes connections and never answers
    (stopped, overloaded) for many minutes before it raises."""
    done = threading.Event()
    started = time.monotonic()
    read_before = -1

    def note() -> None:
        nonlocal read_before
        while not done.wait(SLOW_SUMMARY_NOTE_S) and held():
            said = _slow_note(time.monotonic() - started, progress, read_before, tracking_uri)
            read_before = progress.read
            try:
                with sessions() as session:
                    study_store.renew_finalize_claim(
                        session=session, study_id=study_id, lease_s=FINALIZE_LEASE_S
                    )
                    study_store.record_summary_waiting(session=session, study_id=study_id, note=said)
            except Exception:  # a note only: the store away, say
                log.warning(
                    "study %s: could not say that its summary waits on MLflow", study_id, exc_info=True
                )

    noting = threading.Thread(target=note, name=f"optlab-study-{study_id}-slow", daemon=True)
    noting.start()
    try:
        yield
    finally:
        done.set()
        noting.join()


def _slow_note(waited: float, progress: ReadProgress, read_before: int, tracking_uri: str) -> str:
    server = shown_tracking_uri(tracking_uri)
    said = f"the summary has been in the making for {waited:.0f} s: "
    if not progress.total:  # not reading runs yet (the store, the catalogue)
        return (
            f"{said}it reads the jobs' runs from MLflow at {server}, whose client waits many minutes "
            "for a server that does not answer before it gives up"
        )
    if progress.read == progress.total:  # the report is drawn and logged to the parent run
        return (
            f"{said}all {progress.total} runs read from MLflow at {server}; the report is being made "
            "and logged to the study's parent run"
        )
    said += f"{progress.read} of {progress.total} runs read from MLflow at {server}"
    if progress.read == read_before:
        said += (
            f", none in the last {SLOW_SUMMARY_NOTE_S:.0f} s (a run of many steps takes a while; MLflow's "
            "client also waits many minutes for a server that does not answer before it gives up)"
        )
    return said


def target_of(spec: StudySpec, catalogue: Catalogue | None) -> TargetRule | None:
    """The study's target, else its workload's default target (from the catalogue), else none."""
    if spec.target is not None:
        return TargetRule(metric=spec.target.metric, mode=spec.target.mode, value=spec.target.value)
    workload = catalogue.workload(spec.workload.name) if catalogue is not None else None
    default = (workload or {}).get("default_target")
    if not default:
        return None
    return TargetRule(metric=str(default["metric"]), mode=default["mode"], value=float(default["value"]))


@dataclass(frozen=True)
class Finalized:
    summary: StudySummary
    report: Report
    # Why the parent run does not hold them (deleted); None when it does.
    not_in_mlflow: str | None = None


def finalize(
    *,
    sessions: Any,
    tracking_uri: str,
    study: Study,
    catalogue: Catalogue | None,
    progress: ReadProgress | None = None,
) -> Finalized:
    spec = StudySpec.model_validate(study.spec)
    client = mlflow_client(tracking_uri)
    with sessions() as session:
        jobs = study_store.study_jobs(session=session, study_id=study.id)
    target = target_of(spec, catalogue)
    metric, mode = (target.metric, target.mode) if target is not None else DEFAULT_SELECTION
    runs = collect_runs(client, study, jobs, also_whole=frozenset({metric}), progress=progress)
    summary = summarize(
        runs,
        target=target,
        baseline=spec.baseline,
        selection_metric=metric,
        selection_mode=mode,
        steps=spec.steps,
        eval_every=spec.eval_every,
    )
    # A study cancelled before any job started has no parent run yet: its summary needs one.
    parent = ensure_parent_run(sessions=sessions, tracking_uri=tracking_uri, study=study)
    gone = parent_run_gone(client, parent)
    if gone is not None:  # said where the summary is read (the API, the CLI, the report)
        summary = summary.model_copy(update={"notes": [*summary.notes, f"{NOT_IN_MLFLOW}: {gone}."]})
    with sessions() as session:
        recorded = study_store.get_study(session=session, study_id=study.id)
    assert recorded is not None and recorded.experiment_id is not None
    url = study_runs_url(shown_tracking_uri(tracking_uri), recorded.experiment_id, study.id)
    report = render_report(
        summary,
        runs,
        title=f"Study {study.name}",
        surface=surface_of(spec),
        mlflow_url=url,
        setup=setup_of(spec),
    )
    if gone is None:
        try:
            if target is not None:  # the spec's, logged at the start already, or its workload's default
                log_missing_params(client, parent, target_params(target.metric, target.mode, target.value))
            log_to_parent(client, parent, study, summary, report, status=parent_run_status(study, jobs))
        except Exception:
            gone = parent_run_gone(client, parent)  # deleted meanwhile? Else (a server down): retried
            if gone is None:
                raise
    return Finalized(summary, report, f"{NOT_IN_MLFLOW}: {gone}" if gone else None)


def parent_run_gone(client: Any, run_id: str) -> str | None:
    """Why the study's parent run can take the summary no more (deleted, in MLflow's UI say, or
    removed from the server), else None. MLflow refuses every write to a deleted run, and always
    will: retried, the study had stayed `summarizing` for ever, neither cancellable nor reported. A
    server that cannot be reached raises here, and the summary is tried again."""
    from mlflow.exceptions import RestException

    try:
        run = client.get_run(run_id)
    except RestException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return f"its parent run {run_id} no longer exists in MLflow"
        raise
    if run.info.lifecycle_stage == "deleted":
        return f"its parent run {run_id} was deleted in MLflow"
    return None


def parent_run_status(study: Study, jobs: list[Job]) -> Literal["KILLED", "FINISHED"]:
    """KILLED when the study was cancelled and a job of it did end cancelled; FINISHED otherwise, even
    with its cancel flagged: a cancel that raced its last job's end, every job succeeding, stopped
    nothing, and a KILLED parent over all-succeeded children had misread in MLflow."""
    stopped = any(job.status is JobStatus.CANCELLED for job in jobs)
    return "KILLED" if study.cancel_requested and stopped else "FINISHED"


def log_to_parent(
    client: Any,
    run_id: str,
    study: Study,
    summary: StudySummary,
    report: Report,
    *,
    status: Literal["KILLED", "FINISHED"],
) -> None:
    from mlflow.entities import Metric

    # One fixed timestamp: a finalization done again logs the very same points.
    timestamp = int(study.created_at.timestamp() * 1000)
    metrics = [Metric(key, value, timestamp, 0) for key, value in sorted(summary.flat_metrics().items())]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "summary.json").write_text(json.dumps(summary.model_dump(mode="json"), indent=2))
        (folder / "report.html").write_text(report.html)
        images = folder / "images"
        images.mkdir()
        for name, data in report.images.items():
            (images / Path(name).name).write_bytes(data)
        client.log_artifacts(run_id, str(folder))
    client.set_terminated(run_id, status=status)


def surface_of(spec: StudySpec) -> Surface | None:
    """The 2-D test function a workload (rosenbrock, a 2-D quadratic) draws trajectories over."""
    return surface_for(spec.workload.name, spec.workload.params)


def setup_of(spec: StudySpec) -> StudySetup:
    """What the report's header says the study ran: each optimizer's implementation (its style, the
    framework's default where the spec names none)."""
    return StudySetup(
        framework=spec.framework,
        workload=spec.workload.name,
        steps=spec.steps,
        batch_size=spec.batch_size,
        implementations={
            o.key: f"{o.name} ({o.style or default_style(spec.framework)})" for o in spec.optimizers
        },
    )
