"""BatchedMetricLogger delivery semantics (the in-process delivery and the delivery process's fallback),
with a fake `send` in place of MLflow's log_batch; MlflowRun against a stand-in for MlflowClient."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jobs import tracking
from jobs.tracking import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    BatchedMetricLogger,
    MetricDeliveryError,
    MlflowRun,
    Point,
    RunInfo,
    experiment_chart_url,
    run_chart_url,
    run_overview_url,
)

WAIT_S = 30  # a safety net against hangs; never reached when the code is right


class FakeSend:
    """Records each batch it accepts; can fail, be slow, or hold a batch until released."""

    def __init__(self, *, failures: int = 0, always_fail: bool = False, delay_s: float = 0.0) -> None:
        self.failures = failures
        self.always_fail = always_fail
        self.delay_s = delay_s
        self.calls = 0
        self.batches: list[list[Point]] = []
        self.entered = threading.Event()
        self.released = threading.Event()
        self.released.set()

    def __call__(self, batch: list[Point]) -> None:
        self.calls += 1
        self.entered.set()
        assert self.released.wait(WAIT_S)
        if self.always_fail or self.calls <= self.failures:
            raise ConnectionError("tracking server unavailable")
        time.sleep(self.delay_s)
        self.batches.append(list(batch))

    @property
    def steps(self) -> list[int]:
        return [point.step for batch in self.batches for point in batch]


def log(logger: BatchedMetricLogger, steps: range) -> None:
    for step in steps:
        logger.metric("train/loss", 1.0 / (step + 1), step)


def test_every_point_arrives_once_in_order_after_close() -> None:
    send = FakeSend()
    logger = BatchedMetricLogger(send)
    log(logger, range(10))
    logger.close()
    assert send.steps == list(range(10))
    point = send.batches[0][3]
    assert (point.key, point.value, point.step) == ("train/loss", 0.25, 3)


def test_no_batch_exceeds_the_mlflow_limit() -> None:
    send = FakeSend()
    logger = BatchedMetricLogger(send)
    log(logger, range(2500))
    logger.close()
    assert send.steps == list(range(2500))
    assert max(len(batch) for batch in send.batches) <= MAX_METRICS_PER_BATCH
    assert len(send.batches) >= 3


def test_points_go_out_after_the_interval_without_a_flush() -> None:
    send = FakeSend()
    logger = BatchedMetricLogger(send, interval_s=0.05)
    log(logger, range(3))
    assert send.entered.wait(WAIT_S)
    logger.close()
    assert send.steps == [0, 1, 2]


def held_flush(send: FakeSend) -> tuple[BatchedMetricLogger, threading.Thread]:
    """A logger with 5 points, flushing on a thread of its own while `send` holds their batch."""
    send.released.clear()
    logger = BatchedMetricLogger(send)
    log(logger, range(5))
    flusher = threading.Thread(target=logger.flush)
    flusher.start()
    assert send.entered.wait(WAIT_S)
    return logger, flusher


def test_flush_blocks_until_delivered() -> None:
    send = FakeSend()
    logger, flusher = held_flush(send)
    flusher.join(timeout=0.2)
    assert flusher.is_alive(), "flush() returned while the batch was still being sent"
    send.released.set()
    flusher.join(WAIT_S)
    assert not flusher.is_alive()
    assert send.steps == list(range(5))
    logger.close()


def test_flush_waits_only_for_points_logged_before_it() -> None:
    """Another thread logging on (the training, while a checkpoint is published) does not keep it
    waiting: it returns once its own points are sent, with later ones still on their way."""
    send = FakeSend(delay_s=0.2)
    logger, flusher = held_flush(send)
    log(logger, range(5, 5005))  # five more full batches, 0.2 s each
    send.released.set()
    flusher.join(WAIT_S)
    assert not flusher.is_alive()
    assert send.steps[:5] == list(range(5))
    assert len(send.steps) < 5005, "flush() waited for points logged after it was called"
    logger.close()
    assert send.steps == list(range(5005))


def test_a_send_that_fails_twice_then_succeeds_loses_nothing() -> None:
    send = FakeSend(failures=2)
    logger = BatchedMetricLogger(send)
    log(logger, range(20))
    logger.close()
    assert send.calls == 3
    assert send.steps == list(range(20))


def test_points_that_cannot_be_delivered_make_close_raise() -> None:
    logger = BatchedMetricLogger(FakeSend(always_fail=True), retry_for_s=0.1)
    log(logger, range(7))
    with pytest.raises(MetricDeliveryError, match=r"^7 metric points .*tracking server unavailable"):
        logger.close()


def test_metric_after_close_raises() -> None:
    logger = BatchedMetricLogger(FakeSend())
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.metric("train/loss", 1.0, 0)


def test_the_caller_never_waits_for_the_network() -> None:
    """10,000 points against a slow server (50 ms a call): metric() returns while a send is stuck."""
    send = FakeSend(delay_s=0.05)
    send.released.clear()
    logger = BatchedMetricLogger(send)
    log(logger, range(MAX_METRICS_PER_BATCH))  # a full batch: the sender thread takes it
    assert send.entered.wait(WAIT_S)
    log(logger, range(MAX_METRICS_PER_BATCH, 10_000))
    # Every metric() call above returned while the first batch was still held at the server.
    assert send.batches == []
    send.released.set()
    logger.close()
    assert send.steps == list(range(10_000))
    assert max(len(batch) for batch in send.batches) <= MAX_METRICS_PER_BATCH


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "http://127.0.0.1:5000/"])
def test_run_url_points_at_the_run_in_the_ui(uri: str) -> None:
    info = RunInfo(uri, "3", "abc123")
    assert info.run_url == "http://127.0.0.1:5000/#/experiments/3/runs/abc123/model-metrics"
    assert info.to_json() == {
        "tracking_uri": uri,
        "experiment_id": "3",
        "run_id": "abc123",
        "run_url": info.run_url,
    }


# -- MlflowRun, against a stand-in for MlflowClient ----------------------------------------------------


class FakeMlflowClient:
    """Records what MlflowRun asks of the tracking server."""

    def __init__(self) -> None:
        self.experiments: dict[str, SimpleNamespace] = {}
        self.runs: list[dict[str, Any]] = []
        self.param_batches: list[list[Any]] = []
        self.metric_batches: list[list[Any]] = []
        self.terminated: list[tuple[str, str]] = []
        self.tags: dict[str, dict[str, str]] = {}  # run id -> tags set or deleted after its creation
        self.events: list[str] = []  # tagging and ending, in order
        self.server_down = False
        self.params_refused = False
        self.artifact_uri = "mlflow-artifacts:/1/run-1/artifacts"
        self.artifact_error: OSError | None = None

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        if self.artifact_error is not None:
            raise self.artifact_error

    def get_experiment_by_name(self, name: str) -> SimpleNamespace | None:
        return self.experiments.get(name)

    def create_experiment(self, name: str, tags: dict[str, str] | None = None) -> str:
        experiment_id = str(len(self.experiments) + 1)
        self.experiments[name] = SimpleNamespace(
            experiment_id=experiment_id, lifecycle_stage="active", tags=dict(tags or {})
        )
        return experiment_id

    def restore_experiment(self, experiment_id: str) -> None:
        for experiment in self.experiments.values():
            if experiment.experiment_id == experiment_id:
                experiment.lifecycle_stage = "active"

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        for experiment in self.experiments.values():
            if experiment.experiment_id == experiment_id:
                experiment.tags[key] = value

    def create_run(self, experiment_id: str, *, run_name: str, tags: dict[str, str]) -> SimpleNamespace:
        self.runs.append({"experiment_id": experiment_id, "run_name": run_name, "tags": tags})
        return SimpleNamespace(info=SimpleNamespace(run_id=f"run-{len(self.runs)}"))

    def log_batch(
        self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (), synchronous: bool = True
    ) -> None:
        for tag in tags:
            self.tags.setdefault(run_id, {})[tag.key] = tag.value
        if params and self.params_refused:
            raise ValueError("param value too long")
        if params:
            self.param_batches.append(list(params))
        if metrics:
            if self.server_down:
                raise ConnectionError("tracking server unavailable")
            self.metric_batches.append(list(metrics))

    def set_terminated(self, run_id: str, status: str) -> None:
        self.terminated.append((run_id, status))
        self.events.append(f"end {status}")

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags.setdefault(run_id, {})[key] = value
        self.events.append(f"tag {key}={value}")

    def delete_tag(self, run_id: str, key: str) -> None:
        del self.tags[run_id][key]

    def get_run(self, run_id: str) -> SimpleNamespace:
        return SimpleNamespace(
            info=SimpleNamespace(experiment_id="1", artifact_uri=self.artifact_uri),
            data=SimpleNamespace(params={}, tags=self.tags.get(run_id, {})),
        )

    def update_run(self, run_id: str, status: str) -> None:
        self.events.append(f"update {status}")


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> FakeMlflowClient:
    import mlflow

    fake = FakeMlflowClient()
    monkeypatch.setattr(mlflow, "MlflowClient", lambda tracking_uri: fake)
    # The stand-in answers in this process: no delivery process (tests/jobs/test_metric_delivery.py
    # covers it against a real server). Give up on an unreachable server after a moment, not a minute.
    monkeypatch.setattr(tracking, "DEFAULT_DELIVERY", "thread")
    monkeypatch.setattr(tracking, "METRIC_RETRY_FOR_S", 0.1)
    return fake


def start_run(experiment: str = "demo", params: int = 3) -> MlflowRun:
    return MlflowRun(
        "http://mlflow.test:5000",
        experiment=experiment,
        run_name="adam lr=0.001 digits_mlp seed=0",
        params={f"p{i}": str(i) for i in range(params)},
        tags={"job_id": "7"},
    )


def test_a_run_records_params_metrics_and_its_end(client: FakeMlflowClient) -> None:
    run = start_run(params=2 * MAX_PARAMS_PER_BATCH + 1)
    assert run.info.run_url == "http://mlflow.test:5000/#/experiments/1/runs/run-1/model-metrics"
    assert client.experiments["demo"].tags == {"mlflow.experimentKind": "custom_model_development"}
    assert client.runs == [
        {"experiment_id": "1", "run_name": "adam lr=0.001 digits_mlp seed=0", "tags": {"job_id": "7"}}
    ]
    assert [len(batch) for batch in client.param_batches] == [100, 100, 1]
    run.metric("train/loss", 0.5, 3)
    run.end("FINISHED")
    ((metric,),) = client.metric_batches
    assert (metric.key, metric.value, metric.step) == ("train/loss", 0.5, 3)
    assert client.terminated == [("run-1", "FINISHED")]
    assert client.events == ["tag outcome=succeeded", "end FINISHED"]  # tagged before it reads ended


def test_runs_share_an_existing_experiment(client: FakeMlflowClient) -> None:
    client.experiments["demo"] = SimpleNamespace(experiment_id="1", lifecycle_stage="active", tags={})
    first, second = start_run(), start_run()
    # An experiment made before the tag existed is marked as model training too.
    assert client.experiments["demo"].tags == {"mlflow.experimentKind": "custom_model_development"}
    assert first.info.experiment_id == second.info.experiment_id == "1"
    for run in (first, second):
        run.end("FINISHED")


def test_a_deleted_experiment_restored_for_a_run_is_said_in_its_warnings(client: FakeMlflowClient) -> None:
    """MLflow keeps a deleted experiment's name, so the job's run restores it, and every run it held
    before showed again in the UI without a word; the job's result says so now, and what to do."""
    client.experiments["demo"] = SimpleNamespace(experiment_id="4", lifecycle_stage="deleted", tags={})
    run, again = start_run(), start_run()
    assert client.experiments["demo"].lifecycle_stage == "active"
    (said,) = run.warnings
    assert said.startswith(
        "MLflow experiment 'demo' (id 4) had been deleted: it was restored to take this run"
    )
    assert "give the job another `experiment`" in said
    assert again.warnings == []  # active again: nothing to say
    for started in (run, again):
        started.end("FINISHED")


