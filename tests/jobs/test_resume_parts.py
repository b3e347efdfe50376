"""The resume's small parts without processes: which points a resumed attempt skips and compares,
what the other DDP ranks are started with, where checkpoints go."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from jobs.checkpoint_files import checkpoint_leftovers
from jobs.distributed import rank_argv
from jobs.resume import (
    DamagedCheckpoint,
    MlflowCheckpoints,
    ResumedTracker,
    SharedFolderCheckpoints,
    WorkdirCheckpoints,
    checkpoint_store,
    checkpoints_to_keep,
    earlier_checkpoints,
    fetch_checkpoint,
    readable_checkpoint,
)
from jobs.tracking import Point


class Recorder:
    def __init__(self) -> None:
        self.points: list[tuple[str, float, int]] = []

    def metric(self, key: str, value: float, step: int) -> None:
        self.points.append((key, value, step))

    def metrics(self, points: Sequence[Point]) -> None:
        for point in points:
            self.metric(point.key, point.value, point.step)


def test_points_at_or_below_the_last_logged_step_are_compared_not_logged_again() -> None:
    logged = {
        "train/loss": {5: 1.0, 6: 0.9, 7: math.nan},
        "perf/step_time_ms": {6: 3.0, 7: 3.1},
        "val/loss": {5: 2.0},
    }
    inner = Recorder()
    tracker = ResumedTracker(inner, logged)
    for key, value, step in [
        ("train/loss", 0.9, 6),  # the same value: compared, equal
        ("train/loss", math.nan, 7),  # NaN again: equal
        ("train/loss", 0.8, 8),  # past the last logged step: logged
        ("perf/step_time_ms", 9.0, 7),  # a timing: skipped, never compared
        ("val/loss", 2.5, 5),  # differs by 0.5
        ("val/loss", 2.4, 10),
        ("train/lr", 0.1, 6),  # a key the run never had: logged
    ]:
        tracker.metric(key, value, step)
    assert inner.points == [("train/loss", 0.8, 8), ("val/loss", 2.4, 10), ("train/lr", 0.1, 6)]
    record = tracker.record(from_step=5)
    assert (record.points_skipped, record.points_compared, record.points_differing) == (4, 3, 1)
    assert record.max_abs_difference == 0.5
    assert record.last_logged_step == 7


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [
                "spec.json",
                "--workdir",
                "w",
                "--tracking-uri",
                "http://x",
                "--resume-run-id",
                "r",
                "--attempt",
                "2",
            ],
            ["spec.json", "--attempt", "2", "--workdir", "w/rank-1", "--resume", "local.pt"],
        ),
        (
            ["spec.json", "--resume=runs:/r/x", "--stop-after", "5"],
            ["spec.json", "--stop-after", "5", "--workdir", "w/rank-1", "--resume", "local.pt"],
        ),
    ],
)
def test_the_other_ranks_get_the_fetched_checkpoint_and_no_tracking(
    argv: list[str], expected: list[str]
) -> None:
    assert rank_argv(argv, Path("w/rank-1"), Path("local.pt")) == expected


class FakeRun:
    class info:
        run_id = "abc"


def test_the_shared_folder_wins_then_the_run_then_the_workdir(tmp_path: Path) -> None:
    shared = checkpoint_store(FakeRun(), job="7", attempt=2, environ={"OPTLAB_CHECKPOINT_DIR": str(tmp_path)})
    assert isinstance(shared, SharedFolderCheckpoints) and shared.folder == tmp_path / "7" / "attempt-2"
    assert isinstance(checkpoint_store(FakeRun(), job="7", attempt=2, environ={}), MlflowCheckpoints)
    assert isinstance(checkpoint_store(None, job="7", attempt=2, environ={}), WorkdirCheckpoints)


@pytest.mark.parametrize(("value", "kept"), [(None, None), ("", None), (" ", None), ("1", 1), (" 30 ", 30)])
def test_how_many_checkpoints_a_run_keeps(value: str | None, kept: int | None) -> None:
    environ = {} if value is None else {"OPTLAB_KEEP_CHECKPOINTS": value}
    assert checkpoints_to_keep(environ) == kept
    store = checkpoint_store(FakeRun(), job="7", attempt=1, environ=environ)
    assert isinstance(store, MlflowCheckpoints) and store.keep == kept


@pytest.mark.parametrize("value", ["0", "00", "-3", "2.5", "all", "1e3", "٣", "²"])
def test_a_number_of_checkpoints_to_keep_under_one_or_not_a_whole_number_is_refused(value: str) -> None:
    with pytest.raises(ValueError) as refused:
        checkpoints_to_keep({"OPTLAB_KEEP_CHECKPOINTS": value})
    assert str(refused.value) == (
        f"OPTLAB_KEEP_CHECKPOINTS={value!r}: a whole number of at least 1 (how many of a job's newest "
        "verified checkpoints its MLflow run keeps), or unset to keep every one"
    )


class RunWithCheckpoints:
    """A job's run on a tracking server: what is uploaded is listed, and removed through its
    artifact repository (this object too), whose removals fail with `refusal` when it is set."""

    class info:
        run_id = "abc"
        tracking_uri = "http://tracking.test"
        artifact_uri = "mlflow-artifacts:/1/abc/artifacts"

    def __init__(self, steps: Sequence[int]) -> None:
        self.client, self.delivery = self, SimpleNamespace(flush=lambda: None)
        self.names = [f"step-{step:08d}.pt" for step in steps]
        self.removed: list[str] = []
        self.refusal: Exception | None = None

    def log_artifact(self, path: Path, folder: str) -> None:
        self.names = sorted({*self.names, path.name})

    def list_artifacts(self, run_id: str, path: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(path=f"{path}/{name}") for name in self.names]

    def get_run(self, run_id: str) -> SimpleNamespace:
        return SimpleNamespace(info=self.info)

    def delete_artifacts(self, path: str) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.names.remove(path.rsplit("/", 1)[1])
        self.removed.append(path)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> RunWithCheckpoints:
    """Its artifact repository is the run itself; an earlier attempt left steps 10 to 40 in it."""
    import mlflow.store.artifact.artifact_repository_registry as registry

    found = RunWithCheckpoints([10, 20, 30, 40])
    monkeypatch.setattr(registry, "get_artifact_repository", lambda uri, tracking_uri=None: found)
    return found


def publish_steps(store: MlflowCheckpoints, folder: Path, steps: Sequence[int]) -> None:
    for step in steps:
        local = folder / f"step-{step:08d}.pt"
        local.write_bytes(b"x")
        assert store.publish(local) == f"runs:/abc/checkpoints/{local.name}"  # published all the same


def test_a_run_keeps_the_newest_checkpoints_up_to_the_one_just_published(
    tmp_path: Path, run: RunWithCheckpoints
) -> None:
    """An attempt resumed from step 10: the earlier attempt's 30 and 40 are newer than its 20, yet
    its 20 stays until it has two newer of its own (it writes over 30 and 40 as it gets there)."""
    store = MlflowCheckpoints(run, keep=2)
    publish_steps(store, tmp_path, [20])
    assert run.removed == []
    publish_steps(store, tmp_path, [30, 40])
    assert run.removed == ["checkpoints/step-00000010.pt", "checkpoints/step-00000020.pt"]
    assert run.names == ["step-00000030.pt", "step-00000040.pt"] and store.warnings == []


def http_error(status: int) -> requests.HTTPError:
    """What MLflow's artifact client raises for a server's refusal (its raise_for_status)."""
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(
        f"{status} Client Error: FORBIDDEN for url: http://tracking.test/x\n<html>", response=response
    )


def test_a_run_that_refuses_to_remove_checkpoints_keeps_them_and_the_job_says_so_once(
    tmp_path: Path, run: RunWithCheckpoints, capsys: pytest.CaptureFixture[str]
) -> None:
    run.refusal = http_error(403)
    store = MlflowCheckpoints(run, keep=1)
    publish_steps(store, tmp_path, [50])  # not tried again: a refusal is no blip
    assert store.keep is None
    publish_steps(store, tmp_path, [60])
    warning = (
        "OPTLAB_KEEP_CHECKPOINTS=1: could not remove the run's older checkpoints (HTTPError: 403 Client "
        "Error: FORBIDDEN for url: http://tracking.test/x); this attempt keeps every checkpoint from here"
    )
    assert store.warnings == [warning] and store.keep is None  # tried once: every one is kept
    assert capsys.readouterr().err == f"optlab: warning: {warning}\n"
    assert len(run.names) == 6


def test_a_server_that_gives_no_answer_has_the_removal_tried_again_with_the_next_checkpoint(
    tmp_path: Path, run: RunWithCheckpoints, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart: tried again; no answer twice in a row (each had MLflow's client retry for
    minutes on the publication's thread): not again, saying so."""
    store = MlflowCheckpoints(run, keep=2)
    run.refusal = requests.ConnectionError("connection refused")
    publish_steps(store, tmp_path, [50])
    assert store.keep == 2 and store.warnings == [] and capsys.readouterr().err == ""
    run.refusal = None
    publish_steps(store, tmp_path, [60])
    assert run.names == ["step-00000050.pt", "step-00000060.pt"]
    run.refusal = requests.ConnectionError("connection refused")
    publish_steps(store, tmp_path, [70])
    assert store.keep == 2 and store.warnings == []
    publish_steps(store, tmp_path, [80])
    assert store.keep is None and store.warnings == [
        "OPTLAB_KEEP_CHECKPOINTS=2: could not remove the run's older checkpoints (ConnectionError: "
        "connection refused); this attempt keeps every checkpoint from here"
    ]


