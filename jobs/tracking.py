"""MLflow delivery for one job: a run, its params and tags, batched metrics, artifacts.

Workers talk to the tracking server over HTTP only. One synchronous `log_metric`
against a local server costs ~56 ms here, so metrics are batched and sent with `log_batch` (at
most 1000 per call) by a delivery process of the run's own (jobs.metric_delivery: the training
interpreter only appends tuples and writes them to a pipe in bulk), or, where that process cannot
reach the server the way MLflow's client would, by a background thread of the job process
(`BatchedMetricLogger`, also the fallback if the process dies). `close()` flushes and raises if
any point could not be delivered, so nothing is lost silently.
Library code uses `MlflowClient` with an explicit run id, never the fluent API.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol
from urllib.parse import quote, unquote, urlencode, urlsplit, urlunsplit

from jobs.metric_delivery import (
    MAX_METRICS_PER_BATCH,
    RETRY_FOR_S,
    DeliveryProcess,
    DeliveryTarget,
    MetricDeliveryError,
    MetricSink,
    RetryingSender,
    Row,
    RunDeleted,
)

__all__ = ["MAX_METRICS_PER_BATCH", "MetricDeliveryError"]

MAX_PARAMS_PER_BATCH = 100
LOG_BATCH_ENDPOINT = "/api/2.0/mlflow/runs/log-batch"
# A 1000-point log-batch takes ~50 ms on a local server: a request still unanswered after this is
# retried rather than waited for as long as MLflow's default (MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s).
REQUEST_TIMEOUT_S = 30.0
# "process": the delivery process (the default); "thread": in the job process, as before.
DeliveryMode = Literal["process", "thread"]
DEFAULT_DELIVERY: DeliveryMode = "process"
# How long a batch is retried before its points are counted as lost (both ways of delivering).
METRIC_RETRY_FOR_S = RETRY_FOR_S
# Between two tries to start a job's run on a server that gave no answer (each try is MLflow's
# client's own, with its retries: up to about four minutes).
START_RETRY_EVERY_S = 5.0


class Point(NamedTuple):
    """One metric point; a tuple, because a job makes several per step and the loop hands them
    over in bulk."""

    key: str
    value: float
    step: int
    timestamp_ms: int


class Tracker(Protocol):
    def metric(self, key: str, value: float, step: int) -> None: ...

    def metrics(self, points: Sequence[Point]) -> None:
        """Many points at once, each with its own timestamp (the loop's flush)."""
        ...


class BatchedMetricLogger:
    """Queues metric points; a daemon thread of this process sends them in batches through `send`.

    `send` receives up to `max_batch` points and raises on failure; a failed batch is
    retried with backoff for up to `retry_for_s` seconds before it is counted as lost.
    The delivery process's fallback, and the delivery where that process cannot be used.
    """

    def __init__(
        self,
        send: Callable[[list[Row]], None],
        *,
        max_batch: int = MAX_METRICS_PER_BATCH,
        interval_s: float = 1.0,
        retry_for_s: float = RETRY_FOR_S,
    ) -> None:
        self._sender = RetryingSender(send, retry_for_s)
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._pending: list[Row] = []  # Points, or the delivery process's plain tuples
        self._queued = 0  # points ever queued
        self._sent = 0  # of those, the first `_sent` are delivered (or counted lost): FIFO
        self._flush_requested = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def metric(self, key: str, value: float, step: int) -> None:
        point = Point(key, float(value), int(step), int(time.time() * 1000))
        self._stop_if_run_deleted()
        with self._cond:
            if self._closing:
                raise RuntimeError("metric logged after close()")
            self._pending.append(point)
            self._queued += 1
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def metrics(self, points: Sequence[Row]) -> None:
        self._stop_if_run_deleted()
        with self._cond:
            if self._closing:
                raise RuntimeError("metrics logged after close()")
            self._pending.extend(points)
            self._queued += len(points)
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def flush(self) -> None:
        """Block until every point logged before this call has been sent (or counted as lost); points
        another thread logs meanwhile are not waited for (a checkpoint's publication flushes while
        the training thread logs on)."""
        with self._cond:
            mark = self._queued
            while self._sent < mark:
                self._flush_requested = True
                self._cond.notify_all()
                self._cond.wait()
            self._flush_requested = False
        self._stop_if_run_deleted()

    def close(self) -> None:
        with contextlib.suppress(RunDeleted):  # raised below, once the thread has ended
            self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._stop_if_run_deleted()
        if self._sender.lost:
            raise MetricDeliveryError(self._sender.lost, self._sender.last_error)

    def _stop_if_run_deleted(self) -> None:
        """Stop the job at its next metric once MLflow said its run was deleted (RunDeleted)."""
        if self._sender.run_deleted:
            raise RunDeleted(self._sender.lost, self._sender.run_deleted)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closing
                        or len(self._pending) >= self._max_batch
                        or (self._flush_requested and bool(self._pending))
                    ),
                    timeout=self._interval_s,
                )
                if self._closing and not self._pending:
                    return
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
            if batch:
                self._sender.deliver(batch)
            with self._cond:
                self._sent += len(batch)
                self._cond.notify_all()