def test_lost_metrics_end_the_mlflow_run_as_failed(client: FakeMlflowClient) -> None:
    run = start_run()
    client.server_down = True
    run.metric("train/loss", 0.5, 0)
    with pytest.raises(MetricDeliveryError, match="1 metric points"):
        run.end("FINISHED")
    assert client.terminated == [("run-1", "FAILED")]
    assert client.tags["run-1"] == {"outcome": "failed"}


def test_a_run_whose_params_are_refused_ends_failed(client: FakeMlflowClient) -> None:
    client.params_refused = True
    with pytest.raises(ValueError, match="too long"):
        start_run()
    assert client.terminated == [("run-1", "FAILED")] and client.tags["run-1"] == {"outcome": "failed"}


@pytest.mark.parametrize(
    ("status", "outcome", "tagged"),
    [
        ("FINISHED", None, "succeeded"),
        ("KILLED", None, "cancelled"),
        ("FAILED", "failed", "failed"),
        ("FAILED", "diverged", "diverged"),
    ],
)
def test_a_run_is_tagged_with_its_jobs_outcome(
    client: FakeMlflowClient, status: str, outcome: str | None, tagged: str
) -> None:
    """MLflow ends a diverged job and a failed one both FAILED: the `outcome` tag tells them apart."""
    run = start_run()
    run.end(status, outcome=outcome)
    assert client.tags["run-1"] == {"outcome": tagged}
    assert client.terminated == [("run-1", status)]


