"""The delivery process (jobs.metric_delivery) against a real MLflow server: every point exactly once,
flush, loss counted at close, a killed delivery process, an abrupt death of the job process.

A `Gate` sits between the job side and the server: it forwards every request, and can hold the
`log-batch` requests (until released) or refuse them, which is how these tests make the delivery
process hold points at a chosen moment without sleeping.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from mlflow.entities import Metric

from jobs import metric_delivery, tracking
from jobs.metric_delivery import DeliveryProcess, DeliveryTarget, PermanentDeliveryError, RetryingSender
from jobs.tracking import LOG_BATCH_ENDPOINT, MetricDeliveryError, MlflowRun, Point, delivery_target
from tests.conftest import ROOT, free_port
from tests.service.durable_helpers import mlflow_server

pytestmark = pytest.mark.xdist_group("metric-delivery")

WAIT_S = 60  # a safety net against hangs; never reached when the code is right


# -- a real MLflow server, and a gate in front of it ---------------------------------------------------


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def client(server_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server_uri)


class Gate:
    """An HTTP proxy to the MLflow server that can hold or refuse `log-batch` requests."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.held = threading.Event()  # a log-batch request is waiting at the gate
        self.open = threading.Event()
        self.open.set()
        self.refuse_with: int | None = None
        self.batch_headers: list[dict[str, str]] = []
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                gate.forward(self)

            do_POST = do_PATCH = do_DELETE = do_PUT = do_GET

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self, request: http.server.BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        if request.path.endswith(LOG_BATCH_ENDPOINT) and b'"metrics"' in body:
            self.batch_headers.append(dict(request.headers))
            if not self.open.is_set():
                self.held.set()
                assert self.open.wait(WAIT_S)
            if self.refuse_with is not None:
                request.send_response(self.refuse_with)
                request.send_header("Content-Type", "application/json")
                request.end_headers()
                request.wfile.write(b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "gate closed"}')
                return
        host, port = self.upstream.hostname or "", self.upstream.port
        upstream = http.client.HTTPConnection(host, port, timeout=WAIT_S)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
        upstream.request(request.command, request.path, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        upstream.close()
        with contextlib.suppress(OSError):  # a client killed meanwhile (a test kills one)
            request.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                    request.send_header(key, value)
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            request.wfile.write(data)

    def hold(self) -> None:
        self.held.clear()
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gate(server_uri: str) -> Iterator[Gate]:
    gate = Gate(server_uri)
    yield gate
    gate.close()


def start_run(uri: str, name: str) -> MlflowRun:
    return MlflowRun(uri, experiment="metric-delivery", run_name=name, params={"p": "1"}, tags={})


def steps_of(client: Any, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def points(steps: range, key: str = "train/loss") -> list[Point]:
    stamp = int(time.time() * 1000)
    return [Point(key, 1.0 / (step + 1), step, stamp) for step in steps]


def no_fallback() -> Any:
    raise AssertionError("the delivery process was expected to stay up")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a parent that never reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


# -- the delivery process ---------------------------------------------------------------------------------


def test_every_point_arrives_exactly_once_through_the_process(client: Any, server_uri: str) -> None:
    run = start_run(server_uri, "exactly-once")
    assert isinstance(run.delivery, DeliveryProcess)
    pid = run.delivery.pid
    assert pid is not None and os.getpgid(pid) == os.getpgid(0), "it stays in the job's process group"
    for start in range(0, 400, 10):  # the loop's bulk hand-over, 10 steps at a time
        run.metrics(points(range(start, start + 10)))
    for step in range(400, 2500):
        run.metric("train/loss", 1.0 / (step + 1), step)
        run.metric("train/lr", 0.1, step)
    run.metric("train/grad_norm", float("nan"), 0)
    run.end("FINISHED")
    wait_until_gone(pid)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(2500))
    assert {m.step: m.value for m in history}[9] == pytest.approx(0.1)
    assert steps_of(client, run.info.run_id, "train/lr") == list(range(400, 2500))
    (nan,) = client.get_metric_history(run.info.run_id, "train/grad_norm")
    assert nan.value != nan.value
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    with pytest.raises(RuntimeError, match="after close"):
        run.metric("train/loss", 0.0, 2500)


def held_flush(run: MlflowRun, gate: Gate) -> threading.Thread:
    """300 points logged, then a flush on a thread of its own, its batch held at the gate."""
    run.metrics(points(range(300)))
    gate.hold()
    flusher = threading.Thread(target=run.delivery.flush)
    flusher.start()
    assert gate.held.wait(WAIT_S)
    return flusher


def test_flush_returns_only_once_the_server_holds_every_point(client: Any, gate: Gate) -> None:
    run = start_run(gate.uri, "flush")
    flusher = held_flush(run, gate)
    flusher.join(timeout=0.2)
    assert flusher.is_alive(), "flush() returned while the batch was still held on its way"
    gate.release()
    flusher.join(WAIT_S)
    assert not flusher.is_alive()
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(300))
    run.end("FINISHED")


