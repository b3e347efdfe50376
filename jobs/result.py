"""What a job process reports, typed: its status, its progress and its result.

`jobs.run` writes `progress.json` and `result.json` through these models and the service
reads them back through the same models, so a renamed or mistyped key fails validation on
one side or the other instead of silently showing up as a missing value. Light on purpose
(pydantic and the standard library only): the service imports this, and it must never
load torch or TensorFlow.

The JSON keeps exactly the keys the writer set (`to_json` dumps the fields that were set,
even when set to None), so result.json and the API's `result` read as they always have: a
torch result has `resumed_from_step`, a Keras one `style` and `variable_placement`, a check
job's `report`. JSON has no NaN or infinity: such floats are written as text (`"nan"`), and
read back as floats.
"""

from __future__ import annotations

import json
from datetime import datetime
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobStatus(StrEnum):
    """A job's life: `queued -> running -> succeeded | failed | diverged | cancelled`.

    A `str` enum (`StrEnum`: `str(status)` is its value too), so the database and the API keep
    storing and showing the bare strings.
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DIVERGED = "diverged"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DIVERGED, JobStatus.CANCELLED}
)

# In a job's workdir: rewritten as it runs, written once at the end, its output.
PROGRESS_FILE = "progress.json"
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
# The worker touches this while it watches the job (its mtime is its last sign of life); a job whose
# worker stays silent longer than WORKER_SILENCE_ENV says freezes itself, after writing FROZEN_FILE
# (jobs.processes.watch_the_worker).
WORKER_ALIVE_FILE = ".worker-alive"
FROZEN_FILE = ".frozen-by-itself"
WORKER_SILENCE_ENV = "OPTLAB_WORKER_SILENCE_S"


def finite_json(data: Any) -> Any:
    """JSON has no NaN or infinity: report them as strings rather than fail to write."""
    if isinstance(data, float) and (data != data or data in (float("inf"), float("-inf"))):
        return str(data)
    if isinstance(data, dict):
        return {key: finite_json(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite_json(value) for value in data]
    return data


class Record(BaseModel):
    """A strict record: an unknown key is an error, so a renamed field cannot pass unnoticed."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        """The fields that were set (None included), NaN and infinities as text."""
        data: dict[str, Any] = finite_json(self.model_dump(mode="python", exclude_unset=True))
        return _jsonable(data)


def _jsonable(data: Any) -> Any:
    # model_dump(mode="python") keeps enums; JSON wants their values.
    if isinstance(data, Enum):
        return data.value
    if isinstance(data, dict):
        return {key: _jsonable(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_jsonable(value) for value in data]
    return data


# The error type of a DDP job one of whose other ranks was killed from outside (out of memory): the
# worker starts such a job again, as it does one whose own process was killed.
RANK_KILLED = "RankKilled"
# The error type of a job whose MLflow server gave no answer for as long as a point is retried, when
# the job's run was to be started or resumed: nothing of the job was lost, and the worker starts it
# again as it does one killed from outside.
TRACKING_UNREACHABLE = "TrackingUnreachable"


class OptimizerSource(Record):
    """Where an optimizer's class came from: the catalogue's `source` (`plugin /srv/plugins/mine.py`,
    `builtin:optimizers.torch.lion`), the class, and for a plugin file the sha256 of its text. The
    service records it in a job's spec when it accepts the job (plugin optimizers), and the job in its
    result: a job whose optimizer now comes from elsewhere, or whose file changed, fails at its start."""

    model_config = ConfigDict(extra="forbid", strict=True)

    source: str = Field(max_length=2000)
    class_name: str = Field(max_length=500)
    sha256: str | None = Field(default=None, max_length=64)

    def where(self) -> str:
        """`mine.py:MyOptimizer`, as a person reads it (the path is in `source`)."""
        file = self.source.removeprefix(PLUGIN_SOURCE)
        return f"{Path(file).name if file != self.source else file}:{self.class_name}"

    def tags(self, prefix: str) -> dict[str, str]:
        """As MLflow tags: `<prefix>_source`, `<prefix>_class` and, for a plugin, `<prefix>_sha256`."""
        tags = {f"{prefix}_source": self.source, f"{prefix}_class": self.class_name}
        return tags | ({f"{prefix}_sha256": self.sha256} if self.sha256 else {})


# An entry's `source` when a plugin file registered it (optimizers.registry.PLUGIN_SOURCE, which this
# light module does not import).
PLUGIN_SOURCE = "plugin "


class ErrorRecord(Record):
    """Why a job did not succeed. `traceback` is the tail of the job process's traceback; errors
    the service writes itself (a cancelled queued job, a lost lease) have none."""

    type: str
    message: str
    traceback: str | None = None


class AttemptRecord(Record):
    """One attempt of a job that ended: where it ran, when, how far it got, and how it ended (a
    job's status, or `interrupted`: its worker stopped or its process was killed from outside, or
    `lease expired`: its worker stopped answering; the job then ran again)."""

    attempt: int
    worker_id: str | None
    started_at: datetime | None
    ended_at: datetime
    step: int
    ended: str
    reason: str | None = None


class CheckpointRecord(Record):
    """One checkpoint round trip: saved at `step`, reloaded into fresh objects, compared."""

    step: int
    ok: bool
    path: str


class ResumeRecord(Record):
    """A resumed attempt (`--resume-run-id`): the points it found in the run, and how its recomputed
    points compare with them. Timings (`perf/...`) are skipped but not compared. Any difference is
    the job's nondeterminism: zero on CPU, where a resume is bitwise exact."""

    from_step: int  # the checkpoint's step (0: no checkpoint, trained again from the start)
    last_logged_step: int  # the last `train/loss` step the run held
    points_skipped: int  # recomputed points at or below their key's last logged step: not logged again
    points_compared: int
    points_differing: int
    max_abs_difference: float


