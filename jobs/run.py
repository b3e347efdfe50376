"""Run one job: `python -m jobs.run SPEC.json [--workdir DIR] [--tracking-uri URI]`.

The worker starts this in a fresh process per job, so a crashing, leaking or hanging
optimizer never takes the worker down. It always writes `result.json` (status
`succeeded`, `failed`, `diverged` or `cancelled`), except when killed outright.
A spec with `"kind": "check"` runs the conformance checks instead of training.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from jobs.checkpoint_files import RESUMED_FROM, remove_checkpoint
from jobs.errors import EXIT_FIX, Cancelled, Diverged, exit_message
from jobs.frameworks.base import raising_frame
from jobs.processes import (
    STACKS_SIGNAL,
    exit_without_teardown,
    in_legacy_keras_process,
    reexec_with_legacy_keras,
    threads_of,
    watch_the_worker,
)
from jobs.report import Reporter
from jobs.result import (
    FROZEN_FILE,
    RANK_KILLED,
    WORKER_ALIVE_FILE,
    WORKER_SILENCE_ENV,
    CheckOutcome,
    CheckpointRecord,
    ErrorRecord,
    JobResult,
    JobStatus,
    MlflowInfo,
    OptimizerSource,
    Outcome,
    ResumeRecord,
    TrainOutcome,
)
from jobs.resume import ResumePoint, SharedFolderCheckpoints
from jobs.spec import AnySpec, CheckSpec, JobSpec, parse_spec

if TYPE_CHECKING:
    from jobs.distributed import RankProblem

# Where the optimizer and a wrapper's base came from, by role ("optimizer", "base").
Sources = dict[str, OptimizerSource]
TRACEBACK_TAIL_LINES = 40
# A message and each traceback line are cut to these many characters: an error is read by a person,
# and a plugin's 2 MB message had made its job's record, and every listing of jobs, megabytes.
MESSAGE_LIMIT = 4000
TRACEBACK_LINE_LIMIT = 1000
# What the MLflow run ends as, per job status; anything else ends FAILED.
MLFLOW_STATUS = {JobStatus.SUCCEEDED: "FINISHED", JobStatus.CANCELLED: "KILLED"}


class Job(Protocol):
    """A trainer or the check job, as this runner drives it."""

    last_checkpoint: Path | None

    def run(self, *, resume_from: Path | None, stop_after: int | None) -> Outcome: ...


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.run", description=__doc__)
    parser.add_argument("spec", type=Path, help="job spec JSON file")
    parser.add_argument("--workdir", type=Path, help="where checkpoints, progress and result go")
    parser.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="MLflow tracking server (http://...); default $MLFLOW_TRACKING_URI; `none`, or neither "
        "given: no tracking",
    )
    parser.add_argument("--job-id", default="", help="the service's job id, recorded as a tag")
    parser.add_argument("--attempt", type=int, default=1)
    parser.add_argument("--submitted-by", default="", help="the API token name that submitted it, a tag")
    parser.add_argument("--run-name", help="the MLflow run's name (default from the spec); a study's job")
    parser.add_argument("--parent-run-id", help="nest the MLflow run under this one (a study's parent run)")
    parser.add_argument(
        "--tag", action="append", default=[], metavar="KEY=VALUE", help="an extra MLflow tag (repeatable)"
    )
    parser.add_argument(
        "--resume",
        help="continue from this checkpoint: a path or an MLflow URI (runs:/<run_id>/checkpoints/...)",
    )
    parser.add_argument(
        "--resume-run-id", help="log into this existing MLflow run (a resumed attempt) instead of a new one"
    )
    parser.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps")
    parser.add_argument(
        "--plugin-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a plugin file the catalogue found the job's optimizer (or its base) in: read before, and "
        "often instead of, the other plugin files (repeatable; the worker passes them)",
    )
    args = parser.parse_args(argv)
    if args.tracking_uri is not None and args.tracking_uri.strip().lower() in ("", "none"):
        args.tracking_uri = None  # MLflow would take the word for a folder to keep runs in
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def load_spec(path: Path) -> AnySpec:
    try:
        return parse_spec(path.read_text())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid job spec {path}: {problems}") from None


def ensure_process_setup(spec: AnySpec, args: argparse.Namespace) -> None:
    """Legacy tf.keras jobs need TF_USE_LEGACY_KERAS=1 before TensorFlow is imported:
    re-execute this process with it (same pid, so the worker keeps watching it)."""
    from jobs.frameworks import needs_legacy_keras_process, style_of

    if needs_legacy_keras_process(style_of(spec)) and not in_legacy_keras_process():
        reexec_with_legacy_keras("jobs.run", args.argv)


def run_tags(spec: AnySpec, args: argparse.Namespace) -> dict[str, str]:
    tags = {
        "job_id": args.job_id,
        "framework": spec.framework,
        "optimizer": spec.optimizer.name,
        "style": spec.optimizer.style or spec.framework,
        "attempt": str(args.attempt),
    }
    if args.submitted_by:
        tags["submitted_by"] = args.submitted_by
    threads = threads_of(os.environ)
    if threads is not None:  # the worker's OPTLAB_JOB_THREADS: why a run is slower or faster
        tags["threads"] = str(threads)
    for item in args.tag:  # a study's: study, optimizer (its label), each grid hyperparameter, seed
        key, _, value = item.partition("=")
        tags[key] = value
    if args.parent_run_id:
        tags["mlflow.parentRunId"] = args.parent_run_id
    if isinstance(spec, CheckSpec):
        return {**tags, "kind": "check"}
    return {**tags, "workload": spec.workload.name}


def make_job(
    spec: AnySpec,
    *,
    workdir: Path,
    tracker: Any,
    reporter: Reporter,
    checkpoints: Any = None,
    plugin_files: Sequence[str] = (),
) -> tuple[Job, Sources]:
    """The trainer for the spec's framework, or the check job; imports only what that needs. With the
    sources of the optimizer and its base it loaded (a check job's: the class it checks).

    A spec that records where its optimizer came from (the service's, at submission) is held to it
    (`jobs.optimizer_source`), and its files are read first, whatever the worker names."""
    from jobs.optimizer_source import recorded_plugin_files

    choices = [spec.optimizer, spec.optimizer.base]
    plugin_files = list(dict.fromkeys([*recorded_plugin_files(choices), *plugin_files]))
    from jobs.optimizer_source import loaded_entry, source_of

    if isinstance(spec, CheckSpec):
        from jobs.check_job import CheckJob, check_target

        target = check_target(spec, plugin_files)
        check = CheckJob(spec, target=target, workdir=workdir, tracker=tracker, reporter=reporter)
        return check, {"optimizer": source_of(target.entry)}
    from jobs.frameworks import style_of
    from jobs.training.loop import TrainingJob
    from optimizers.registry import load_registry

    base = spec.optimizer.base
    wanted = [spec.optimizer.name] + ([base.name] if base is not None else [])
    registry = load_registry(styles=(style_of(spec),), wanted=wanted, plugin_files=plugin_files)
    # Before anything trains: the class it was validated against, or a failure naming both.
    sources = {
        role: source_of(loaded_entry(registry, choice, style_of(spec)))
        for role, choice in (("optimizer", spec.optimizer), ("base", base))
        if choice is not None
    }
    job = TrainingJob(
        spec, registry=registry, workdir=workdir, tracker=tracker, reporter=reporter, checkpoints=checkpoints
    )
    return job, sources


def start_job(
    spec: AnySpec, args: argparse.Namespace, *, workdir: Path, mlflow_run: Any, reporter: Reporter
) -> tuple[Job, Any, Sources]:
    """The job with its tracker and checkpoint store; for a resumed attempt (`--resume-run-id`) also
    the tracker that skips the points the run holds (jobs.resume.ResumedTracker), else None; and
    where its optimizer (and a wrapper's base) came from."""
    from jobs.resume import ResumedTracker, checkpoint_store, logged_points
    from jobs.tracking import NullTracker

    tracker: Any = mlflow_run or NullTracker()
    resumed = None
    if args.resume_run_id:
        if mlflow_run is None:
            raise ValueError(
                "--resume-run-id needs a tracking server (--tracking-uri or $MLFLOW_TRACKING_URI)"
            )
        resumed = tracker = ResumedTracker(
            mlflow_run, logged_points(mlflow_run.client, mlflow_run.info.run_id)
        )
    name = args.job_id or (mlflow_run.info.run_id if mlflow_run is not None else workdir.name)
    store = checkpoint_store(mlflow_run, job=name, attempt=args.attempt)
    job, sources = make_job(
        spec,
        workdir=workdir,
        tracker=tracker,
        reporter=reporter,
        checkpoints=store,
        plugin_files=args.plugin_file,
    )
    return job, resumed, sources


def record_sources(sources: Sources, result: JobResult, mlflow_run: Any) -> JobResult:
    """Where the optimizer that trains came from, in the result and as the run's tags
    (`optimizer_source`, `optimizer_class`, `optimizer_sha256`; `base_...` for a wrapper's base)."""
    result = result.with_fields(**{f"{role}_source": source for role, source in sources.items()})
    if mlflow_run is None or not sources:
        return result
    tags = {key: value for role, source in sources.items() for key, value in source.tags(role).items()}
    try:
        mlflow_run.set_tags(tags)
    except Exception as exc:  # the result has them; a server that did not answer costs the job nothing
        missed = f"the run's optimizer_source tags were not set ({exc}); result.json has them"
        print(missed, file=sys.stderr)
        result = result.with_fields(warnings=[*(result.warnings or []), missed])
    return result


def with_ranks_end(
    problem: RankProblem | None, status: JobStatus, result: JobResult
) -> tuple[JobStatus, JobResult]:
    """A DDP job's end once its other ranks ended: failed where one did not succeed; where one was
    killed or stopped from outside (out of memory, an operator), failed with RANK_KILLED, which the
    worker retries, and rank 0's own error (a collective's peer gone) as what followed; where one
    failed by its own error, or was found stopped (SIGSTOP), while rank 0 met only the collective it
    broke, that rank's error, with its traceback (rank 0's words alone had named no fault, the rank's
    only in its own result). A cancel stays a cancel."""
    if problem is None or status is JobStatus.CANCELLED:
        return status, result
    then = f"; rank 0 then: {result.error.message}" if result.error else ""
    if problem.killed_from_outside:
        return JobStatus.FAILED, result.with_fields(
            error=ErrorRecord(type=RANK_KILLED, message=problem.message + then)
        )
    if status is JobStatus.SUCCEEDED:
        traceback = problem.error.traceback if problem.error else None  # the rank's own, where it wrote one
        return JobStatus.FAILED, result.with_fields(
            error=ErrorRecord(type="RankFailed", message=problem.message, traceback=traceback)
        )
    if status is JobStatus.FAILED and problem.own_fault and _collective_broke(result.error):
        own = problem.error or ErrorRecord(type="RankStopped", message=problem.message)  # SIGSTOPped
        message = _clipped(problem.message + then, MESSAGE_LIMIT)
        return status, result.with_fields(
            error=ErrorRecord(type=own.type, message=message, traceback=own.traceback)
        )
    return status, result


def _collective_broke(error: ErrorRecord | None) -> bool:
    from jobs.distributed import is_collective_break

    return is_collective_break(error)


def start_ranks_if_ddp(
    spec: AnySpec, args: argparse.Namespace, workdir: Path, resume_from: Path | None
) -> Any:
    """A DDP job's top process is rank 0: it starts the other ranks (jobs.distributed)."""
    from jobs.distributed import current_rank, is_ddp, start_ranks

    if not is_ddp(spec) or current_rank() is not None or not isinstance(spec, JobSpec) or spec.devices < 2:
        return None
    return start_ranks(spec, args.argv, workdir, resume_from)


def resume_source(args: argparse.Namespace, spec: AnySpec, workdir: Path) -> ResumePoint | None:
    """`--resume REF` as a local checkpoint (downloaded when REF is an MLflow URI) whose bytes read
    back whole, else the newest earlier verified one that does (jobs.resume.readable_checkpoint)."""
    if not args.resume:
        return None
    from jobs.frameworks import driver_for, style_of
    from jobs.resume import readable_checkpoint

    return readable_checkpoint(
        args.resume,
        damage=driver_for(style_of(spec)).checkpoint_damage,
        into=workdir / RESUMED_FROM,
        tracking_uri=args.tracking_uri,
    )


def record_resume(resumed: Any, outcome: Outcome, mlflow_run: Any) -> ResumeRecord:
    """What the resumed attempt found in the run, in the result and as `resume/...` metrics."""
    from_step = getattr(outcome, "resumed_from_step", None) or 0
    record: ResumeRecord = resumed.record(from_step)
    for key in ("points_compared", "points_differing", "max_abs_difference"):
        mlflow_run.metric(f"resume/{key}", getattr(record, key), from_step)
    return record


def outcome_kind(spec: AnySpec) -> type[Outcome]:
    return CheckOutcome if isinstance(spec, CheckSpec) else TrainOutcome


def error_record(exc: BaseException) -> ErrorRecord:
    lines = "".join(traceback.format_exception(exc)).splitlines()
    fix = getattr(exc, "fix", None)  # a typed error's advice (StateNotRestored's) belongs with it
    message = _clipped(str(exc), MESSAGE_LIMIT) or _where_raised(exc)
    return ErrorRecord(
        type=type(exc).__name__,
        message=f"{message}. Fix: {fix}" if isinstance(fix, str) and fix else message,
        traceback="\n".join(_clipped(line, TRACEBACK_LINE_LIMIT) for line in lines[-TRACEBACK_TAIL_LINES:]),
    )


def _clipped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def _where_raised(exc: BaseException) -> str:
    """For an error that says nothing (a bare `assert`, pytorch-optimizer's base `step()` raising
    NotImplementedError for LOMO, which updates in `fused_backward`): where it was raised."""
    frame = raising_frame(exc)
    if frame is None:
        return "raised with no message"
    return f"raised with no message at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Cancelled("the job was stopped by its worker (cancelled or worker shutdown)")


def run_job(args: argparse.Namespace) -> JobResult:
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="optlab-job-"))
    workdir.mkdir(parents=True, exist_ok=True)
    watch_the_worker(workdir, WORKER_ALIVE_FILE, FROZEN_FILE, WORKER_SILENCE_ENV)
    reporter = Reporter(workdir)
    started = time.time()
    # FAILED until the job's run() returns: whatever goes wrong on the way is a failed job.
    result = JobResult(
        job_id=args.job_id, attempt=args.attempt, workdir=str(workdir), status=JobStatus.FAILED
    )
    threads = threads_of(os.environ)
    if threads is not None:
        result = result.with_fields(threads=threads)
    status = JobStatus.FAILED
    mlflow_run: Any = None
    job: Job | None = None
    spec: AnySpec | None = None
    ranks: Any = None
    resume_point: ResumePoint | None = None
    try:
        spec = load_spec(args.spec)
        reporter.progress(step=0, total=spec.total_steps, force=True)
        ensure_process_setup(spec, args)
        # Heavy imports only now, so a bad spec fails in a fraction of a second.
        if args.tracking_uri:
            from jobs.tracking import start_run, tracking_server

            server = tracking_server(args.tracking_uri)
            with reporter.waiting_on(f"waiting for the MLflow server at {server} to start the job's run"):
                mlflow_run = start_run(
                    args.tracking_uri,
                    experiment=spec.experiment,
                    run_name=args.run_name or spec.run_name(),
                    params=spec.flat_params(),
                    tags=run_tags(spec, args),
                    resume_run_id=args.resume_run_id,
                )
            mlflow = MlflowInfo.model_validate(mlflow_run.info.to_json())
            result = result.with_fields(mlflow=mlflow)
            reporter.progress(mlflow=mlflow, force=True)
            for warning in getattr(mlflow_run, "warnings", []):  # the job's log, as it happens
                print(warning, file=sys.stderr)
        resume_point = resume_source(args, spec, workdir)
        resume_from = resume_point.path if resume_point else None
        if resume_point and resume_point.warnings:
            print(*resume_point.warnings, sep="\n", file=sys.stderr)  # the job's log, as it happens
        ranks = start_ranks_if_ddp(spec, args, workdir, resume_from)
        job, resumed, sources = start_job(
            spec, args, workdir=workdir, mlflow_run=mlflow_run, reporter=reporter
        )
        result = record_sources(sources, result, mlflow_run)
        outcome = job.run(resume_from=resume_from, stop_after=args.stop_after)
        result = result.with_outcome(outcome, kind=outcome_kind(spec))
        if resumed is not None:
            result = result.with_fields(resume=record_resume(resumed, outcome, mlflow_run))
        status = JobStatus.SUCCEEDED
    except Cancelled as exc:  # asked for: where the code was when it stopped is no one's concern
        status, result = (
            JobStatus.CANCELLED,
            result.with_fields(error=ErrorRecord(type="Cancelled", message=str(exc))),
        )
    except Exception as exc:  # every failure becomes a readable result
        if isinstance(exc, Diverged):
            status, result = JobStatus.DIVERGED, result.with_fields(diverged_at_step=exc.step)
        result = result.with_fields(error=error_record(exc))
        # And goes to the job's log whole, where the rest of its story is (and its MLflow copy).
        traceback.print_exception(exc, file=sys.stderr)
    except SystemExit as exc:  # the user's code called sys.exit(): a failure, told as one
        record = error_record(exc)
        where = _where_raised(exc).removeprefix("raised with no message ")  # "at FILE:LINE: CODE"
        message = f"{exit_message(exc)}; {where}" if where.startswith("at ") else exit_message(exc)
        result = result.with_fields(
            error=record.model_copy(update={"message": f"{message}. Fix: {EXIT_FIX}"})
        )
        traceback.print_exception(exc, file=sys.stderr)
    if ranks is not None:  # DDP: the job succeeded only if every rank did, to the same weights
        status, result = with_ranks_end(ranks.finish(stop=status is not JobStatus.SUCCEEDED), status, result)
        drifted = ranks.drifted(result.params_sha256) if status is JobStatus.SUCCEEDED else None
        if drifted is not None:
            print(drifted, file=sys.stderr)  # the job's log too, where a reader of the run looks
            result = result.with_fields(warnings=[*(result.warnings or []), drifted])
    if isinstance(spec, JobSpec) and job is not None and status is not JobStatus.SUCCEEDED:
        result = result.with_fields(**checkpoints_so_far(job, diverged=status is JobStatus.DIVERGED))
    if resume_point and resume_point.warnings:  # the newer checkpoints it passed over, first
        result = result.with_fields(warnings=[*resume_point.warnings, *(result.warnings or [])])
    started_with = getattr(mlflow_run, "warnings", None) or []  # its experiment restored, say
    if started_with:
        result = result.with_fields(warnings=[*started_with, *(result.warnings or [])])
    # The download is a copy of a checkpoint the run keeps (a retry downloads it again): it had stayed,
    # a whole checkpoint more on the worker's disk for every resumed attempt.
    shutil.rmtree(workdir / RESUMED_FROM, ignore_errors=True)
    remove_checkpoint_copy(job)
    store = getattr(job, "store", None)
    if status is JobStatus.SUCCEEDED and isinstance(store, SharedFolderCheckpoints):
        store.remove_earlier_attempts()  # no attempt resumes a succeeded job
    result = result.with_fields(status=status, duration_s=round(time.time() - started, 3))
    if mlflow_run is not None:
        # A stop request now would leave the MLflow run RUNNING: finish first (the worker's
        # SIGKILL after its grace period still bounds this).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server = mlflow_run.info.server
        with reporter.waiting_on(
            f"waiting for the MLflow server at {server} to take the job's last metrics and files"
        ):
            result = finish_mlflow_run(mlflow_run, result, job, spec)
    reporter.result(result)
    return result


def remove_checkpoint_copy(job: Job | None) -> None:
    """The job's last checkpoint where it is a copy (every one before was removed as it was
    superseded): its MLflow run holds it, or, in a DDP job's other ranks, rank 0's is the job's. It
    had stayed in the job's folder, a whole model (two for Keras) per job and rank on the worker's
    disk. Where it is the job's only one (the workdir, uploaded at the end below; the shared folder),
    it stays."""
    from jobs.distributed import current_rank

    if job is None or job.last_checkpoint is None:
        return
    rank = current_rank()
    if published_in_run(job) or (rank is not None and rank.rank > 0):
        with suppress(OSError):  # a copy it could not remove costs disk, never the job's result
            remove_checkpoint(job.last_checkpoint)


def published_in_run(job: Job | None) -> bool:
    """Whether the job's checkpoints are published to its MLflow run as each is verified."""
    return bool(getattr(getattr(job, "store", None), "in_run", False))


def checkpoints_so_far(job: Job, *, diverged: bool = False) -> dict[str, Any]:
    """A trainer that stopped early: the checkpoints it verified, the warnings it gathered, and the
    steps it completed (a failure at the step-500 checkpoint: 500). Not for a divergence: the
    flush that finds one comes steps after it, and the job's step is the one its error names
    (`diverged_at_step`)."""
    verified: list[CheckpointRecord] = getattr(job, "verified", [])
    warnings: list[str] = getattr(job, "warnings", [])
    steps: int | None = None if diverged else getattr(job, "steps_completed", None)
    return {"checkpoints": list(verified), "warnings": warnings, "steps_completed": steps}


def finish_mlflow_run(mlflow_run: Any, result: JobResult, job: Job | None, spec: AnySpec | None) -> JobResult:
    """Artifacts (spec, result, final checkpoint or check report), then flush metrics and end the run."""
    mlflow_status = MLFLOW_STATUS.get(result.status, "FAILED")
    outcome = result.status.value  # MLflow's FAILED alone does not tell a divergence from a failure
    try:
        try:
            if job is not None and job.last_checkpoint is not None and not published_in_run(job):
                mlflow_run.log_artifact(job.last_checkpoint, "checkpoints")
            for path in getattr(job, "artifacts", []):  # a check job's report.json and report.md
                mlflow_run.log_artifact(path)
            if spec is not None:
                mlflow_run.log_json("spec.json", spec.model_dump(mode="json"))
            mlflow_run.log_json("result.json", result.to_json())
        except Exception:
            mlflow_status, outcome = "FAILED", JobStatus.FAILED.value
            raise
        finally:
            mlflow_run.end(mlflow_status, outcome=outcome)  # flushes metrics; the run never stays RUNNING
    except Exception as exc:
        if result.error is not None:  # the job's own failure stays its error (often this one's cause)
            said = f"its run's last files were not stored either: {type(exc).__name__}: {exc}"
            return result.with_fields(status=JobStatus.FAILED, warnings=[*(result.warnings or []), said])
        result = result.with_fields(status=JobStatus.FAILED, error=error_record(exc))
    return result


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    # The worker asks a job whose progress stopped moving for the stacks of its threads
    # (service/stall.py). faulthandler writes them from C: a thread stuck holding the GIL is shown too.
    with suppress(ValueError, AttributeError, OSError):  # a stderr with no file behind it: no stacks
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    result = run_job(parse_args(argv))
    return 0 if result.status is JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    exit_without_teardown(main())