def log_on(run: MlflowRun) -> None:
    for start in range(300, 3300, 100):
        run.metrics(points(range(start, start + 100)))


def test_a_flush_waiting_for_the_server_does_not_hold_up_logging(client: Any, gate: Gate) -> None:
    """A checkpoint's publication flushes on a thread of its own while the training thread logs on."""
    run = start_run(gate.uri, "flush-beside-logging")
    flusher = held_flush(run, gate)
    logger = threading.Thread(target=log_on, args=(run,))
    logger.start()
    logger.join(WAIT_S / 2)
    assert not logger.is_alive(), "logging waited for the flush"
    assert flusher.is_alive(), "flush() returned while its points were still held"
    gate.release()
    flusher.join(WAIT_S)
    assert not flusher.is_alive()
    assert steps_of(client, run.info.run_id, "train/loss")[:300] == list(range(300))
    run.end("FINISHED")
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(3300))


def test_sigterm_to_the_group_leaves_delivery_to_the_job(client: Any, server_uri: str) -> None:
    """The worker's SIGTERM asks the job to stop; the job then flushes through the process."""
    run = start_run(server_uri, "sigterm")
    run.metrics(points(range(50)))
    run.delivery.flush()  # the process is up (it acknowledged): past installing its handlers
    assert isinstance(run.delivery, DeliveryProcess) and run.delivery.pid is not None
    os.kill(run.delivery.pid, signal.SIGTERM)
    run.metrics(points(range(50, 100)))
    run.end("FINISHED")
    assert run.delivery.fallback_reason is None
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(100))


def test_points_the_server_keeps_refusing_are_counted_and_close_raises(
    client: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "METRIC_RETRY_FOR_S", 0.5)
    run = start_run(gate.uri, "refused")
    run.metrics(points(range(100)))
    run.delivery.flush()
    gate.refuse_with = 503
    run.metrics(points(range(100, 2100)))
    with pytest.raises(MetricDeliveryError, match=r"^2000 metric points .*HTTP 503.*gate closed"):
        run.end("FINISHED")
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(100))
    assert client.get_run(run.info.run_id).info.status == "FAILED"


def test_an_unreachable_server_counts_every_point_lost_and_close_raises() -> None:
    target = DeliveryTarget(
        url=f"http://127.0.0.1:{free_port()}{LOG_BATCH_ENDPOINT}", run_id="r1", retry_for_s=0.3
    )
    delivery = DeliveryProcess(target, fallback=no_fallback)
    delivery.metrics(points(range(1500)))
    with pytest.raises(MetricDeliveryError, match=r"^1500 metric points .*[Cc]onnection refused"):
        delivery.close()


def test_a_stuck_delivery_process_is_given_up_on_and_nothing_is_lost(
    client: Any, server_uri: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """No acknowledgement for longer than a retry period and two request timeouts (plus a margin):
    the process is stuck (here: stopped), killed, and the job process delivers instead."""
    run_id = client.create_run(client.create_experiment("stuck")).info.run_id
    target = DeliveryTarget(
        url=server_uri + LOG_BATCH_ENDPOINT, run_id=run_id, retry_for_s=0.2, timeout_s=0.2
    )
    sent: list[list[Any]] = []

    def fallback() -> tracking.BatchedMetricLogger:
        def send(rows: list[Any]) -> None:
            client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, s, t in rows])
            sent.append(rows)

        return tracking.BatchedMetricLogger(send)

    delivery = DeliveryProcess(target, fallback=fallback)
    assert delivery.pid is not None
    os.kill(delivery.pid, signal.SIGSTOP)
    delivery.metrics(points(range(700)))
    delivery.close()
    # Its SIGKILL was the job's: "died (...); it was killed by signal SIGKILL" had read as another's.
    assert re.fullmatch(
        r"stopped answering \(no acknowledgement for \d+ s\), so the job stopped it",
        delivery.fallback_reason or "",
    ), delivery.fallback_reason
    assert "delivering metrics from the job process instead" in capfd.readouterr().err
    assert sum(len(rows) for rows in sent) == 700
    assert steps_of(client, run_id, "train/loss") == list(range(700))