class MlflowInfo(Record):
    """Where a job's MLflow run lives (jobs.tracking's run info; the API's `mlflow`)."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    run_url: str


class VariablePlacement(Record):
    """Keras only: where optimizer state lives against the model's variables."""

    model_variable_devices: list[str]
    optimizer_variable_devices: list[str]
    optimizer_variables_elsewhere: list[str]


class Progress(Record):
    """progress.json: rewritten as the job advances (steps for training, checks for a check job)."""

    step: int
    total: int
    loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_rmse: float | None = None
    val_bits_per_char: float | None = None  # char_lm
    mlflow: MlflowInfo | None = None
    check: str | None = None  # a check job: the id of the check that just finished
    # The job's last VERIFIED checkpoint: what a new attempt resumes from (`--resume PATH`).
    checkpoint: CheckpointRecord | None = None
    # What the job has been held up by, while it is (a tracking server that does not answer): shown
    # as the running job's waiting_reason; None again once it goes on.
    waiting: str | None = None

    def merged(self, **fields: Any) -> Progress:
        """This progress with `fields` replaced, validated again (a misnamed field is an error)."""
        return Progress.model_validate({**self.model_dump(exclude_unset=True), **fields})


class OptimizerState(Record):
    """What the optimizer holds and adapts, as MLflow's `optim/...` metrics show it, at the job's end."""

    state_bytes: int  # every optimizer state tensor (torch: optimizer.state; Keras: its variables)
    param_bytes: int  # the model's trainable parameters
    state_to_param_ratio: float | None  # None for a model without trainable parameters
    # The last value of each per-group value the optimizer changed during the job, keyed as
    # `optim/<key>` without the prefix (`d`, `d/group1`); constant hyperparameters are not here.
    adapted: dict[str, float]


class TrainOutcome(Record):
    """What a trainer's `run()` returns: the training part of a job's result."""

    steps_completed: int
    resumed_from_step: int | None = None  # the step a resumed job started from
    final: dict[str, float]  # train_loss and the last evaluation (val_loss, val_accuracy | val_rmse)
    params_sha256: str
    samples_per_sec: float | None
    step_time_ms_median: float | None
    optimizer_step_ms_median: float | None
    checkpoints: list[CheckpointRecord]
    checkpoints_verified: int
    device: str
    train_seconds: float
    warnings: list[str]
    style: Literal["keras", "tf_legacy"] | None = None  # Keras only
    variable_placement: VariablePlacement | None = None  # Keras only
    optimizer_state: OptimizerState | None = None  # None when the job took no step
    # A torch job with `compile`: wall seconds torch.compile took in this attempt, and how many
    # compiles that was (the first step's forward and backward: 1 or 2; more: Dynamo recompiled).
    compile_seconds: float | None = None
    compiles: int | None = None
    # On a GPU: the most memory the framework's allocator held there at once in this attempt (MiB),
    # what an out-of-memory error is measured against; None on the CPU.
    gpu_memory_peak_mb: float | None = None


