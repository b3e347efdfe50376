"""A job resumed by another attempt, maybe on another worker: where its checkpoints live, and
the points its MLflow run already holds.

Where checkpoints live (`checkpoint_store`):

- **Default: the MLflow artifact store.** Each verified checkpoint is uploaded to the job's run
  (`checkpoints/step-...`) and reported as `runs:/<run_id>/checkpoints/step-...`. Every worker
  already reaches the tracking server over HTTP (and through it, with `--serve-artifacts`, the
  artifacts), so a job resumes on any host with no further setup; the checkpoint also stays with
  the run it belongs to. The cost is one upload per checkpoint (small for these workloads) and
  every verified checkpoint kept in the run, or the newest `OPTLAB_KEEP_CHECKPOINTS` of them.
- **`OPTLAB_CHECKPOINT_DIR`** (a folder every worker mounts at the same path): checkpoints are
  written there directly, under `<job>/attempt-<n>/`, the latest two kept, nothing uploaded.
  Cheaper for large models, but it needs a shared filesystem, which a plain docker-compose of GPU
  hosts does not have: an option, not the default.
- Neither (no tracking server, no folder): the job's own workdir, reachable on this host only.

De-duplicated points (`ResumedTracker`): the resumed attempt recomputes the steps between its
checkpoint and the last point the run holds. It reads the run's points per key first, skips
every point at or below the last logged step of its key, and compares the recomputed values with
the logged ones (timings excepted): the differences are the job's nondeterminism, a
`ResumeRecord` in the result (bitwise zero on CPU).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jobs.checkpoint_files import (
    CHECKPOINT_DIR_ENV,
    KEEP_CHECKPOINTS_ENV,
    checkpoint_name,
    checkpoint_step,
    earlier_attempts,
    remove_checkpoint,
)
from jobs.result import ResumeRecord
from jobs.tracking import Point, Tracker, unanswered

RUN_ARTIFACTS = "checkpoints"  # where a run's checkpoints lie among its artifacts
UNANSWERED_REMOVALS = 2  # checkpoints in a row whose older ones' removal got no answer, before it stops
# Keys whose values are measurements of time, not results: never compared.
UNCOMPARED_PREFIXES = ("perf/",)


class CheckpointStore(Protocol):
    """Where a job writes checkpoints, and the reference another worker resumes one from."""

    # The folder checkpoints are written to; None: the job's workdir.
    folder: Path | None
    # Whether every checkpoint already lies in the MLflow run (no final upload needed).
    in_run: bool

    @property
    def server(self) -> str | None:
        """The tracking server a publication waits on, as a message names it (None: on none)."""

    @property
    def warnings(self) -> Sequence[str]:
        """What the job's result should say of the store (read as each publication is settled)."""

    def publish(self, path: Path) -> str: ...

    def retire(self, path: Path) -> None:
        """`path` was superseded by a newer verified checkpoint."""


class WorkdirCheckpoints:
    """No tracking server and no shared folder: the path itself, on this host only."""

    folder: Path | None = None
    in_run = False
    server = None
    warnings: Sequence[str] = ()

    def publish(self, path: Path) -> str:
        return str(path)

    def retire(self, path: Path) -> None:
        remove_checkpoint(path)  # only the latest verified one is kept


def delivered(run: Any) -> None:
    """Every point logged so far is in the run before a checkpoint is published: an attempt resuming
    from it then finds each step up to the checkpoint logged, and none lost between the two."""
    if run is not None:
        run.delivery.flush()


class SharedFolderCheckpoints:
    """Written straight into the shared folder every worker mounts: the path is the reference."""

    in_run = False
    warnings: Sequence[str] = ()

    def __init__(self, root: Path, job: str, attempt: int, run: Any = None) -> None:
        # Each attempt a folder of its own: the loop keeps only its latest checkpoint, and must never
        # delete the one another attempt may still be resuming from.
        self.folder: Path | None = root / job / f"attempt-{attempt}"
        self.attempt = attempt
        self.run = run
        self.previous: Path | None = None

    @property
    def server(self) -> str | None:
        return self.run.info.server if self.run is not None else None  # its metrics are delivered first

    def publish(self, path: Path) -> str:
        delivered(self.run)
        return str(path)

    def retire(self, path: Path) -> None:
        # The one before the latest stays: the worker may not have read the latest's report yet when
        # this process dies, and must find the one it knows.
        if self.previous is not None:
            remove_checkpoint(self.previous)
        self.previous = path

    def remove_earlier_attempts(self) -> None:
        """Once the job has succeeded, no attempt will resume from an earlier attempt's checkpoints:
        their folders, each left with its last two by a killed process, would otherwise stay on the
        shared disk for good. Not sooner: while the job runs, the store may still name one of them
        (a worker that could not relay this attempt's reports through a store outage)."""
        assert self.folder is not None
        for folder in earlier_attempts(self.folder.parent, self.attempt):
            shutil.rmtree(folder, ignore_errors=True)