def test_a_killed_delivery_process_is_detected_and_nothing_is_lost(
    client: Any, gate: Gate, capfd: pytest.CaptureFixture[str]
) -> None:
    run = start_run(gate.uri, "killed")
    run.metrics(points(range(1500)))
    run.delivery.flush()
    gate.hold()
    run.metrics(points(range(1500, 2500)))  # a full batch: written, sent, held at the gate
    assert gate.held.wait(WAIT_S)
    pid = run.delivery.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    gate.release()  # the held request may still arrive: the fallback sends the same points again
    run.metrics(points(range(2500, 3000)))
    run.end("FINISHED")
    assert isinstance(run.delivery, DeliveryProcess)
    assert (
        run.delivery.fallback_reason is not None
        and "; it was killed by signal SIGKILL" in run.delivery.fallback_reason
    )
    assert "delivering metrics from the job process instead" in capfd.readouterr().err
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(3000))  # each exactly once
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


def test_a_delivery_process_that_cannot_start_falls_back_to_the_job_process(
    client: Any, server_uri: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(metric_delivery.sys, "executable", "/nonexistent/python")
    run = start_run(server_uri, "no-process")
    run.metrics(points(range(1200)))
    run.end("FINISHED")
    assert isinstance(run.delivery, DeliveryProcess) and run.delivery.pid is None
    assert "could not be started" in (run.delivery.fallback_reason or "")
    assert "delivering metrics from the job process instead" in capfd.readouterr().err
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(1200))


# The job process, reduced to what matters here: a delivery process per run, 2000 points written to
# each (two full batches), then it waits to be killed. Standard library only, so it starts at once.
JOB = """
import sys, time
from jobs.metric_delivery import DeliveryProcess, DeliveryTarget

def fail():
    raise AssertionError("no fallback expected")

pids = []
for url, run_id, patience_s in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    seconds = float(patience_s)
    target = DeliveryTarget(url=url, run_id=run_id, retry_for_s=seconds, timeout_s=seconds)
    delivery = DeliveryProcess(target, fallback=fail)
    stamp = int(time.time() * 1000)
    delivery.metrics([("train/loss", 1.0 / (s + 1), s, stamp) for s in range(2000)])
    pids.append(str(delivery.pid))
print(" ".join(pids), flush=True)
time.sleep(600)
"""