def test_failed_alone_is_not_tagged_as_a_failure(client: FakeMlflowClient) -> None:
    """FAILED from the status alone may be a divergence: better no outcome than a wrong one."""
    run = start_run()
    run.end("FAILED")
    assert "run-1" not in client.tags and client.terminated == [("run-1", "FAILED")]


def test_a_run_whose_tagging_fails_still_ends(
    client: FakeMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(run_id: str, key: str, value: str) -> None:
        raise ConnectionError("tracking server unavailable")

    run = start_run()
    monkeypatch.setattr(client, "set_tag", refuse)
    with pytest.raises(ConnectionError):
        run.end("FINISHED")
    assert client.terminated == [("run-1", "FINISHED")]


def test_a_resumed_run_drops_the_outcome_of_the_attempt_before(client: FakeMlflowClient) -> None:
    """An attempt stopped by its worker's shutdown ended KILLED, `cancelled`; the next one resumes it."""
    client.tags["run-9"] = {"outcome": "cancelled", "job_id": "7"}
    run = MlflowRun(
        "http://mlflow.test:5000",
        experiment="demo",
        run_name="adam",
        params={},
        tags={"attempt": "2"},
        resume_run_id="run-9",
    )
    assert client.tags["run-9"] == {"job_id": "7", "attempt": "2"}
    run.end("FINISHED")
    assert client.tags["run-9"]["outcome"] == "succeeded"


def test_the_chart_link_filters_runs_and_lists_them_flat() -> None:
    """Filtered, the runs are sorted by name: sorted by creation time (the UI's default) it nests
    children under their parent, collapsed, and their curves do not show."""
    assert (
        experiment_chart_url("http://h:5000/", "3")
        == "http://h:5000/#/experiments/3/runs?compareRunsMode=CHART"
    )
    assert experiment_chart_url("http://h:5000", "3", search_filter="tags.study_id = '7'") == (
        "http://h:5000/#/experiments/3/runs?compareRunsMode=CHART"
        "&searchFilter=tags.study_id%20%3D%20%277%27&orderByKey=tags.%60mlflow.runName%60&orderByAsc=true"
    )


def test_a_runs_overview_and_its_charts() -> None:
    assert run_overview_url("http://h:5000/", "3", "ab") == "http://h:5000/#/experiments/3/runs/ab"
    assert run_chart_url("http://h:5000/", "3", "ab") == "http://h:5000/#/experiments/3/runs/ab/model-metrics"


def unanswered_error() -> Exception:
    """What MLflow's client raises when the server gives no answer: its own exception, requests' error
    as its context (rest_utils.http_request)."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        raise requests.exceptions.ConnectionError("Max retries exceeded (Connection refused)")
    except requests.exceptions.ConnectionError as refused:
        try:
            raise MlflowException(f"API request to http://mlflow.test:5000 failed with exception {refused}")
        except MlflowException as wrapped:
            return wrapped


RUN = {"experiment": "demo", "run_name": "r", "params": {}, "tags": {"job_id": "7"}}


def test_a_run_is_started_once_the_server_answers(
    client: FakeMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that started while MLflow was down for longer than the client's own retries (about four
    minutes) failed for good; a run resumed so was told "no such MLflow run"."""
    monkeypatch.setattr(tracking, "START_RETRY_EVERY_S", 0.0)
    down = [unanswered_error(), unanswered_error()]
    answer = client.get_experiment_by_name

    def after_an_outage(name: str) -> Any:
        if down:
            raise down.pop()
        return answer(name)

    monkeypatch.setattr(client, "get_experiment_by_name", after_an_outage)
    run = tracking.start_run("http://mlflow.test:5000", retry_for_s=60, **RUN)
    assert run.info.run_id == "run-1" and not down and len(client.runs) == 1


def test_a_server_silent_for_the_whole_retry_is_told_apart_from_a_missing_run(
    client: FakeMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.exceptions import RestException

    from jobs.result import TRACKING_UNREACHABLE

    def silent(run_id: str) -> Any:
        raise unanswered_error()

    monkeypatch.setattr(client, "get_run", silent)
    with pytest.raises(tracking.TrackingUnreachable) as raised:
        tracking.start_run("http://mlflow.test:5000", retry_for_s=0, resume_run_id="r-1", **RUN)
    assert str(raised.value).startswith("the MLflow server at http://mlflow.test:5000 gave no answer for 0 s")
    assert "no such MLflow run" not in str(raised.value)
    assert type(raised.value).__name__ == TRACKING_UNREACHABLE  # the type the worker retries

    def missing(run_id: str) -> Any:
        raise RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"Run '{run_id}' not found"})

    monkeypatch.setattr(client, "get_run", missing)
    with pytest.raises(ValueError, match="--resume-run-id r-1: no such MLflow run"):
        tracking.start_run("http://mlflow.test:5000", retry_for_s=60, resume_run_id="r-1", **RUN)


