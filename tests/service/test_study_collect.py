"""A study's jobs read back as `StudyRun`s (service/studies/collect.py), from store rows and a stand-in
MLflow client: what the summary needs from the job row besides the metric histories."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from jobs.result import JobStatus
from service.models import Job, Study
from service.studies.collect import collect_runs
from service.studies.summary import MetricPoint


class FakeMlflow:
    """get_run and get_metric_history for one run that logged val/loss at steps 10 and 20."""

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(
            info=SimpleNamespace(start_time=1_000), data=SimpleNamespace(metrics={"val/loss": 0})
        )

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return [SimpleNamespace(step=s, timestamp=1_000 + 500 * s, value=1.0 / s) for s in (20, 10)]


def job(
    job_id: int, status: JobStatus, *, attempt: int, result: dict[str, Any] | None, history: Any = None
) -> Job:
    return Job(
        id=job_id,
        status=status,
        attempt=attempt,
        result=result,
        mlflow={"run_id": f"run{job_id}"},
        attempt_history=history,
    )


def test_the_job_rows_medians_and_attempts_reach_the_runs() -> None:
    study = Study(
        id=1,
        name="s",
        spec={"steps": 300, "eval_every": 50, "seeds": [0, 1, 2]},
        members=[
            {"job_id": 1, "optimizer": "adam", "grid": {"lr": 0.001}, "seed": 0},
            {"job_id": 2, "optimizer": "adam", "grid": {"lr": 0.001}, "seed": 1},
            {"job_id": 3, "optimizer": "adam", "grid": {"lr": 0.001}, "seed": 2},
        ],
    )
    jobs = [
        job(  # the history holds the attempt that ended the job: no interruption
            1,
            JobStatus.SUCCEEDED,
            attempt=1,
            result={"step_time_ms_median": 4.5, "optimizer_step_ms_median": 1},
            history=[{"attempt": 1, "step": 300, "ended": "succeeded"}],
        ),
        job(  # a result without them; resumed after its first attempt reached step 120
            2,
            JobStatus.SUCCEEDED,
            attempt=2,
            result={"status": "succeeded"},
            history=[
                {"attempt": 1, "step": 120, "ended": "interrupted"},
                {"attempt": 2, "step": 300, "ended": "succeeded"},
            ],
        ),
    ]  # job 3 has no row: cancelled before it was stored
    first, second, third = collect_runs(FakeMlflow(), study, jobs)
    assert (first.step_time_ms_median, first.optimizer_step_ms_median, first.attempt) == (4.5, 1.0, 1)
    assert (second.step_time_ms_median, second.optimizer_step_ms_median, second.attempt) == (None, None, 2)
    assert (third.status, third.history, third.attempt) == ("cancelled", {}, 1)
    assert (first.interrupted_at, second.interrupted_at, third.interrupted_at) == (None, 120, None)
    assert first.history["val/loss"] == [MetricPoint(10, 5.0, 0.1), MetricPoint(20, 10.0, 0.05)]


def test_the_result_says_how_the_job_resumed_how_it_timed_and_what_it_trained() -> None:
    study = Study(
        id=1,
        name="s",
        spec={"steps": 3000, "eval_every": 500, "seeds": [0]},
        members=[
            {"job_id": job_id, "optimizer": "sgd", "grid": {"lr": 0.05}, "seed": 0}
            for job_id in (27, 32, 291)
        ],
    )
    jobs = [
        job(
            27, JobStatus.SUCCEEDED, attempt=2, result={"resume": {"from_step": 1000}, "params_sha256": "ab"}
        ),
        job(32, JobStatus.SUCCEEDED, attempt=1, result={"style": "keras", "resumed_from_step": None}),
        job(291, JobStatus.FAILED, attempt=3, result=None),  # killed before it wrote one
    ]
    torch, keras, killed = collect_runs(FakeMlflow(), study, jobs)
    assert (torch.resumed_from, torch.params_sha256, torch.update_timed_apart) == (1000, "ab", True)
    assert (keras.resumed_from, keras.params_sha256, keras.update_timed_apart) == (None, None, False)
    assert (killed.resumed_from, killed.update_timed_apart) == (None, True)
    assert (torch.new_run, killed.new_run) == (False, False)  # resumed in its run; no result to say


def test_a_job_that_ran_again_before_its_first_checkpoint_started_a_new_run() -> None:
    """The service probe's job 20: its worker was killed at step 24, before the first checkpoint, and the
    next attempt trained from step 0 in a new MLflow run (a resume in the same run records `resume`)."""
    study = Study(
        id=1,
        name="s",
        spec={"steps": 150, "eval_every": 25, "seeds": [0]},
        members=[
            {"job_id": job_id, "optimizer": "sgd", "grid": {"lr": 0.05}, "seed": 0} for job_id in (20, 21)
        ],
    )
    interrupted = [
        {"attempt": 1, "step": 24, "ended": "lease expired"},
        {"attempt": 2, "step": 150, "ended": "succeeded"},
    ]
    afresh = {"status": "succeeded", "resume": None, "resumed_from_step": None}
    same_run = {"status": "succeeded", "resume": {"from_step": 0}, "resumed_from_step": None}
    jobs = [
        job(20, JobStatus.SUCCEEDED, attempt=2, result=afresh, history=interrupted),
        job(21, JobStatus.SUCCEEDED, attempt=2, result=same_run, history=interrupted),
    ]
    new, resumed = collect_runs(FakeMlflow(), study, jobs)
    assert (new.interrupted_at, new.resumed_from, new.new_run) == (24, None, True)
    assert (resumed.interrupted_at, resumed.resumed_from, resumed.new_run) == (24, 0, False)


STOP_WHILE_FETCHING = """
import threading, time
from types import SimpleNamespace
from service.models import Study
from service.studies.collect import collect_runs