def test_a_missing_local_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*step-9\.pt does not exist"):
        fetch_checkpoint(str(tmp_path / "step-9.pt"), into=tmp_path / "x", tracking_uri=None)


def test_the_shared_folder_keeps_the_checkpoint_before_the_latest(tmp_path: Path) -> None:
    """The worker may die knowing only the previous report: that checkpoint must still be there."""
    store = SharedFolderCheckpoints(tmp_path, "7", 1)
    assert store.folder is not None
    store.folder.mkdir(parents=True)
    paths = [store.folder / f"step-{step}.pt" for step in (10, 20, 30)]
    for previous, path in zip([None, *paths], paths, strict=False):
        path.write_bytes(b"x")
        store.publish(path)
        if previous is not None:
            store.retire(previous)
    assert sorted(p.name for p in store.folder.iterdir()) == ["step-20.pt", "step-30.pt"]


def test_earlier_attempts_leave_the_shared_folder_once_the_job_succeeded(tmp_path: Path) -> None:
    """Each killed attempt had left its last two checkpoints there for good (a probe found six files
    of one succeeded job). They go once the job has succeeded; not as this attempt publishes, since
    the store may still name one of them while the worker cannot relay this attempt's reports."""
    for attempt, steps in ((1, (10, 15)), (2, (20, 25))):
        earlier = tmp_path / "7" / f"attempt-{attempt}"
        earlier.mkdir(parents=True)
        for step in steps:
            (earlier / f"step-{step}.pt").write_bytes(b"x")
    (tmp_path / "8" / "attempt-1").mkdir(parents=True)  # another job's: not this one's to remove
    store = SharedFolderCheckpoints(tmp_path, "7", 3)
    assert store.folder is not None
    store.folder.mkdir(parents=True)
    paths = [store.folder / f"step-{step}.pt" for step in (30, 40, 50)]
    for previous, path in zip([None, *paths], paths, strict=False):
        path.write_bytes(b"x")
        store.publish(path)
        if previous is not None:
            store.retire(previous)
    assert sorted(p.name for p in (tmp_path / "7").iterdir()) == ["attempt-1", "attempt-2", "attempt-3"]
    store.remove_earlier_attempts()
    assert sorted(p.name for p in (tmp_path / "7").iterdir()) == ["attempt-3"]
    assert sorted(p.name for p in store.folder.iterdir()) == ["step-40.pt", "step-50.pt"]
    assert (tmp_path / "8" / "attempt-1").is_dir()