@dataclass(frozen=True)
class RunInfo:
    tracking_uri: str
    experiment_id: str
    run_id: str

    @property
    def server(self) -> str:
        return tracking_server(self.tracking_uri)

    @property
    def run_url(self) -> str:
        """The run's metric charts in the MLflow UI."""
        return run_chart_url(self.tracking_uri, self.experiment_id, self.run_id)

    def to_json(self) -> dict[str, str]:
        return {
            "tracking_uri": self.tracking_uri,
            "experiment_id": self.experiment_id,
            "run_id": self.run_id,
            "run_url": self.run_url,
        }


# MLflow 3's UI opens an experiment on its GenAI overview unless it is marked as model training.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def experiment_id_for(client: Any, name: str, *, warnings: list[str] | None = None) -> str:
    """The id of experiment `name` (an `MlflowClient`), created or restored as needed and marked
    as a model-training experiment. A deleted one is restored (MLflow keeps a deleted experiment's
    name: none of that name can be created), which `warnings` is told, with what to do instead."""
    from mlflow.exceptions import MlflowException

    for _ in range(3):
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment.experiment_id)
                if warnings is not None:
                    warnings.append(restored_experiment_warning(name, experiment.experiment_id))
            if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return str(experiment.experiment_id)
        try:
            return str(client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}))
        except MlflowException:
            continue  # another job created it between our two calls
    raise RuntimeError(f"could not create or find MLflow experiment {name!r}")


def restored_experiment_warning(name: str, experiment_id: str) -> str:
    return (
        f"MLflow experiment {name!r} (id {experiment_id}) had been deleted: it was restored to take this "
        "run, and the runs it held before are shown again (MLflow keeps a deleted experiment's name, so "
        "none of that name can be created). To start afresh, give the job another `experiment`, or "
        "remove the deleted one for good first (`mlflow gc` on the tracking server)"
    )


def tracking_server(tracking_uri: str) -> str:
    """The tracking server as a message names it: scheme, host and port, never a credential."""
    parts = urlsplit(tracking_uri)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], "", "", "")) or tracking_uri


# The runs page's own "Run Name" sort (its sort menu then names it).
RUN_NAME_ORDER = "tags.`mlflow.runName`"


def experiment_chart_url(tracking_uri: str, experiment_id: str, *, search_filter: str | None = None) -> str:
    """The experiment's runs as charts (MLflow 3's runs tab, chart mode); with `search_filter` (MLflow's
    search syntax), only the runs it matches, listed flat by name."""
    query = {"compareRunsMode": "CHART"}
    if search_filter:
        # The runs page nests child runs under their parent, collapsed (their curves hidden until
        # expanded by hand), while it sorts by creation time, its default; sorted otherwise, it lists
        # the runs that match flat. No URL parameter expands a parent (runsExpanded is view state).
        query |= {"searchFilter": search_filter, "orderByKey": RUN_NAME_ORDER, "orderByAsc": "true"}
    runs = f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs"
    return f"{runs}?{urlencode(query, quote_via=quote)}"