def test_a_run_made_before_the_server_went_silent_is_resumed_not_made_twice(
    client: FakeMlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made, then its params got no answer: a second try had made a second run, the first left open."""
    monkeypatch.setattr(tracking, "START_RETRY_EVERY_S", 0.0)
    down = [unanswered_error()]
    log_batch = client.log_batch

    def silent_once(run_id: str, metrics: Any = (), params: Any = (), synchronous: bool = True) -> None:
        if params and down:
            raise down.pop()
        log_batch(run_id, metrics=metrics, params=params, synchronous=synchronous)

    monkeypatch.setattr(client, "log_batch", silent_once)
    run = tracking.start_run("http://mlflow.test:5000", retry_for_s=60, **{**RUN, "params": {"p": "1"}})
    assert run.info.run_id == "run-1" and len(client.runs) == 1 and client.terminated == []
    assert client.param_batches[-1][0].key == "p"


def test_a_setup_error_is_said_at_once_not_waited_through() -> None:
    """A bad certificate is no outage: it had been tried for ten minutes, then retried as one."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        raise requests.exceptions.SSLError("certificate verify failed")
    except requests.exceptions.SSLError as bad:
        try:
            raise MlflowException(f"API request failed with exception {bad}")
        except MlflowException as wrapped:
            assert not tracking.unanswered(wrapped)
    assert tracking.unanswered(unanswered_error())


def test_a_4xx_from_the_artifact_client_is_an_answer_refusing_not_an_outage() -> None:
    """MLflow's artifact client raises requests' HTTPError (a RequestException) for a server's 403."""
    import requests

    refusal, failure = requests.Response(), requests.Response()
    refusal.status_code, failure.status_code = 403, 503
    assert not tracking.unanswered(requests.HTTPError("403 Client Error", response=refusal))
    assert tracking.unanswered(requests.HTTPError("503 Server Error", response=failure))


def test_an_artifact_store_this_process_cannot_write_is_named_with_the_fix(
    client: FakeMlflowClient, tmp_path: Path
) -> None:
    """A server whose artifact root is a folder has its clients write there themselves: one they could
    not write had read as a bare "[Errno 1] Operation not permitted: '/srv/mlartifacts/4/…'"."""
    run = start_run()
    client.artifact_uri = "file:///srv/mlartifacts/1/run-1/artifacts"
    client.artifact_error = PermissionError(1, "Operation not permitted", "/srv/mlartifacts/1/run-1")
    checkpoint = tmp_path / "step-00000500.pt"
    checkpoint.write_bytes(b"weights")
    with pytest.raises(PermissionError) as raised:
        run.log_artifact(checkpoint, "checkpoints")
    message = str(raised.value)
    assert "could not store step-00000500.pt in the MLflow run's artifact store, the folder " in message
    assert "/srv/mlartifacts/1/run-1/artifacts" in message and "--serve-artifacts" in message
    # The job's own file it could not read: its own error, which names that file, as it was.
    client.artifact_error = FileNotFoundError(2, "No such file or directory", str(checkpoint))
    with pytest.raises(FileNotFoundError) as missing:
        run.log_artifact(checkpoint, "checkpoints")
    assert "artifact store" not in str(missing.value)
    client.artifact_error = PermissionError(1, "Operation not permitted", "/srv/mlartifacts/1/run-1")
    # A store reached over HTTP: a failed request (an OSError too) stays as it was.
    client.artifact_uri = "mlflow-artifacts:/1/run-1/artifacts"
    with pytest.raises(PermissionError) as raised:
        run.log_artifact(checkpoint, "checkpoints")
    assert str(raised.value) == "[Errno 1] Operation not permitted: '/srv/mlartifacts/1/run-1'"
    run.end("FINISHED")