class MlflowCheckpoints:
    """Uploaded to the job's MLflow run: `runs:/<run_id>/checkpoints/<name>`; every verified one
    stays there, or the newest `keep` (an earlier attempt's older ones are removed too)."""

    folder: Path | None = None
    in_run = True

    def __init__(self, run: Any, keep: int | None = None) -> None:
        self.run = run  # jobs.tracking.MlflowRun
        self.keep = keep
        self.warnings: list[str] = []
        self._artifacts: Any = None  # the run's artifact repository, once a checkpoint is removed
        self._unanswered = 0  # removals in a row the server gave no answer to

    @property
    def server(self) -> str | None:
        return str(self.run.info.server)

    def publish(self, path: Path) -> str:
        delivered(self.run)
        self.run.log_artifact(path, RUN_ARTIFACTS)
        reference = f"runs:/{self.run.info.run_id}/{RUN_ARTIFACTS}/{path.name}"
        self._keep_the_newest(reference)
        return reference

    def retire(self, path: Path) -> None:
        remove_checkpoint(path)  # the local copy

    def _keep_the_newest(self, published: str) -> None:
        """The run's checkpoints up to `published` but the newest `keep` removed, on the publication's
        thread (training goes on meanwhile). An attempt that resumes from one removed since its worker
        recorded it takes the newest the run holds (`newer_checkpoint_in_run`). A server that gives no
        answer (a restart) has it tried again with the next checkpoint, UNANSWERED_REMOVALS times in a
        row at most (MLflow's client retries each for minutes); one that refuses, not again."""
        if self.keep is None:
            return
        try:
            self._remove_all_but_newest(published, self.keep)
        except Exception as exc:
            self._unanswered = self._unanswered + 1 if unanswered(exc) else 0
            if not 0 < self._unanswered < UNANSWERED_REMOVALS:
                self._stop_removing(exc)
        else:
            self._unanswered = 0

    def _stop_removing(self, exc: Exception) -> None:
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]  # HTTPError holds the whole page
        warning = (
            f"{KEEP_CHECKPOINTS_ENV}={self.keep}: could not remove the run's older checkpoints "
            f"({type(exc).__name__}: {first_line}); this attempt keeps every checkpoint from here"
        )
        print(f"optlab: warning: {warning}", file=sys.stderr, flush=True)
        self.warnings.append(warning)
        self.keep = None

    def _remove_all_but_newest(self, published: str, keep: int) -> None:
        """Newer ones than `published` (an earlier attempt's, past where this one resumed) stay:
        this attempt writes over them as it gets there, and the one it just published is kept."""
        step = checkpoint_step(checkpoint_name(published)) or 0
        run, info = self.run, self.run.info
        beside = checkpoints_beside(published, tracking_uri=info.tracking_uri, client=run.client)
        older = [reference for at, reference in beside if at <= step][keep:]
        if not older:
            return
        if self._artifacts is None:
            from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

            artifact_uri = run.client.get_run(info.run_id).info.artifact_uri
            self._artifacts = get_artifact_repository(artifact_uri, tracking_uri=info.tracking_uri)
        for reference in reversed(older):  # the oldest first: one cut short leaves the newer ones
            self._artifacts.delete_artifacts(f"{RUN_ARTIFACTS}/{checkpoint_name(reference)}")


