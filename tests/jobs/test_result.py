"""jobs.result: the typed status, progress and result keep result.json's keys and fail loudly."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.report import Reporter
from jobs.result import (
    PROGRESS_FILE,
    RESULT_FILE,
    TERMINAL_STATUSES,
    CheckOutcome,
    JobResult,
    JobStatus,
    Progress,
    TrainOutcome,
)

# A torch trainer's run() as it returns today (a dict); Keras adds style and variable_placement.
TORCH_RUN: dict[str, Any] = {
    "steps_completed": 20,
    "resumed_from_step": None,
    "final": {"train_loss": 0.5, "val_loss": 0.6, "val_accuracy": 0.9},
    "params_sha256": "ab" * 32,
    "samples_per_sec": 1000.0,
    "step_time_ms_median": 1.5,
    "optimizer_step_ms_median": None,
    "checkpoints": [
        {"step": 10, "ok": True, "path": "/w/10.pt"},
        {"step": 20, "ok": True, "path": "/w/20.pt"},
    ],
    "checkpoints_verified": 2,
    "device": "cpu",
    "train_seconds": 3.25,
    "warnings": [],
}
KERAS_RUN: dict[str, Any] = {
    **{k: v for k, v in TORCH_RUN.items() if k != "resumed_from_step"},
    "style": "keras",
    "variable_placement": {
        "model_variable_devices": ["CPU:0"],
        "optimizer_variable_devices": ["CPU:0"],
        "optimizer_variables_elsewhere": [],
    },
}
RUN = {"job_id": "7", "attempt": 1, "workdir": "/w"}


def started() -> JobResult:
    return JobResult(**RUN, status=JobStatus.FAILED)


def test_statuses_are_the_strings_the_database_and_the_api_hold() -> None:
    assert [s.value for s in JobStatus] == [
        "queued",
        "running",
        "succeeded",
        "failed",
        "diverged",
        "cancelled",
    ]
    assert JobStatus("diverged") == "diverged" and f"{JobStatus.CANCELLED}" == "cancelled"
    assert {s for s in JobStatus if s.terminal} == TERMINAL_STATUSES
    assert not JobStatus.RUNNING.terminal and JobStatus.SUCCEEDED.terminal


@pytest.mark.parametrize("outcome", [TORCH_RUN, KERAS_RUN], ids=["torch", "keras"])
def test_a_trainer_dict_keeps_exactly_its_keys_in_result_json(outcome: dict[str, Any]) -> None:
    result = (
        started().with_outcome(outcome, kind=TrainOutcome).with_fields(status="succeeded", duration_s=4.0)
    )
    written = result.to_json()
    assert set(written) == {*RUN, *outcome, "status", "duration_s"}
    assert written["status"] == "succeeded" and written["checkpoints"] == outcome["checkpoints"]
    assert JobResult.model_validate(json.loads(json.dumps(written))).to_json() == written  # round trip


@pytest.mark.parametrize("kind", [TrainOutcome, CheckOutcome])
def test_the_result_mirrors_every_outcome_field(kind: type[TrainOutcome | CheckOutcome]) -> None:
    """Flattened, so `GET /jobs/{id}` shows each outcome field under the same name."""
    mirrored = JobResult.model_fields
    for name, field in kind.model_fields.items():
        assert name in mirrored, f"JobResult lacks {kind.__name__}.{name}"
        # Optional there: a failed job has none of them.
        assert mirrored[name].annotation == typing.Optional[field.annotation], name  # noqa: UP045


def test_the_optimizer_state_reads_back_as_written() -> None:
    state = {"state_bytes": 8, "param_bytes": 4, "state_to_param_ratio": 2.0, "adapted": {"d/group1": 0.5}}
    written = started().with_outcome({**TORCH_RUN, "optimizer_state": state}, kind=TrainOutcome).to_json()
    assert written["optimizer_state"] == state
    read = JobResult.model_validate(json.loads(json.dumps(written)))
    assert read.optimizer_state is not None and read.optimizer_state.adapted == {"d/group1": 0.5}
    with pytest.raises(ValidationError, match="state_byte"):
        TrainOutcome.model_validate({**TORCH_RUN, "optimizer_state": {**state, "state_byte": 1}})


def test_a_typed_outcome_is_taken_as_it_is() -> None:
    outcome = CheckOutcome(report={"summary": {"fail": 0}}, checks_failed=0, steps_completed=3)
    written = started().with_outcome(outcome, kind=CheckOutcome).to_json()
    assert written["report"] == {"summary": {"fail": 0}} and written["steps_completed"] == 3
    with pytest.raises(TypeError, match="expected TrainOutcome"):
        started().with_outcome(outcome, kind=TrainOutcome)


def test_a_renamed_or_mistyped_key_fails_naming_it() -> None:
    renamed = {**TORCH_RUN, "steps_done": TORCH_RUN["steps_completed"]}
    del renamed["steps_completed"]
    with pytest.raises(ValidationError, match="steps_done") as caught:
        started().with_outcome(renamed, kind=TrainOutcome)
    assert "steps_completed" in str(caught.value)  # and the one now missing
    with pytest.raises(ValidationError, match="checkpoints_verified"):
        TrainOutcome.model_validate({**TORCH_RUN, "checkpoints_verified": "two"})
    with pytest.raises(ValidationError, match="received 'running'"):
        JobResult(**RUN, status=JobStatus.RUNNING)


def test_nan_and_infinity_are_written_as_text_and_read_back_as_floats() -> None:
    outcome = {**TORCH_RUN, "final": {"train_loss": math.nan, "val_loss": math.inf}}
    written = started().with_outcome(outcome, kind=TrainOutcome).to_json()
    assert written["final"] == {"train_loss": "nan", "val_loss": "inf"}
    json.dumps(written, allow_nan=False)  # valid JSON
    read = JobResult.model_validate(written)
    assert read.final_train_loss is not None and math.isnan(read.final_train_loss)


def test_progress_merges_fields_and_refuses_unknown_ones() -> None:
    progress = Progress(step=0, total=10).merged(step=3, loss=0.5).merged(val_accuracy=0.75)
    assert progress.to_json() == {"step": 3, "total": 10, "loss": 0.5, "val_accuracy": 0.75}
    with pytest.raises(ValidationError, match="train_loss"):
        progress.merged(train_loss=0.4)


def test_a_huge_error_message_is_cut_with_what_was_left_out() -> None:
    """A plugin's 2 MB message had made its job's record, and every listing of jobs, megabytes."""
    from jobs.run import MESSAGE_LIMIT, TRACEBACK_LINE_LIMIT, error_record

    try:
        raise RuntimeError("boom " + "x" * 2_000_000)
    except RuntimeError as exc:
        record = error_record(exc)
    assert record.message.startswith("boom xxx") and record.message.endswith("(1,996,005 more characters)")
    assert len(record.message) < MESSAGE_LIMIT + 50
    assert record.traceback is not None
    assert max(len(line) for line in record.traceback.splitlines()) < TRACEBACK_LINE_LIMIT + 50
    assert "raise RuntimeError" in record.traceback


def test_the_result_comes_after_the_last_progress_the_throttle_held_back(tmp_path: Path) -> None:
    """A job that failed at its step-500 checkpoint had read as at step 243: the step-500 progress
    came within the throttle's half second of the last write, and the result was written alone."""
    reporter = Reporter(tmp_path, min_interval_s=3600)
    reporter.progress(step=0, total=500, force=True)
    reporter.progress(step=500, total=500)
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["step"] == 0  # held back
    reporter.result(JobResult(job_id="7", attempt=1, workdir=str(tmp_path), status=JobStatus.FAILED))
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["step"] == 500
    assert json.loads((tmp_path / RESULT_FILE).read_text())["status"] == "failed"