def run_chart_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """One run's metric charts (its `model-metrics` tab)."""
    return f"{run_overview_url(tracking_uri, experiment_id, run_id)}/model-metrics"


def run_overview_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """One run's overview: status, params, tags, child runs, metrics as values; artifacts a tab away."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


# Tagged on a job's run as it ends: MLflow's status alone reads FAILED for a job that diverged.
OUTCOME_TAG = "outcome"
# What an MLflow status tells on its own; FAILED may be a failure or a divergence, which only the
# caller knows (`outcome=`): from the status alone it is not tagged rather than tagged wrong.
OUTCOME_OF_STATUS = {"FINISHED": "succeeded", "KILLED": "cancelled"}


def end_run(client: Any, run_id: str, status: str, *, outcome: str | None = None) -> None:
    """Tag the run's `outcome` (the job's status: succeeded, failed, diverged, cancelled; by default
    what `status` tells), then end it as `status` (FINISHED, FAILED or KILLED), even if tagging fails."""
    outcome = outcome or OUTCOME_OF_STATUS.get(status)
    try:
        if outcome:  # first: a run seen ended has its outcome
            client.set_tag(run_id, OUTCOME_TAG, outcome)
    finally:
        client.set_terminated(run_id, status=status)


class RunStartCut(Exception):
    """The job's run was made, then the server gave no answer: `start_run` tries again on this run."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"the MLflow server gave no answer once run {run_id} was made")
        self.run_id = run_id


class TrackingUnreachable(RuntimeError):
    """The tracking server gave no answer while the job's run was started (or resumed): the job did
    not run, and runs again (jobs.result.TRACKING_UNREACHABLE)."""


