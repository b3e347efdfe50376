"""MLflow delivery for one job: a run, its params and tags, batched metrics, artifacts.

Workers talk to the tracking server over HTTP only. One synchronous `log_metric`
against a local server costs ~56 ms here, so metrics are queued and sent by a
background thread with `log_batch` (at most 1000 per call); `close()` flushes and
raises if any point could not be delivered, so nothing is lost silently.
Library code uses `MlflowClient` with an explicit run id, never the fluent API.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100


class MetricDeliveryError(RuntimeError):
    """Metrics could not be delivered to the tracking server after retries."""


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
    """Queues metric points; a daemon thread sends them in batches through `send`.

    `send` receives up to `max_batch` points and raises on failure; a failed batch is
    retried with backoff for up to `retry_for_s` seconds before it is counted as lost.
    """

    def __init__(
        self,
        send: Callable[[list[Point]], None],
        *,
        max_batch: int = MAX_METRICS_PER_BATCH,
        interval_s: float = 1.0,
        retry_for_s: float = 60.0,
    ) -> None:
        self._send = send
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._retry_for_s = retry_for_s
        self._pending: list[Point] = []
        self._in_flight = 0
        self._lost = 0
        self._last_error: BaseException | None = None
        self._flush_requested = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def metric(self, key: str, value: float, step: int) -> None:
        point = Point(key, float(value), int(step), int(time.time() * 1000))
        with self._cond:
            if self._closing:
                raise RuntimeError("metric logged after close()")
            self._pending.append(point)
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def metrics(self, points: Sequence[Point]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("metrics logged after close()")
            self._pending.extend(points)
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def flush(self) -> None:
        """Block until every point logged so far has been sent (or counted as lost)."""
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._pending or self._in_flight:
                self._cond.wait()
            self._flush_requested = False

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self._lost:
            raise MetricDeliveryError(
                f"{self._lost} metric points could not be delivered to MLflow: {self._last_error}"
            )

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
                self._in_flight = len(batch)
            if batch:
                self._deliver(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()

    def _deliver(self, batch: list[Point]) -> None:
        if self._lost:
            # The server has already failed for a whole retry period: don't wait that long
            # again for every remaining batch. They are counted and close() reports them.
            try:
                self._send(batch)
            except Exception as exc:
                self._last_error = exc
                with self._cond:
                    self._lost += len(batch)
            return
        deadline = time.monotonic() + self._retry_for_s
        delay = 0.25
        while True:
            try:
                self._send(batch)
                return
            except Exception as exc:
                self._last_error = exc
                if time.monotonic() + delay > deadline:
                    with self._cond:
                        self._lost += len(batch)
                    return
                time.sleep(delay)
                delay = min(delay * 2, 8.0)


@dataclass(frozen=True)
class RunInfo:
    tracking_uri: str
    experiment_id: str
    run_id: str

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


def experiment_id_for(client: Any, name: str) -> str:
    """The id of experiment `name` (an `MlflowClient`), created or restored as needed and marked
    as a model-training experiment."""
    from mlflow.exceptions import MlflowException

    for _ in range(3):
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment.experiment_id)
            if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return str(experiment.experiment_id)
        try:
            return str(client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}))
        except MlflowException:
            continue  # another job created it between our two calls
    raise RuntimeError(f"could not create or find MLflow experiment {name!r}")


def experiment_chart_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs as charts (MLflow 3's runs tab, chart mode)."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?compareRunsMode=CHART"


def run_chart_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """One run's metric charts (its `model-metrics` tab)."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics"


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
    ) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        if resume_run_id:  # a resumed attempt: the job's run, back to RUNNING, its params kept
            run = self._existing_run(resume_run_id)
            self.info = RunInfo(tracking_uri, run.info.experiment_id, resume_run_id)
            self._client.update_run(resume_run_id, status="RUNNING")
            for key, value in tags.items():
                self._client.set_tag(resume_run_id, key, value)
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            experiment_id = self._experiment_id(experiment)
            run = self._client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
            self.info = RunInfo(tracking_uri, experiment_id, run.info.run_id)
        try:
            self._log_params(params)
        except BaseException:
            self._client.set_terminated(self.info.run_id, status="FAILED")  # never left RUNNING
            raise
        self.delivery = BatchedMetricLogger(self._send_metrics)

    @property
    def client(self) -> Any:
        return self._client

    def _existing_run(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException as exc:
            raise ValueError(f"--resume-run-id {run_id}: no such MLflow run ({exc.message})") from None

    def metric(self, key: str, value: float, step: int) -> None:
        self.delivery.metric(key, value, step)

    def metrics(self, points: Sequence[Point]) -> None:
        self.delivery.metrics(points)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """A file, or a folder (a checkpoint made of several files) under its own name."""
        if path.is_dir():
            target = f"{artifact_path}/{path.name}" if artifact_path else path.name
            self._client.log_artifacts(self.info.run_id, str(path), target)
        else:
            self._client.log_artifact(self.info.run_id, str(path), artifact_path)

    def log_json(self, name: str, data: Any) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(data, indent=2, sort_keys=True))
            self.log_artifact(path)

    def end(self, status: str) -> None:
        """Flush metrics, then mark the run FINISHED, FAILED or KILLED."""
        try:
            self.delivery.close()
        except BaseException:
            # The run lost points: MLflow must not call it FINISHED.
            self._client.set_terminated(self.info.run_id, status="FAILED")
            raise
        self._client.set_terminated(self.info.run_id, status=status)

    def _experiment_id(self, name: str) -> str:
        return experiment_id_for(self._client, name)

    def _log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.info.run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])

    def _send_metrics(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(p.key, p.value, p.timestamp_ms, p.step) for p in points]
        self._client.log_batch(self.info.run_id, metrics=metrics, synchronous=True)


class NullTracker:
    """Used when no tracking server is configured: metrics are dropped."""

    def metric(self, key: str, value: float, step: int) -> None:
        return None

    def metrics(self, points: Sequence[Point]) -> None:
        return None
