"""Metric delivery in a process of its own, so that sending metrics costs the training interpreter
almost nothing.

Why a process: the in-process delivery thread (`jobs.tracking.BatchedMetricLogger`) spends ~15 us of
CPU per point building MLflow entities and sending them, and the training loop loses far more than
that (0.70 -> 0.44 of a bare loop on digits_mlp, benchmarks/step_profile.py), because the thread holds
the GIL in 5 ms slices while the loop waits. Here the training side only appends tuples to a list
and, once a batch is full (or a second old, or at `flush()`), pickles it as four columns and writes
it to a pipe: about 0.4 us of the training thread's CPU a point (benchmarks/mlflow_logging.py).
The delivery process turns the points into MLflow's REST `runs/log-batch` calls (at most 1000
metrics each), retries them as the thread did, and acknowledges what it has delivered, so `flush()`
still returns only when the server holds every point so far.

Why the standard library and not `mlflow`: the delivery process starts beside the job's own start-up
(importing torch, loading data); importing `mlflow` there would cost 2.5 s of CPU and 170 MiB (the
job's memory limit counts the whole process group), the standard library 0.1 s and 22 MiB; and it
sends a point for 3 us of CPU where MLflow's entities and client took 15-30 us.
`jobs.tracking` resolves how MLflow's own client would reach the server (host, credentials, TLS,
headers: MLflow's environment variables and credentials file) in the job process, which has
imported `mlflow` anyway, and hands that over on the pipe (never on a command line).

No point is lost silently:
- the job process keeps every batch it wrote until the delivery process acknowledges it; if that
  process dies or cannot start, the job detects it (a broken pipe, the acknowledgement pipe closing,
  or no acknowledgement for longer than a retry period) and falls back to in-process delivery,
  handing over every point not acknowledged (a point that was in flight may then be sent twice:
  MLflow's SQL store keeps one copy of an identical point, as it does for a retried request);
- points that cannot be delivered within the retry period are counted, and `close()` raises
  `MetricDeliveryError` naming how many;
- if the job process dies abruptly (kill -9, OOM), the delivery process sees its pipe close and
  still delivers what it had received, then exits; an alarm bounds that to the retry period plus a
  request timeout, so it never lingers. Points still buffered in the job process (under a second's
  worth, fewer than 1000) die with it, as they did with the thread.

The delivery process stays in the job's process group (the worker's SIGSTOP, SIGCONT and SIGKILL of
the group reach it) and ignores SIGTERM and SIGINT: those ask the job to stop, and the job then
flushes its points through this process before it ends it.

Standard library only: this module is what the delivery process runs (`python -m
jobs.metric_delivery ACK_FD`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import pickle
import select
import signal
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Protocol

from jobs.processes import how_it_ended

MAX_METRICS_PER_BATCH = 1000  # MLflow's REST limit for one log-batch call
# A tracking server restarted or stalled for minutes must not fail a job that trained on: a batch is
# retried this long (a minute had failed a job over a 96 s outage). Training waits meanwhile at its
# next checkpoint, whose publication needs every point before it delivered, and says what it waits on.
RETRY_FOR_S = 600.0
# Linux lets an unprivileged process grow a pipe to 1 MiB (/proc/sys/fs/pipe-max-size): room for
# ~40 full batches, so the training thread never waits for the delivery process to be scheduled.
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031
FRAME_HEADER = struct.Struct("<I")
# An acknowledgement's error text is a summary, not a server's whole error page.
ERROR_CHARS = 500
# After close(), the delivery process has flushed everything: it only has to exit.
EXIT_WAIT_S = 10.0
# flush() waits for acknowledgements this long at a time without the lock.
ACK_POLL_S = 0.05

Row = tuple[str, float, int, int]  # (key, value, step, timestamp_ms): jobs.tracking.Point's fields


class MetricDeliveryError(RuntimeError):
    """Metrics could not be delivered to the tracking server after retries."""

    def __init__(self, lost: int, reason: str) -> None:
        super().__init__(f"{lost} metric points could not be delivered to MLflow: {reason}")
        self.lost = lost
        self.reason = reason


class PermanentDeliveryError(RuntimeError):
    """The server refused a batch for good (a 4xx other than 408 or 429): retrying cannot help."""


class RunDeleted(MetricDeliveryError):
    """The job's run was deleted (in MLflow's UI, say) while the job ran: MLflow refuses every point
    logged to it from then on, so the job stops at once rather than train to its end unrecorded and
    then fail on ending the run."""

    def __init__(self, lost: int, reason: str) -> None:
        RuntimeError.__init__(
            self,
            "the job's MLflow run was deleted while the job ran, and MLflow refuses every metric point "
            f"logged to it, so the job stopped: {reason}",
        )
        self.lost = lost
        self.reason = reason


def refuses_a_deleted_run(exc: BaseException) -> bool:
    """Whether `exc` is MLflow's answer to a write to a deleted run (INVALID_PARAMETER_VALUE, `The run
    <id> must be in the 'active' state. Current state is deleted.`), from the REST call or MLflow's
    client: no other answer says so, and it is final."""
    text = str(exc)
    return "must be in the 'active' state" in text and "Current state is deleted" in text


class MetricSink(Protocol):
    """What the training side logs through: the delivery process's client or the in-process logger."""

    def metric(self, key: str, value: float, step: int) -> None: ...

    def metrics(self, points: Sequence[Row]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RetryingSender:
    """Sends a batch through `send`, retrying with backoff for `retry_for_s` before counting it lost.

    Once a batch has been lost the server has failed for a whole retry period: the remaining batches
    get one try each instead of another period each (they are counted, and close() reports them).
    Shared by the delivery process and the in-process fallback, so both keep the same promise.
    """

    def __init__(self, send: Callable[[list[Any]], None], retry_for_s: float) -> None:
        self._send = send
        self._retry_for_s = retry_for_s
        self.lost = 0
        self.last_error = ""
        self.run_deleted = ""  # the server's refusal, once it said the run was deleted

    def deliver(self, batch: list[Any]) -> None:
        deadline = time.monotonic() + (0.0 if self.lost else self._retry_for_s)
        delay = 0.25
        while True:
            try:
                self._send(batch)
                return
            except Exception as exc:
                self.last_error = describe(exc)
                if refuses_a_deleted_run(exc):
                    self.run_deleted = self.last_error
                if (
                    self.run_deleted
                    or isinstance(exc, PermanentDeliveryError)
                    or time.monotonic() + delay > deadline
                ):
                    self.lost += len(batch)
                    return
                time.sleep(delay)
                delay = min(delay * 2, 8.0)


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


@dataclass(frozen=True)
class DeliveryTarget:
    """Where and how the delivery process sends `log-batch`, as MLflow's own client would.

    `headers` may hold a credential (Authorization): it travels on the pipe, never in argv or env.
    `verify`: True (system CAs), False (MLFLOW_TRACKING_INSECURE_TLS) or a CA bundle's path.
    """

    url: str  # .../api/2.0/mlflow/runs/log-batch
    run_id: str
    headers: dict[str, str] = field(default_factory=dict)
    verify: bool | str = True
    client_cert: str | None = None
    timeout_s: float = 30.0
    retry_for_s: float = RETRY_FOR_S
    max_batch: int = MAX_METRICS_PER_BATCH

    @property
    def orphan_deadline_s(self) -> float:
        """How long the delivery process may go on once the job process is gone: one retry period
        for what it holds, and one request timeout for the request in flight."""
        return self.retry_for_s + self.timeout_s


# -- the wire: length-prefixed pickles ----------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def read_frame(stream: BinaryIO) -> Any:
    """The next object on a blocking stream, or None at its end."""
    header = _read_exactly(stream, FRAME_HEADER.size)
    if header is None:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = _read_exactly(stream, size)
    return None if payload is None else pickle.loads(payload)


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class FrameBuffer:
    """Frames out of bytes read in pieces (the job side reads acknowledgements without blocking)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._data += data
        objects = []
        while len(self._data) >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(self._data)
            end = FRAME_HEADER.size + size
            if len(self._data) < end:
                break
            objects.append(pickle.loads(bytes(self._data[FRAME_HEADER.size : end])))
            del self._data[:end]
        return objects


def encode_rows(rows: Sequence[Row]) -> bytes:
    """A batch as four columns of plain builtins (keys, values, steps, timestamps): pickling columns
    costs a tenth of pickling NamedTuples, and `float()`/`int()` in bulk keep a numpy scalar (which
    would make the delivery process import numpy) off the wire."""
    keys, values, steps, stamps = zip(*rows, strict=True)
    columns = (keys, list(map(float, values)), list(map(int, steps)), list(map(int, stamps)))
    return pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)


def decode_rows(payload: bytes) -> list[Row]:
    keys, values, steps, stamps = pickle.loads(payload)
    return list(zip(keys, values, steps, stamps, strict=True))


# -- the job side ---------------------------------------------------------------------------------------


@dataclass
class _Written:
    """A batch written to the delivery process, kept until it is acknowledged."""

    start: int  # how many points were written before it
    count: int
    payload: bytes


class DeliveryProcess:
    """The job side of the delivery process: `metric()`/`metrics()` buffer, a full (or second-old)
    batch is written to the pipe, `flush()` waits for the acknowledgement, `close()` raises
    `MetricDeliveryError` if any point was lost.

    `fallback()` makes the in-process logger used if the process cannot start or dies (every point it
    had not acknowledged is handed over); `warn` says so in the job's log.
    """

    def __init__(
        self,
        target: DeliveryTarget,
        *,
        fallback: Callable[[], MetricSink],
        interval_s: float = 1.0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._target = target
        self._make_fallback = fallback
        self._interval_s = interval_s
        self._warn = warn or _warn_on_stderr
        self._lock = threading.Lock()
        self._buffer: list[Row] = []
        self._written = 0
        self._unacknowledged: collections.deque[_Written] = collections.deque()
        self._processed = 0  # acknowledged: delivered or counted lost by the delivery process
        self._lost = 0
        self._last_error = ""
        self._run_deleted = ""  # the delivery process's word that the run was deleted
        self._acks = FrameBuffer()
        self._last_write = time.monotonic()
        self._closed = False
        self._fallback: MetricSink | None = None
        self.fallback_reason: str | None = None  # why delivery moved into this process, if it did
        self._process: subprocess.Popen[bytes] | None = None
        self._ack_fd = -1
        try:
            self._start()
        except OSError as exc:
            self._fall_back(f"could not be started ({describe(exc)})")

    @property
    def pid(self) -> int | None:
        """The delivery process's pid (None once delivery is in this process)."""
        return self._process.pid if self._process is not None and self._fallback is None else None

    def _start(self) -> None:
        ack_read, ack_write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "jobs.metric_delivery", str(ack_write)],
                stdin=subprocess.PIPE,
                pass_fds=(ack_write,),
            )
        except BaseException:
            os.close(ack_read)
            raise
        finally:
            os.close(ack_write)  # the child holds the only write end: its death closes the pipe
        self._ack_fd = ack_read
        os.set_blocking(ack_read, False)
        assert self._process.stdin is not None
        try:
            import fcntl

            fcntl.fcntl(self._process.stdin.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe only means the training thread may wait for the process sooner
        self._write(frame(pickle.dumps(asdict(self._target))))

    # -- logging ------------------------------------------------------------------------------------

    def metric(self, key: str, value: float, step: int) -> None:
        row = (key, float(value), int(step), int(time.time() * 1000))
        with self._lock:
            if self._closed:
                raise RuntimeError("metric logged after close()")
            if self._fallback is not None:
                self._fallback.metrics([row])
                return
            self._buffer.append(row)
            if len(self._buffer) >= self._target.max_batch or self._batch_is_old():
                self._send_buffer()
            self._stop_if_run_deleted()

    def metrics(self, points: Sequence[Row]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("metrics logged after close()")
            if self._fallback is not None:
                self._fallback.metrics(points)
                return
            self._buffer.extend(points)
            if len(self._buffer) >= self._target.max_batch or self._batch_is_old():
                self._send_buffer()
            self._stop_if_run_deleted()

    def _batch_is_old(self) -> bool:
        return time.monotonic() - self._last_write >= self._interval_s

    def _stop_if_run_deleted(self) -> None:
        if self._run_deleted:
            raise RunDeleted(self._lost, self._run_deleted)

    def flush(self) -> None:
        """Return once every point logged before this call is in the tracking server (or counted as
        lost). The lock is held only to send the buffer and between waits, never through them: the
        training thread keeps logging while a checkpoint's publication waits here on a thread of its
        own (jobs.training.publication)."""
        with self._lock:
            if self._fallback is None:
                self._send_buffer()
            mark = self._written
            seen = self._processed
        # The process makes progress at least once per batch within a retry period and a request
        # timeout; longer than that without a word, it is stuck: fall back rather than wait forever.
        stalled_after = self._target.retry_for_s + 2 * self._target.timeout_s + 5.0
        last_progress = time.monotonic()
        while True:
            with self._lock:
                try:
                    if self._fallback is None:
                        self._read_acknowledgements()  # the training thread may have read them too
                        if self._processed >= mark:
                            self._stop_if_run_deleted()
                            return
                        if self._processed > seen:
                            seen, last_progress = self._processed, time.monotonic()
                        elif time.monotonic() - last_progress > stalled_after:
                            raise _DeliveryProcessStuck(f"no acknowledgement for {stalled_after:.0f} s")
                except _DeliveryProcessStuck as exc:
                    self._fall_back(f"stopped answering ({exc}), so the job stopped it", stopped_by_job=True)
                except _DeliveryProcessGone as exc:
                    self._fall_back(f"died ({exc})")
                fallback, ack_fd = self._fallback, self._ack_fd
            if fallback is not None:  # it was handed every point not acknowledged, in order
                fallback.flush()
                return
            _wait_readable(ack_fd, ACK_POLL_S)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # nothing is logged from here on
        with contextlib.suppress(RunDeleted):  # raised below, once the process is stopped
            self.flush()
        with self._lock:
            lost, reason = self._lost, self._last_error
            if self._fallback is None:
                self._stop_process()
            else:
                try:
                    self._fallback.close()
                except RunDeleted:
                    raise
                except MetricDeliveryError as exc:
                    lost, reason = lost + exc.lost, exc.reason
            self._stop_if_run_deleted()
        if lost:
            raise MetricDeliveryError(lost, reason)

    # -- the pipe -----------------------------------------------------------------------------------

    def _send_buffer(self) -> None:
        self._last_write = time.monotonic()
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        try:
            payload = encode_rows(batch)
        except (TypeError, ValueError):
            batch = self._deliverable(batch)
            if not batch:
                return
            payload = encode_rows(batch)
        self._unacknowledged.append(_Written(self._written, len(batch), payload))
        self._written += len(batch)
        try:
            self._write(frame(payload))
            self._read_acknowledgements()
        except (OSError, _DeliveryProcessGone) as exc:
            self._fall_back(f"died ({describe(exc)})")

    def _write(self, data: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._process.stdin.fileno(), view) :]

    def _deliverable(self, batch: list[Row]) -> list[Row]:
        """The points of `batch` that can be sent; the others (not numbers) can never be delivered:
        counted as lost, and named by close()."""
        rows = []
        for point in batch:
            try:
                key, value, step, stamp = point
                rows.append((str(key), float(value), int(step), int(stamp)))
            except (TypeError, ValueError) as exc:
                self._lost += 1
                self._last_error = f"{point!r} is not (key, number, step, timestamp_ms): {describe(exc)}"
        return rows

    def _read_acknowledgements(self, timeout_s: float | None = 0.0) -> bool:
        """Take in what the process acknowledged; True if anything came (False: `timeout_s` passed).
        Raises _DeliveryProcessGone at the pipe's end (the process exited or was killed)."""
        poller = select.poll()  # not select(): a job with many files open may hold fds past 1024
        poller.register(self._ack_fd, select.POLLIN)
        if not poller.poll(None if timeout_s is None else timeout_s * 1000):
            return False
        try:
            data = os.read(self._ack_fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            raise _DeliveryProcessGone("its acknowledgement pipe closed")
        for processed, lost, last_error, run_deleted in self._acks.feed(data):
            self._processed, self._lost, self._last_error = processed, lost, last_error or self._last_error
            self._run_deleted = run_deleted or self._run_deleted
        while self._unacknowledged and (
            self._unacknowledged[0].start + self._unacknowledged[0].count <= self._processed
        ):
            self._unacknowledged.popleft()
        return True

    # -- when the process is gone -------------------------------------------------------------------

    def _fall_back(self, problem: str, *, stopped_by_job: bool = False) -> None:
        """Deliver from this process from now on, starting with every point not acknowledged.
        `stopped_by_job`: the process was alive and this one stops it (its SIGKILL is no cause)."""
        self._end_process()
        if self._process is None or stopped_by_job:
            reason = problem
        else:
            reason = f"{problem}; it {how_it_ended(self._process.poll())}"
        rows: list[Row] = []
        for written in self._unacknowledged:
            skip = max(0, self._processed - written.start)  # the start of a batch it acknowledged
            rows.extend(decode_rows(written.payload)[skip:])
        rows.extend(self._buffer)
        self._unacknowledged.clear()
        self._buffer = []
        self._fallback = self._make_fallback()
        self._fallback.metrics(rows)
        self.fallback_reason = reason
        self._warn(
            f"the metric delivery process {reason}: delivering metrics from the job process instead "
            f"(slower; {len(rows)} points not yet acknowledged handed over, none lost)"
        )

    def _end_process(self) -> None:
        """Kill the process (if it still runs) and take in its last acknowledgements."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._close_stdin()
        if self._ack_fd < 0:  # it never started
            return
        try:
            while True:  # everything it wrote before it died, up to the pipe's end
                self._read_acknowledgements(timeout_s=None)
        except _DeliveryProcessGone:
            pass
        os.close(self._ack_fd)
        self._ack_fd = -1

    def _stop_process(self) -> None:
        """close(): everything is flushed; the end of its input tells the process to exit."""
        assert self._process is not None
        self._close_stdin()
        try:
            self._process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._ack_fd)
        self._ack_fd = -1

    def _close_stdin(self) -> None:
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.close()
        except OSError:
            pass  # a broken pipe: the process is gone already


def _wait_readable(fd: int, timeout_s: float) -> None:
    """Until `fd` has something to read, or `timeout_s`. The fd may be closed meanwhile by the
    thread that holds the lock (a fall-back): then only the timeout is waited."""
    if fd < 0:
        time.sleep(timeout_s)
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if any(events & select.POLLNVAL for _, events in poller.poll(timeout_s * 1000)):
        time.sleep(timeout_s)


class _DeliveryProcessGone(Exception):
    pass


class _DeliveryProcessStuck(Exception):
    """Alive, but it acknowledged nothing for longer than a batch can take (stopped, hung)."""


def _warn_on_stderr(message: str) -> None:
    print(f"optlab: warning: {message}", file=sys.stderr, flush=True)


# -- the delivery process -------------------------------------------------------------------------------


class Inbox:
    """Points received from the job, waiting to be sent; closed when the job's pipe ends."""

    def __init__(self) -> None:
        self._rows: collections.deque[Row] = collections.deque()
        self._closed = False
        self._cond = threading.Condition()

    def put(self, rows: Iterable[Row]) -> None:
        with self._cond:
            self._rows.extend(rows)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take(self, most: int) -> list[Row]:
        """Up to `most` points, waiting for one; [] once closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: self._rows or self._closed)
            return [self._rows.popleft() for _ in range(min(most, len(self._rows)))]


# The JSON mapping of protobuf doubles, which MLflow's server parses (json.dumps would write NaN).
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def log_batch_body(run_id: str, rows: Sequence[Row]) -> bytes:
    metrics = [
        {
            "key": key,
            "value": value if math.isfinite(value) else NON_FINITE[repr(value)],
            "timestamp": stamp,
            "step": step,
        }
        for key, value, step, stamp in rows
    ]
    return json.dumps({"run_id": run_id, "metrics": metrics}).encode()


class RestLogBatch:
    """`send` for RetryingSender: one POST to MLflow's `runs/log-batch` (proxies from the
    environment, as MLflow's client honours them)."""

    def __init__(self, target: DeliveryTarget) -> None:
        self._target = target
        handlers: list[urllib.request.BaseHandler] = []
        if target.url.startswith("https:"):
            handlers.append(urllib.request.HTTPSHandler(context=tls_context(target)))
        self._opener = urllib.request.build_opener(*handlers)
        self._headers = {"Content-Type": "application/json", **target.headers}

    def __call__(self, rows: list[Row]) -> None:
        request = urllib.request.Request(
            self._target.url,
            data=log_batch_body(self._target.run_id, rows),
            headers=self._headers,
            method="POST",
        )
        try:
            with self._opener.open(request, timeout=self._target.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            message = f"HTTP {exc.code} from {self._target.url}: {server_message(exc)}"
            if 400 <= exc.code < 500 and exc.code not in (408, 429):
                raise PermanentDeliveryError(message) from None
            raise ConnectionError(message) from None


def server_message(error: urllib.error.HTTPError) -> str:
    try:
        body = error.read().decode(errors="replace")
    except OSError:
        return error.reason or ""
    try:
        return str(json.loads(body).get("message", body))
    except (ValueError, AttributeError):
        return body.strip() or str(error.reason)


def tls_context(target: DeliveryTarget) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=target.verify if isinstance(target.verify, str) else None)
    if target.verify is False:  # MLFLOW_TRACKING_INSECURE_TLS
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if target.client_cert:
        context.load_cert_chain(target.client_cert)
    return context


def receive(source: BinaryIO, inbox: Inbox, deadline_s: float) -> None:
    """Read the job's batches into the inbox; at the pipe's end (close(), or the job died) close it,
    and arm an alarm so that this process never outlives the job by more than `deadline_s`."""
    try:
        while (columns := read_frame(source)) is not None:
            keys, values, steps, stamps = columns
            inbox.put(zip(keys, values, steps, stamps, strict=True))
    finally:
        signal.alarm(max(1, math.ceil(deadline_s)))  # SIGALRM's default action ends the process
        inbox.close()


def acknowledge(stream: BinaryIO, processed: int, sender: RetryingSender) -> None:
    try:
        stream.write(frame(pickle.dumps((processed, sender.lost, sender.last_error, sender.run_deleted))))
    except OSError:
        pass  # the job is gone: deliver what is left all the same


def serve(source: BinaryIO, acks: BinaryIO) -> None:
    settings = read_frame(source)
    if settings is None:  # the job died before it could say where to deliver: nothing to do
        return
    target = DeliveryTarget(**settings)
    inbox = Inbox()
    threading.Thread(
        target=receive, args=(source, inbox, target.orphan_deadline_s), name="receive", daemon=True
    ).start()
    sender = RetryingSender(RestLogBatch(target), target.retry_for_s)
    processed = 0
    while batch := inbox.take(target.max_batch):
        sender.deliver(batch)
        processed += len(batch)
        acknowledge(acks, processed, sender)


def main(argv: Sequence[str]) -> int:
    # SIGTERM/SIGINT ask the job to stop; it then flushes through this process, and ends it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(int(argv[0]), "wb", buffering=0) as acks:
        serve(sys.stdin.buffer, acks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