def unanswered(exc: BaseException) -> bool:
    """Whether `exc` says the tracking server gave no answer (refused, reset, timed out, or 5xx until
    the client's retries ran out), not an answer refusing the request (MLflow's RestException, or
    requests' HTTPError with a 4xx response, as its artifact client raises). MLflow's client wraps
    requests' error in a plain MlflowException, the original as its context."""
    import requests
    from mlflow.exceptions import RestException

    # The setup's own errors, which no wait mends (a certificate, an address): said at once.
    setup = (
        requests.exceptions.SSLError,
        requests.exceptions.InvalidURL,
        requests.exceptions.InvalidHeader,
        requests.exceptions.MissingSchema,
        requests.exceptions.InvalidSchema,
    )
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (RestException, *setup)) or _refusal(seen):
            return False
        if isinstance(seen, requests.exceptions.RequestException | ConnectionError | TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _refusal(exc: BaseException) -> bool:
    import requests

    response = getattr(exc, "response", None)
    return isinstance(exc, requests.HTTPError) and response is not None and response.status_code < 500


def start_run(tracking_uri: str, *, retry_for_s: float | None = None, **run: Any) -> MlflowRun:
    """The job's `MlflowRun` (`run`: its arguments), tried again while the server gives no answer, for
    as long as a metric point is (a server restarted or stalled for less costs the job nothing); then
    TrackingUnreachable. An answer that refuses (a run that does not exist) is raised at once."""
    retry_for_s = METRIC_RETRY_FOR_S if retry_for_s is None else retry_for_s
    give_up_at = time.monotonic() + retry_for_s
    while True:
        try:
            return MlflowRun(tracking_uri, **run)
        except Exception as exc:
            if not unanswered(exc):
                raise
            if isinstance(exc, RunStartCut):  # made before the silence: resumed, not made twice
                run = {**run, "resume_run_id": exc.run_id}
            if time.monotonic() >= give_up_at:
                raise TrackingUnreachable(
                    f"the MLflow server at {tracking_server(tracking_uri)} gave no answer for "
                    f"{retry_for_s:g} s while the job's run was started: {exc}"
                ) from exc
            time.sleep(START_RETRY_EVERY_S)


class MlflowRun:
    """One MLflow run per job, on a tracking server reached over HTTP."""

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str,
        run_name: str,
        params: Mapping[str, str],
        tags: Mapping[str, str],
        resume_run_id: str | None = None,
        delivery: DeliveryMode | None = None,
    ) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.warnings: list[str] = []  # what starting the run did that the job's result should say
        if resume_run_id:  # a resumed attempt: the job's run, back to RUNNING, its params kept
            run = self._existing_run(resume_run_id)
            self.info = RunInfo(tracking_uri, run.info.experiment_id, resume_run_id)
            self._client.update_run(resume_run_id, status="RUNNING")
            if OUTCOME_TAG in run.data.tags:  # the attempt before's, stale while this one runs
                self._client.delete_tag(resume_run_id, OUTCOME_TAG)
            for key, value in tags.items():
                self._client.set_tag(resume_run_id, key, value)
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            experiment_id = self._experiment_id(experiment)
            run = self._client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
            self.info = RunInfo(tracking_uri, experiment_id, run.info.run_id)
        try:
            self._log_params(params)
        except BaseException as exc:
            if isinstance(exc, Exception) and unanswered(exc):  # a try again resumes it: no second run
                raise RunStartCut(self.info.run_id) from exc
            end_run(self._client, self.info.run_id, "FAILED", outcome="failed")  # never left RUNNING
            raise
        self.delivery = self._start_delivery(delivery or DEFAULT_DELIVERY)

    def _start_delivery(self, mode: DeliveryMode) -> MetricSink:
        """The delivery process (started now: it gets ready while the job builds its model), or the
        in-process thread where the process could not reach the server as MLflow's client would."""
        if mode == "thread":
            return self._in_process_delivery()
        target = delivery_target(self.info.tracking_uri, self.info.run_id)
        if isinstance(target, str):
            _warn(f"metrics are delivered from the job process (slower): {target}")
            return self._in_process_delivery()
        return DeliveryProcess(target, fallback=self._in_process_delivery)

    def _in_process_delivery(self) -> BatchedMetricLogger:
        return BatchedMetricLogger(self._send_metrics, retry_for_s=METRIC_RETRY_FOR_S)

    @property
    def client(self) -> Any:
        return self._client

    def _existing_run(self, run_id: str) -> Any:
        from mlflow.exceptions import RestException

        try:
            return self._client.get_run(run_id)
        except RestException as exc:  # the server answered; an unanswered request is no answer
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise ValueError(f"--resume-run-id {run_id}: no such MLflow run ({exc.message})") from None
            raise

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags learnt once the job started (where its optimizer's class came from)."""
        from mlflow.entities import RunTag

        self._client.log_batch(self.info.run_id, tags=[RunTag(key, value) for key, value in tags.items()])

    def metric(self, key: str, value: float, step: int) -> None:
        self.delivery.metric(key, value, step)

    def metrics(self, points: Sequence[Point]) -> None:
        self.delivery.metrics(points)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A file, or a folder (a checkpoint made of several files) under its own name. Where the
        server's artifact root is a folder the client writes itself, an OSError names that store."""
        try:
            if path.is_dir():
                target = f"{artifact_path}/{path.name}" if artifact_path else path.name
                self._client.log_artifacts(self.info.run_id, str(path), target)
            else:
                self._client.log_artifact(self.info.run_id, str(path), artifact_path)
        except OSError as exc:
            store = self._artifact_folder() if exc.errno is not None else None
            # As it is: a request that failed (requests' errors are OSErrors too), or a file of the job's
            # own it could not read (the checkpoint gone: its own error names it).
            if store is None or str(exc.filename or "").startswith(str(path)):
                raise
            # It had read as a bare "[Errno 1] Operation not permitted: '/srv/mlartifacts/4/…'".
            raise OSError(
                exc.errno,
                f"could not store {path.name} in the MLflow run's artifact store, the folder {store}, "
                f"which this process writes itself (the server's artifact root is a folder, not served): "
                f"{exc.strerror or exc}. Make that folder writable from this host, start the server with "
                "--serve-artifacts, or set OPTLAB_CHECKPOINT_DIR to keep checkpoints in a shared folder",
            ) from exc

    def _artifact_folder(self) -> str | None:
        """The run's artifact store where it is a folder this process writes itself, else None."""
        try:
            uri = self._client.get_run(self.info.run_id).info.artifact_uri
        except Exception:  # the server gone too: nothing more to say than the error itself
            return None
        scheme, _, rest = uri.partition(":")
        if scheme == "file":
            return rest.removeprefix("//")
        return uri if uri.startswith("/") else None

    def log_json(self, name: str, data: Any) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(data, indent=2, sort_keys=True))
            self.log_artifact(path)

    def end(self, status: str, *, outcome: str | None = None) -> None:
        """Flush metrics, then tag the job's `outcome` (see `end_run`) and mark the run FINISHED, FAILED
        or KILLED."""
        try:
            self.delivery.close()
        except RunDeleted:  # MLflow refuses to end or tag a deleted run: the job's error says why
            raise
        except BaseException:
            # The run lost points: MLflow must not call it FINISHED, and the job fails for it.
            end_run(self._client, self.info.run_id, "FAILED", outcome="failed")
            raise
        end_run(self._client, self.info.run_id, status, outcome=outcome)

    def _experiment_id(self, name: str) -> str:
        return experiment_id_for(self._client, name, warnings=self.warnings)

    def _log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.info.run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])

    def _send_metrics(self, points: Sequence[Row]) -> None:
        from mlflow.entities import Metric

        # Unpacked, not by name: the delivery process hands its rows over as plain tuples.
        metrics = [Metric(key, value, stamp, step) for key, value, step, stamp in points]
        self._client.log_batch(self.info.run_id, metrics=metrics, synchronous=True)