class CheckOutcome(Record):
    """What the check job's `run()` returns: the conformance report and its counts."""

    report: dict[str, Any]  # jobs.checks.report.CheckReport.to_json()
    checks_failed: int
    steps_completed: int  # checks run, so the progress reads "3 of 3" at the end


Outcome = TrainOutcome | CheckOutcome


class JobResult(Record):
    """result.json: the run's own fields plus, flattened, the outcome of a job that ran.

    Flat rather than nested (`train: TrainOutcome`) so the file and the API's `result` keep
    the keys they always had. The outcome fields are optional here: a failed job has none
    of them, or only the checkpoints and warnings gathered before it failed.
    """

    job_id: str
    attempt: int
    workdir: str
    status: JobStatus
    duration_s: float | None = None
    mlflow: MlflowInfo | None = None
    error: ErrorRecord | None = None
    diverged_at_step: int | None = None
    resume: ResumeRecord | None = None  # a resumed attempt in the job's existing MLflow run
    threads: int | None = None  # CPU threads the worker gave the job (OPTLAB_JOB_THREADS)
    # The class that trained, and a wrapper's base's: where each came from (OptimizerSource).
    optimizer_source: OptimizerSource | None = None
    base_source: OptimizerSource | None = None
    # TrainOutcome's fields
    steps_completed: int | None = None
    resumed_from_step: int | None = None
    final: dict[str, float] | None = None
    params_sha256: str | None = None
    samples_per_sec: float | None = None
    step_time_ms_median: float | None = None
    optimizer_step_ms_median: float | None = None
    checkpoints: list[CheckpointRecord] | None = None
    checkpoints_verified: int | None = None
    device: str | None = None
    train_seconds: float | None = None
    warnings: list[str] | None = None
    style: Literal["keras", "tf_legacy"] | None = None
    variable_placement: VariablePlacement | None = None
    optimizer_state: OptimizerState | None = None
    compile_seconds: float | None = None
    compiles: int | None = None
    gpu_memory_peak_mb: float | None = None
    # CheckOutcome's fields
    report: dict[str, Any] | None = None
    checks_failed: int | None = None

    @field_validator("status")
    @classmethod
    def _ended(cls, status: JobStatus) -> JobStatus:
        if not status.terminal:
            allowed = ", ".join(sorted(s.value for s in TERMINAL_STATUSES))
            raise ValueError(f"a result's status must be one of {allowed}; received {status.value!r}")
        return status

    def with_outcome(self, outcome: Outcome | dict[str, Any], *, kind: type[Outcome]) -> Self:
        """This result with a job's outcome merged in; a dict is validated as `kind` first."""
        typed = kind.model_validate(outcome) if isinstance(outcome, dict) else outcome
        if not isinstance(typed, kind):
            raise TypeError(f"the job's run() returned a {type(typed).__name__}; expected {kind.__name__}")
        return self.with_fields(**_set_fields(typed))

    def with_fields(self, **fields: Any) -> Self:
        """A copy with `fields` set, validated (a wrong name or type is an error, not a new key)."""
        return type(self).model_validate({**_set_fields(self), **fields})

    @property
    def final_train_loss(self) -> float | None:
        return (self.final or {}).get("train_loss")


def _set_fields(model: BaseModel) -> dict[str, Any]:
    """The fields set on `model`, as they are (nested models stay models)."""
    return {name: getattr(model, name) for name in model.model_fields_set}


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's object, or None when absent or unreadable (a writer may have crashed)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_progress(workdir: Path) -> Progress | None:
    """The job's progress.json; None before the job wrote one. A file that does not match
    `Progress` (a renamed or mistyped field) raises pydantic's ValidationError, naming it."""
    data = read_json(workdir / PROGRESS_FILE)
    return None if data is None else Progress.model_validate(data)


def read_result(workdir: Path) -> JobResult | None:
    """The job's result.json; None when the job ended without writing one. A file that does not
    match `JobResult` raises pydantic's ValidationError, naming the field and the value."""
    data = read_json(workdir / RESULT_FILE)
    return None if data is None else JobResult.model_validate(data)