def checkpoints_to_keep(environ: Mapping[str, str]) -> int | None:
    """`OPTLAB_KEEP_CHECKPOINTS`: how many of a job's newest verified checkpoints its MLflow run
    keeps; None (unset or empty): every one."""
    raw = environ.get(KEEP_CHECKPOINTS_ENV, "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
        raise ValueError(
            f"{KEEP_CHECKPOINTS_ENV}={raw!r}: a whole number of at least 1 (how many of a job's newest "
            "verified checkpoints its MLflow run keeps), or unset to keep every one"
        )
    return int(raw)


def checkpoint_store(
    mlflow_run: Any, *, job: str, attempt: int, environ: Mapping[str, str] | None = None
) -> CheckpointStore:
    """The shared folder when `OPTLAB_CHECKPOINT_DIR` is set, else the run's artifacts, else the workdir."""
    environ = os.environ if environ is None else environ
    root = environ.get(CHECKPOINT_DIR_ENV)
    if root:
        return SharedFolderCheckpoints(Path(root), job, attempt, mlflow_run)
    if mlflow_run is not None:
        return MlflowCheckpoints(mlflow_run, keep=checkpoints_to_keep(environ))
    return WorkdirCheckpoints()


def fetch_checkpoint(reference: str, *, into: Path, tracking_uri: str | None) -> Path:
    """The checkpoint `reference` names as a local path: downloaded when it is an MLflow URI.

    FileNotFoundError, naming the reference, when there is nothing there: a resume must fail
    clearly, never quietly train from step 0 in a run that already holds points.
    """
    if "://" not in reference and ":/" not in reference:
        path = Path(reference)
        if not path.exists():
            raise FileNotFoundError(
                f"--resume: checkpoint {reference} does not exist (is the folder shared?)"
            )
        return path
    import mlflow.artifacts

    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    try:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=reference, dst_path=str(into), tracking_uri=tracking_uri
        )
    except Exception as exc:  # MLflow raises its own types for a missing run or artifact
        raise FileNotFoundError(f"--resume: checkpoint {reference} could not be downloaded: {exc}") from None
    path = Path(local)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        raise FileNotFoundError(f"--resume: checkpoint {reference} is not in the run's artifacts")
    return path


class DamagedCheckpoint(ValueError):
    """The job's last verified checkpoint, and every earlier one kept, fail to read back whole."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed attempt starts from, and what it says of newer ones it passed over."""

    path: Path
    warnings: tuple[str, ...] = ()


def readable_checkpoint(
    reference: str, *, damage: Callable[[Path], str | None], into: Path, tracking_uri: str | None
) -> ResumePoint:
    """The job's last verified checkpoint, `reference`, fetched; where its bytes are damaged (what
    `damage` says, from the style's own checksums), the newest earlier verified one that reads whole.

    A damaged file must never be resumed from: torch loads a checkpoint with a flipped byte in a
    tensor without a word, and the job would go on from weights it never had. An earlier checkpoint
    costs only the steps since it, trained again: their points are compared, not logged twice.
    """
    gone = ""
    try:
        path = fetch_checkpoint(reference, into=into, tracking_uri=tracking_uri)
    except FileNotFoundError:
        newer = newer_checkpoint_in_run(reference, tracking_uri=tracking_uri)
        if newer is None:
            raise
        path = fetch_checkpoint(newer, into=into, tracking_uri=tracking_uri)
        gone = (
            f"checkpoint {checkpoint_name(reference)}, the last one the job's worker knew of, is no longer "
            f"in its run; the newest the run holds is {checkpoint_name(newer)} (each one in a run was "
            "verified before it was published)"
        )
        reference = newer
    problem = damage(path)
    if problem is None:
        return ResumePoint(path, (f"{gone}: resumed from it",) if gone else ())
    latest = f"checkpoint {checkpoint_name(reference)}, the job's last verified one, is damaged: {problem}"
    latest = f"{gone}; {latest}" if gone else latest
    passed_over: list[str] = []
    for earlier in earlier_checkpoints(reference, tracking_uri=tracking_uri):
        path = fetch_checkpoint(earlier, into=into, tracking_uri=tracking_uri)
        problem = damage(path)
        if problem is None:
            also = "".join(f"; {line}" for line in passed_over)
            return ResumePoint(
                path,
                (
                    f"{latest}{also}. Resumed from {checkpoint_name(earlier)}, the newest earlier "
                    "verified checkpoint that reads back whole: the steps since it were trained again",
                ),
            )
        passed_over.append(f"{checkpoint_name(earlier)} is damaged too: {problem}")
    if not passed_over:
        raise DamagedCheckpoint(f"{latest}; no earlier verified checkpoint of the job is kept where it lies")
    raise DamagedCheckpoint("; ".join([latest, *passed_over]))