def delivery_target(tracking_uri: str, run_id: str) -> DeliveryTarget | str:
    """How MLflow's own client would send `log-batch` to `tracking_uri` (its credentials, TLS settings
    and headers, from MLflow's environment variables and credentials file), for the delivery
    process; or why that process cannot do it (then the job process delivers, as before)."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return f"the tracking URI is not http(s) ({parts.scheme or 'a path'})"
    try:  # MLflow's own resolution; modules that a later MLflow may move
        from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT
        from mlflow.tracking.request_header.registry import resolve_request_headers
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.workspace_context import get_request_workspace
        from mlflow.utils.workspace_utils import WORKSPACE_HEADER_NAME
    except ImportError as exc:
        return f"this MLflow does not say how it authenticates ({exc})"
    host = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    creds = get_default_host_creds(host)
    if creds.aws_sigv4 or creds.auth or getattr(creds, "use_databricks_sdk", False) or creds.client_secret:
        return "MLflow signs this server's requests itself (MLFLOW_TRACKING_AUTH, SigV4 or Databricks)"
    headers = {str(k): str(v) for k, v in resolve_request_headers().items()}
    if workspace := get_request_workspace():
        headers[WORKSPACE_HEADER_NAME] = workspace
    username = creds.username or (unquote(parts.username) if parts.username else None)
    password = creds.password or (unquote(parts.password) if parts.password else None)
    if username and password:
        import base64

        basic = base64.standard_b64encode(f"{username}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {basic}"
    elif creds.token:
        headers["Authorization"] = f"Bearer {creds.token}"
    return DeliveryTarget(
        url=host.rstrip("/") + LOG_BATCH_ENDPOINT,
        run_id=run_id,
        headers=headers,
        verify=creds.verify,
        client_cert=creds.client_cert_path,
        timeout_s=min(float(MLFLOW_HTTP_REQUEST_TIMEOUT.get()), REQUEST_TIMEOUT_S),
        retry_for_s=METRIC_RETRY_FOR_S,
    )


def _warn(message: str) -> None:
    print(f"optlab: warning: {message}", file=sys.stderr, flush=True)


class NullTracker:
    """Used when no tracking server is configured: metrics are dropped."""

    def metric(self, key: str, value: float, step: int) -> None:
        return None

    def metrics(self, points: Sequence[Point]) -> None:
        return None