class NeverAnswers:
    def get_run(self, run_id):
        threading.Event().wait()  # a server that takes the connection and never answers

study = Study(id=1, name="s", spec={}, members=[{"job_id": 1, "optimizer": "adam", "grid": {}, "seed": 0}])
job = SimpleNamespace(id=1, mlflow={"run_id": "run1"})
threading.Thread(target=collect_runs, args=(NeverAnswers(), study, [job]), daemon=True).start()
time.sleep(0.5)
print("main thread done", flush=True)
"""


def test_a_process_whose_summary_waits_on_mlflow_still_exits() -> None:
    """The worker's study finalizer is a daemon thread: the fetches it starts must not hold the process
    at exit (an executor's threads are joined then), or a worker told to stop waits for the server."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STOP_WHILE_FETCHING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "main thread done" in done.stdout


def test_fetches_keep_their_order_and_raise_the_first_error() -> None:
    from service.studies.collect import map_on_daemon_threads

    assert map_on_daemon_threads(lambda n: n * n, list(range(20)), 8) == [n * n for n in range(20)]
    assert map_on_daemon_threads(lambda n: n, [], 8) == []

    def refuse(n: int) -> int:
        if n in (3, 7):
            raise ValueError(f"run {n} refused")
        return n

    import pytest

    with pytest.raises(ValueError, match="run 3 refused"):
        map_on_daemon_threads(refuse, list(range(10)), 4)


class LongRunMlflow:
    """One run of per-step metrics: the summary reads train/loss, val/*, perf/* and its selection
    metric point by point, and of the rest (train/lr, train/grad_norm, optim/*) only the last value."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def get_run(self, run_id: str) -> Any:
        keys = [
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "val/loss",
            "perf/step_time_ms",
            "optim/lr",
            "my/score",
        ]
        latest = [SimpleNamespace(key=key, step=300, timestamp=2_000, value=0.5) for key in keys]
        return SimpleNamespace(
            info=SimpleNamespace(start_time=1_000),
            data=SimpleNamespace(metrics={m.key: m.value for m in latest}, _metric_objs=latest),
        )

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        self.asked.append(key)
        return [SimpleNamespace(step=s, timestamp=1_000 + s, value=float(s)) for s in (1, 2, 300)]


def test_only_the_metrics_read_point_by_point_are_fetched_whole_and_runs_read_are_counted() -> None:
    from service.studies.collect import ReadProgress

    study = Study(
        id=1,
        name="s",
        spec={},
        members=[{"job_id": n, "optimizer": "adam", "grid": {}, "seed": n} for n in (1, 2)],
    )
    jobs = [job(n, JobStatus.SUCCEEDED, attempt=1, result={}) for n in (1, 2)]
    client, progress = LongRunMlflow(), ReadProgress()
    first, _ = collect_runs(client, study, jobs, also_whole=frozenset({"my/score"}), progress=progress)
    assert sorted(set(client.asked)) == ["my/score", "perf/step_time_ms", "train/loss", "val/loss"]
    assert [p.step for p in first.history["train/loss"]] == [1, 2, 300]
    assert first.history["train/lr"] == [MetricPoint(step=300, seconds=1.0, value=0.5)]
    assert (progress.read, progress.total) == (2, 2)


def test_a_slow_summary_says_how_many_runs_it_read_and_blames_mlflow_only_where_none_came() -> None:
    from service.studies.collect import ReadProgress
    from service.studies.finalize import _slow_note

    progress = ReadProgress()
    assert _slow_note(30, progress, -1, "http://m:5000") == (
        "the summary has been in the making for 30 s: it reads the jobs' runs from MLflow at "
        "http://m:5000, whose client waits many minutes for a server that does not answer before it gives up"
    )
    progress.total, progress.read = 12, 5
    assert _slow_note(60, progress, 3, "http://m:5000") == (
        "the summary has been in the making for 60 s: 5 of 12 runs read from MLflow at http://m:5000"
    )
    progress.read = 12
    assert _slow_note(120, progress, 12, "http://m:5000") == (
        "the summary has been in the making for 120 s: all 12 runs read from MLflow at http://m:5000; the "
        "report is being made and logged to the study's parent run"
    )
    progress.read = 5
    assert _slow_note(90, progress, 5, "http://m:5000").endswith(
        "5 of 12 runs read from MLflow at http://m:5000, none in the last 30 s (a run of many steps takes "
        "a while; MLflow's client also waits many minutes for a server that does not answer before it "
        "gives up)"
    )