def damaged_when_named(*names: str) -> Callable[[Path], str | None]:
    return lambda path: "a flipped byte" if path.name in names else None


@pytest.fixture
def kept(tmp_path: Path) -> Path:
    """A folder as the shared one leaves it (and a few names that are not checkpoints)."""
    for name in ("step-00000010.pt", "step-00000020.pt", "step-00000030.pt", "step-00000040.pt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".step-00000035.pt.tmp").write_bytes(b"x")  # being written when the job died
    (tmp_path / "notes.txt").write_text("x")
    return tmp_path


def test_a_whole_last_checkpoint_is_the_one_resumed_from(kept: Path) -> None:
    point = readable_checkpoint(
        str(kept / "step-00000030.pt"), damage=damaged_when_named(), into=kept / "x", tracking_uri=None
    )
    assert point.path == kept / "step-00000030.pt" and point.warnings == ()


def test_earlier_checkpoints_are_the_older_ones_beside_it_newest_first(kept: Path) -> None:
    assert earlier_checkpoints(str(kept / "step-00000030.pt"), tracking_uri=None) == [
        f"{kept}/step-00000020.pt",
        f"{kept}/step-00000010.pt",
    ]
    assert earlier_checkpoints(str(kept / "model.pt"), tracking_uri=None) == []  # not a checkpoint's name


def test_an_ended_attempts_checkpoint_leftovers_are_all_but_the_one_a_retry_here_resumes_from(
    kept: Path,
) -> None:
    keras = kept / "step-00000050"  # a Keras checkpoint cut short mid-save: its model half written
    keras.mkdir()
    (keras / "partial-model.keras").write_bytes(b"x")
    (kept / "resumed-from").mkdir()
    everything = [kept / f"step-000000{step}0.pt" for step in (1, 2, 3, 4)] + [
        keras,
        kept / ".step-00000035.pt.tmp",
    ]
    # Its checkpoints are in its MLflow run, or these are a DDP job's other rank's: every one goes.
    assert sorted(checkpoint_leftovers(kept, keep=None)) == sorted(everything)
    # In its folder only: the one its progress names stays, for a retry on this host.
    reported = kept / "step-00000030.pt"
    left = checkpoint_leftovers(kept, keep=reported)
    assert sorted(left) == sorted(path for path in everything if path != reported)
    assert checkpoint_leftovers(kept / "nowhere", keep=None) == []


def test_a_damaged_last_checkpoint_is_passed_over_for_the_newest_earlier_whole_one(kept: Path) -> None:
    point = readable_checkpoint(
        str(kept / "step-00000030.pt"),
        damage=damaged_when_named("step-00000030.pt", "step-00000020.pt"),
        into=kept / "x",
        tracking_uri=None,
    )
    assert point.path == kept / "step-00000010.pt"
    assert point.warnings == (
        "checkpoint step-00000030.pt, the job's last verified one, is damaged: a flipped byte; "
        "step-00000020.pt is damaged too: a flipped byte. Resumed from step-00000010.pt, the newest "
        "earlier verified checkpoint that reads back whole: the steps since it were trained again",
    )


def test_when_no_checkpoint_reads_back_whole_the_resume_fails_naming_each(kept: Path) -> None:
    every = damaged_when_named(*(path.name for path in kept.iterdir()))
    with pytest.raises(DamagedCheckpoint) as raised:
        readable_checkpoint(str(kept / "step-00000020.pt"), damage=every, into=kept / "x", tracking_uri=None)
    assert str(raised.value) == (
        "checkpoint step-00000020.pt, the job's last verified one, is damaged: a flipped byte; "
        "step-00000010.pt is damaged too: a flipped byte"
    )
    with pytest.raises(
        DamagedCheckpoint, match=r"is damaged: a flipped byte; no earlier verified checkpoint"
    ):
        readable_checkpoint(str(kept / "step-00000010.pt"), damage=every, into=kept / "x", tracking_uri=None)