def checkpoints_beside(
    reference: str, *, tracking_uri: str | None, client: Any = None
) -> list[tuple[int, str]]:
    """Every checkpoint where `reference` lies, as (step, reference), newest first: the MLflow run's
    (each one verified before it was published; listed through `client` where one is given) or the
    folder's."""
    if reference.startswith("runs:/"):
        run_id, _, folder = reference[len("runs:/") :].rstrip("/").rpartition("/")[0].partition("/")
        if client is None:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
        listed = client.list_artifacts(run_id, folder)
        names = [info.path.rsplit("/", 1)[-1] for info in listed]
        prefix = f"runs:/{run_id}/{folder}/"
    else:
        parent = Path(reference).parent
        names = [path.name for path in parent.iterdir()] if parent.is_dir() else []
        prefix = f"{parent}/"
    found = [(step, prefix + name) for name in names if (step := checkpoint_step(name)) is not None]
    return sorted(found, reverse=True)


def earlier_checkpoints(reference: str, *, tracking_uri: str | None) -> list[str]:
    """The job's verified checkpoints older than `reference`, newest first, where they lie: every one
    in the MLflow run (the run keeps each verified checkpoint, or the newest OPTLAB_KEEP_CHECKPOINTS);
    in a folder, the ones beside it (the shared folder keeps the one before the latest, the workdir
    none)."""
    step = checkpoint_step(checkpoint_name(reference))
    if step is None:
        return []
    return [other for at, other in checkpoints_beside(reference, tracking_uri=tracking_uri) if at < step]


def newer_checkpoint_in_run(reference: str, *, tracking_uri: str | None) -> str | None:
    """Where `reference` is gone from its MLflow run, the newest checkpoint the run holds past it, if
    any. A worker killed between two reports records a checkpoint the run may have removed since
    (OPTLAB_KEEP_CHECKPOINTS); every checkpoint in a run was verified before it was published, so the
    newest is as good a start. None where the reference is still listed (its download failed for
    another reason, which its error says), where the run cannot be listed, and in a folder (a newer
    file there may be one whose round trip failed)."""
    step = checkpoint_step(checkpoint_name(reference))
    if step is None or not reference.startswith("runs:/"):
        return None
    try:
        beside = checkpoints_beside(reference, tracking_uri=tracking_uri)
    except Exception:  # a server that could not serve the download: its error is the one to tell
        return None
    if any(other == reference.rstrip("/") for _, other in beside):
        return None
    newer = [other for at, other in beside if at > step]
    return newer[0] if newer else None


def logged_points(client: Any, run_id: str) -> dict[str, dict[int, float]]:
    """Every point the run holds, by key then step (one history query per key the run has)."""
    keys = client.get_run(run_id).data.metrics
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in keys}


@dataclass
class ResumedTracker:
    """Forwards to `inner` only points past the last step its key holds; compares the others."""

    inner: Tracker
    logged: dict[str, dict[int, float]]
    last: dict[str, int] = field(init=False)
    skipped: int = 0
    compared: int = 0
    differing: int = 0
    max_abs_difference: float = 0.0

    def __post_init__(self) -> None:
        self.last = {key: max(steps) for key, steps in self.logged.items() if steps}

    def metric(self, key: str, value: float, step: int) -> None:
        if step > self.last.get(key, -1):
            self.inner.metric(key, value, step)
            return
        self._compare(key, value, step)

    def metrics(self, points: Sequence[Point]) -> None:
        # The new points go on in one call, each with its own timestamp (the loop's flush).
        new = [point for point in points if point.step > self.last.get(point.key, -1)]
        for point in points:
            if point.step <= self.last.get(point.key, -1):
                self._compare(point.key, point.value, point.step)
        if new:
            self.inner.metrics(new)

    def _compare(self, key: str, value: float, step: int) -> None:
        self.skipped += 1
        logged = self.logged[key].get(step)
        if logged is None or key.startswith(UNCOMPARED_PREFIXES):
            return
        self.compared += 1
        value = float(value)
        if value == logged or (value != value and logged != logged):  # NaN == NaN here
            return
        self.differing += 1
        self.max_abs_difference = max(self.max_abs_difference, abs(value - logged))

    def record(self, from_step: int) -> ResumeRecord:
        return ResumeRecord(
            from_step=from_step,
            last_logged_step=self.last.get("train/loss", 0),
            points_skipped=self.skipped,
            points_compared=self.compared,
            points_differing=self.differing,
            max_abs_difference=self.max_abs_difference,
        )