def test_after_an_abrupt_death_of_the_job_what_the_process_had_arrives_and_it_exits(
    client: Any, server_uri: str, tmp_path: Path
) -> None:
    """kill -9 of the job process: the delivery process delivers what it had received; one whose
    server never answers gives up after its retry period and a request timeout (no orphan stays)."""
    experiment = client.create_experiment("abrupt-death")
    delivered_run = client.create_run(experiment).info.run_id
    stuck_run = client.create_run(experiment).info.run_id
    gate, stuck = Gate(server_uri), Gate(server_uri)
    gate.hold()
    stuck.hold()
    try:
        job = subprocess.Popen(
            [
                *(sys.executable, "-c", JOB),
                *(gate.uri + LOG_BATCH_ENDPOINT, delivered_run, str(WAIT_S)),
                *(stuck.uri + LOG_BATCH_ENDPOINT, stuck_run, "1"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert job.stdout is not None
        first, second = (int(pid) for pid in job.stdout.readline().split())
        assert gate.held.wait(WAIT_S) and stuck.held.wait(WAIT_S)
        job.kill()
        job.wait()
        assert not gone(first), "the delivery process died with the job"
        gate.release()
        wait_until_gone(first)
        wait_until_gone(second)  # its gate never opens: it gives up after 1 + 1 s
    finally:
        gate.close()
        stuck.close()
    assert steps_of(client, delivered_run, "train/loss") == list(range(2000))


def test_the_delivery_process_sends_the_credentials_mlflow_would(
    client: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ada")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    run = start_run(gate.uri, "credentials")
    run.metrics(points(range(10)))
    run.end("FINISHED")
    basic = "Basic " + base64.standard_b64encode(b"ada:s3cret").decode()
    assert [headers["Authorization"] for headers in gate.batch_headers] == [basic]
    assert "mlflow-python-client" in gate.batch_headers[0]["User-Agent"]


# -- how the delivery process reaches the server ---------------------------------------------------------


def test_the_target_carries_mlflows_credentials_and_tls_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_AUTH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok")
    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    target = delivery_target("https://mlflow.example/prefix/", "r1")
    assert isinstance(target, DeliveryTarget)
    assert target.url == "https://mlflow.example/prefix/api/2.0/mlflow/runs/log-batch"
    assert target.headers["Authorization"] == "Bearer tok"
    assert target.verify is False and target.run_id == "r1"
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    target = delivery_target("http://u:p%40ss@mlflow.example:5000", "r1")  # userinfo in the URI
    assert isinstance(target, DeliveryTarget)
    assert target.url == "http://mlflow.example:5000/api/2.0/mlflow/runs/log-batch"
    assert target.headers["Authorization"] == "Basic " + base64.standard_b64encode(b"u:p@ss").decode()


@pytest.mark.parametrize(
    ("uri", "env", "reason"),
    [
        ("file:///tmp/mlruns", {}, "not http(s)"),
        ("databricks", {}, "not http(s)"),
        ("http://mlflow.example", {"MLFLOW_TRACKING_AUTH": "kubernetes"}, "signs this server's requests"),
    ],
)
def test_a_server_only_mlflows_client_can_reach_is_served_from_the_job_process(
    uri: str, env: dict[str, str], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    target = delivery_target(uri, "r1")
    assert isinstance(target, str) and reason in target


def test_a_refused_batch_is_lost_at_once_and_a_failing_one_after_the_retry_period() -> None:
    calls: list[int] = []

    def refuse(batch: list[Any]) -> None:
        calls.append(len(batch))
        raise PermanentDeliveryError("HTTP 400: Invalid metric name")

    sender = RetryingSender(refuse, retry_for_s=WAIT_S)
    sender.deliver([1, 2, 3])
    assert calls == [3] and sender.lost == 3 and "Invalid metric name" in sender.last_error


def test_the_wire_keeps_plain_builtins_only() -> None:
    import numpy as np

    payload = metric_delivery.encode_rows([("a", np.float64(0.5), np.int64(3), 7), Point("b", 1, 2, 8)])
    rows = metric_delivery.decode_rows(payload)
    assert rows == [("a", 0.5, 3, 7), ("b", 1.0, 2, 8)]
    assert b"numpy" not in payload and {type(value) for _, value, _, _ in rows} == {float}


@pytest.mark.parametrize("delivery", ["process", "thread"])
def test_a_run_deleted_while_the_job_runs_stops_it_at_the_next_flush_naming_the_run(
    client: Any, server_uri: str, delivery: Any
) -> None:
    """The run deleted in MLflow's UI mid-job: every point was counted lost and the job trained on to
    its last step, then failed on a raw RestException from ending the run."""
    run = MlflowRun(
        server_uri, experiment="metric-delivery", run_name="deleted", params={}, tags={}, delivery=delivery
    )
    run.metrics(points(range(10)))
    run.delivery.flush()
    client.delete_run(run.info.run_id)
    run.metrics(points(range(10, 20)))
    with pytest.raises(MetricDeliveryError, match="MLflow run was deleted") as raised:
        run.delivery.flush()
    assert isinstance(raised.value, metric_delivery.RunDeleted) and run.info.run_id in str(raised.value)
    with pytest.raises(metric_delivery.RunDeleted):  # no more training: the next metric says so too
        run.metrics(points(range(20, 21)))
    with pytest.raises(metric_delivery.RunDeleted, match=run.info.run_id):
        run.end("FAILED", outcome="failed")  # MLflow refuses to end it: not tried
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(10))
