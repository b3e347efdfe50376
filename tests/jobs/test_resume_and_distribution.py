"""Jobs that survive and jobs on several devices, as `python -m jobs.run` runs them against a real
MLflow server: exact resume in the same run for every style, no point logged twice, the
nondeterminism record, a missing checkpoint failing clearly, DDP and MirroredStrategy on CPU.

Every process pays seconds of imports, so they all start together in one module fixture (the
resumed attempts as soon as their first attempt ended) and each test waits only for its own.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.resume import earlier_checkpoints, fetch_checkpoint, readable_checkpoint
from tests.conftest import ROOT
from tests.service.durable_helpers import mlflow_server

pytestmark = pytest.mark.xdist_group("resume_and_distribution")

JOB_TIMEOUT_S = 300  # a safety net on a loaded machine
STEPS = 40
# DDP ranks and MirroredStrategy replicas each take half the batch: the gradient the optimizer sees
# is the mean of two half-batch means instead of one full-batch mean, equal in exact arithmetic but
# summed in another order in float32 (differences ~1e-7 relative per step). Over 40 Adam steps on
# this small MLP that stays well below 1e-4 in every parameter and in the losses; a real fault (a
# rank on other data, gradients summed instead of averaged) moves them by 1e-2 and more.
ONE_DEVICE_TOLERANCE = 1e-4

# SGD with momentum that takes its time, so a job can be killed mid-run with `kill -9`.
SLOW_PLUGIN = """
import time

import torch


class SlowMomentum(torch.optim.SGD):
    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9):
        super().__init__(params, lr=lr, momentum=momentum)

    def step(self, closure=None):
        time.sleep(0.06)
        return super().step(closure)
"""


# torch's LBFGS, whose strong-Wolfe line search steps by the loss the closure returns.
LINE_SEARCH_PLUGIN = """
import torch


class LineSearchLbfgs(torch.optim.LBFGS):
    pass
"""


# A line search that runs backward itself on the loss its closure returns with the graph (torchmin's
# Minimizer's contract): under DDP that loss is the ranks' mean, and its gradient DDP's average.
OWN_BACKWARD_PLUGIN = """
import torch


class OwnBackwardLineSearch(torch.optim.Optimizer):
    def __init__(self, params, lr=2.0):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
            loss.backward()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        start = [p.clone() for p in params]
        grads = [p.grad.clone() for p in params]
        slope = sum(float((g * g).sum()) for g in grads)
        rate = self.param_groups[0]["lr"]
        for _ in range(10):
            for p, p0, g in zip(params, start, grads):
                p.copy_(p0 - rate * g)
            with torch.enable_grad():
                trial = float(closure())
            if trial <= float(loss) - 1e-4 * rate * slope:
                break
            rate /= 2
        return loss.detach()
"""


def spec_for(style: str, **overrides: Any) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"name": "adam", "params": {"lr": 0.003}}
    if style == "torch":
        optimizer = {"name": "slow_momentum", "params": {"lr": 0.05}}
    else:
        optimizer["style"] = style
    return {
        "framework": "torch" if style == "torch" else "tensorflow",
        "workload": {"name": "digits_mlp"},
        "optimizer": optimizer,
        "schedule": {"name": "cosine", "params": {"warmup_steps": 5}},
        "steps": STEPS,
        "batch_size": 32,
        "checkpoint_every": 10,
        "eval_every": 10,
        "device": "cpu",
        "experiment": f"resume-{style}",
        **overrides,
    }


@dataclass
class Job:
    workdir: Path
    log: Path
    process: subprocess.Popen[bytes]

    def result(self) -> dict[str, Any]:
        self.process.wait(JOB_TIMEOUT_S)
        try:
            return dict(json.loads((self.workdir / "result.json").read_text()))
        except OSError:
            raise AssertionError(f"no result.json; see {self.log}:\n{self.log.read_text()[-3000:]}") from None

    def progress(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.workdir / "progress.json").read_text()))
        except (OSError, ValueError):
            return {}


class Runner:
    def __init__(self, root: Path, tracking_uri: str, plugins: Path) -> None:
        self.root, self.tracking_uri = root, tracking_uri
        self.env = {
            k: v for k, v in os.environ.items() if k not in {"MLFLOW_TRACKING_URI", "OPTLAB_CHECKPOINT_DIR"}
        }
        self.env.update({"OMP_NUM_THREADS": "1", "OPTLAB_PLUGIN_DIRS": str(plugins), "PYTHONPATH": str(ROOT)})

    def start(
        self,
        name: str,
        spec: dict[str, Any],
        *args: str,
        tracked: bool = True,
        env: dict[str, str] | None = None,
    ) -> Job:
        spec_path = self.root / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        workdir, log = self.root / name, self.root / f"{name}.log"
        tracking = ["--tracking-uri", self.tracking_uri] if tracked else []
        command = [
            sys.executable,
            "-m",
            "jobs.run",
            str(spec_path),
            "--workdir",
            str(workdir),
            *tracking,
            *args,
        ]
        with open(log, "wb") as output:
            process = subprocess.Popen(
                command, cwd=ROOT, env={**self.env, **(env or {})}, stdout=output, stderr=subprocess.STDOUT
            )
        return Job(workdir, log, process)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow server (SQLite, artifacts served by the server, as `optlab serve` runs it)."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


STYLES = ("torch", "keras", "tf_legacy")


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory, tracking_uri: str, client: Any
) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("resume")
    plugins = root / "plugins"
    plugins.mkdir()
    (plugins / "slow_momentum.py").write_text(SLOW_PLUGIN)
    (plugins / "line_search.py").write_text(LINE_SEARCH_PLUGIN)
    (plugins / "own_backward.py").write_text(OWN_BACKWARD_PLUGIN)
    runner = Runner(root, tracking_uri, plugins)
    # A run with no checkpoint in its artifacts, for the missing reference.
    experiment = client.create_experiment("resume-missing")
    empty_run = client.create_run(experiment).info.run_id
    started: dict[str, Job] = {}
    # The Keras styles' straight runs are tracked: their resumed attempts start from the step-10
    # checkpoint in the run, recompute every later step and must log none of them again. torch's
    # first attempt is killed mid-run instead (below), so its resumed attempt logs the rest.
    started["straight-torch"] = runner.start("straight-torch", spec_for("torch"), tracked=False)
    for style in STYLES[1:]:
        started[f"straight-{style}"] = runner.start(f"straight-{style}", spec_for(style))
    # torch checkpoints go to a shared folder (the option), the Keras ones to the run (the default).
    started["first-torch"] = runner.start(
        "first-torch", spec_for("torch"), "--job-id", "7", env=shared_folder(root)
    )
    # Their runs keep the 2 newest checkpoints: torch's (files) and Keras's (folders), in a run of their
    # own; resumed-tf_legacy's below, in a run whose first attempt kept every one.
    for name, style, strategy in (("ddp", "torch", "ddp"), ("mirrored", "keras", "mirrored")):
        distribution = {"strategy": strategy, "devices": 2}
        spec = spec_for(style, distribution=distribution, experiment=name)
        started[name] = runner.start(name, spec, env=KEEP_TWO)
    line_search = {
        "name": "line_search_lbfgs",
        "params": {"lr": 0.5, "max_iter": 4, "line_search_fn": "strong_wolfe"},
    }
    ddp = {"strategy": "ddp", "devices": 2}
    started["ddp-line-search"] = runner.start(
        "ddp-line-search", spec_for("torch", optimizer=line_search, distribution=ddp, steps=10), tracked=False
    )
    started["ddp-own-backward"] = runner.start(
        "ddp-own-backward",
        spec_for("torch", optimizer={"name": "own_backward_line_search"}, distribution=ddp, steps=10),
        tracked=False,
    )
    missing = f"runs:/{empty_run}/checkpoints/step-00000010.pt"
    started["missing"] = runner.start(
        "missing", spec_for("torch"), "--resume", missing, "--resume-run-id", empty_run, "--attempt", "2"
    )
    try:
        started["resumed-torch"] = resume_after_kill(runner, started["first-torch"])
        started["fallback-torch"] = resume_past_a_damaged_copy(runner, started["first-torch"])
        for style in STYLES[1:]:
            started[f"resumed-{style}"] = resume_from_first_checkpoint(
                runner, f"resumed-{style}", started[f"straight-{style}"], spec_for(style),
                env=KEEP_TWO if style == "tf_legacy" else None,
            )  # fmt: skip
        yield started
    finally:
        for job in started.values():
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()


KEEP_TWO = {"OPTLAB_KEEP_CHECKPOINTS": "2"}


def resume_from_first_checkpoint(
    runner: Runner, name: str, first: Job, spec: dict[str, Any], env: dict[str, str] | None = None
) -> Job:
    """Another attempt of `first`'s job (`spec`), once it ended, from its first checkpoint in its run."""
    result = first.result()
    assert result["status"] == "succeeded", result.get("error")
    return runner.start(
        name,
        spec,
        "--resume", result["checkpoints"][0]["path"], "--resume-run-id", result["mlflow"]["run_id"],
        "--attempt", "2", env=env,
    )  # fmt: skip


def resume_after_kill(runner: Runner, first: Job) -> Job:
    """`kill -9` the first attempt once it reported a second verified checkpoint and trained past it,
    then resume from that checkpoint (in the shared folder, as another worker would) in the same run."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        progress = first.progress()
        checkpoint = progress.get("checkpoint")
        if (
            checkpoint
            and checkpoint["step"] >= 20
            and progress["step"] > checkpoint["step"]
            and progress.get("mlflow")
        ):
            break
        assert first.process.poll() is None, f"the first attempt ended before it was killed; see {first.log}"
        assert time.monotonic() < deadline, "no checkpoint reported in time"
        time.sleep(0.02)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    folder = Path(shared_folder(runner.root)["OPTLAB_CHECKPOINT_DIR"]) / "7" / "attempt-1"
    assert checkpoint["ok"] and Path(checkpoint["path"]).parent == folder
    (first.workdir / "killed-at.json").write_text(json.dumps(progress))
    return runner.start(
        "resumed-torch",
        spec_for("torch"),
        "--resume", checkpoint["path"], "--resume-run-id", progress["mlflow"]["run_id"],
        "--job-id", "7", "--attempt", "2", env=shared_folder(runner.root),
    )  # fmt: skip


def resume_past_a_damaged_copy(runner: Runner, first: Job) -> Job:
    """The killed attempt's shared folder copied, with one byte of its last reported checkpoint
    flipped (torch.load would read it without a word), resumed from untracked."""
    killed = json.loads((first.workdir / "killed-at.json").read_text())
    folder = runner.root / "damaged-copy"
    shutil.copytree(Path(killed["checkpoint"]["path"]).parent, folder)
    latest = folder / Path(killed["checkpoint"]["path"]).name
    flipped = bytearray(latest.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    latest.write_bytes(bytes(flipped))
    return runner.start("fallback-torch", spec_for("torch"), "--resume", str(latest), tracked=False)


def shared_folder(root: Path) -> dict[str, str]:
    return {"OPTLAB_CHECKPOINT_DIR": str(root / "shared-checkpoints")}


@pytest.mark.parametrize("style", STYLES)
def test_a_resumed_job_ends_bitwise_like_a_straight_run_in_the_same_mlflow_run(
    style: str, jobs: dict[str, Job], client: Any
) -> None:
    straight, resumed = jobs[f"straight-{style}"].result(), jobs[f"resumed-{style}"].result()
    assert straight["status"] == "succeeded", straight.get("error")
    assert resumed["status"] == "succeeded", resumed.get("error")
    first = jobs["first-torch" if style == "torch" else f"straight-{style}"]
    first_run = json.loads((first.workdir / "progress.json").read_text())["mlflow"]["run_id"]
    assert resumed["mlflow"]["run_id"] == first_run
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["final"] == straight["final"]
    if style == "torch":
        killed = json.loads((jobs["first-torch"].workdir / "killed-at.json").read_text())
        assert resumed["resumed_from_step"] == killed["checkpoint"]["step"]
    else:
        assert resumed["resumed_from_step"] == 10
    # The checkpoint it downloaded from the run is a copy: not left on the worker's disk.
    assert not (jobs[f"resumed-{style}"].workdir / "resumed-from").exists()

    run = client.get_run(first_run)
    assert run.info.status == "FINISHED"
    assert run.data.tags["attempt"] == "2" and run.data.tags["framework"] == straight_framework(style)
    assert run.data.params["steps"] == str(STEPS)
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run for the job
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        steps = sorted(m.step for m in client.get_metric_history(first_run, key))
        assert steps == list(range(STEPS)), f"{key}: every step exactly once"
    timed = [m.step for m in client.get_metric_history(first_run, "perf/step_time_ms")]  # once a flush
    assert len(timed) == len(set(timed)) and max(timed) == STEPS - 1, timed

    record = resumed["resume"]
    assert record["from_step"] == resumed["resumed_from_step"]
    assert record["points_differing"] == 0 and record["max_abs_difference"] == 0.0  # CPU: bitwise
    if style != "torch":  # steps 10..39 recomputed: at least loss, lr and grad norm of each compared
        assert record["points_compared"] >= 3 * (STEPS - 10) and record["last_logged_step"] == STEPS - 1
        assert resumed["checkpoints"][-1]["path"] == f"runs:/{first_run}/checkpoints/step-{STEPS:08d}"
    assert client.get_run(first_run).data.metrics["resume/points_differing"] == 0


def straight_framework(style: str) -> str:
    return "torch" if style == "torch" else "tensorflow"


def test_a_damaged_last_checkpoint_is_passed_over_for_the_one_before_it(jobs: dict[str, Job]) -> None:
    killed = json.loads((jobs["first-torch"].workdir / "killed-at.json").read_text())["checkpoint"]
    straight, fallback = jobs["straight-torch"].result(), jobs["fallback-torch"].result()
    assert fallback["status"] == "succeeded", fallback.get("error")
    assert fallback["resumed_from_step"] == killed["step"] - 10  # the one the shared folder keeps before it
    assert fallback["params_sha256"] == straight["params_sha256"] and fallback["final"] == straight["final"]
    name = Path(killed["path"]).name
    assert fallback["warnings"][0].startswith(
        f"checkpoint {name}, the job's last verified one, is damaged: the bytes of "
    )
    assert (
        f"Resumed from step-{killed['step'] - 10:08d}.pt, the newest earlier verified"
        in fallback["warnings"][0]
    )


def test_a_runs_earlier_checkpoints_are_listed_from_its_artifacts(
    jobs: dict[str, Job], tracking_uri: str
) -> None:
    run_id = jobs["straight-keras"].result()["mlflow"]["run_id"]
    prefix = f"runs:/{run_id}/checkpoints/step-"
    assert earlier_checkpoints(f"{prefix}00000030", tracking_uri=tracking_uri) == [
        f"{prefix}00000020",
        f"{prefix}00000010",
    ]


@pytest.mark.parametrize(("name", "suffix"), [("ddp", ".pt"), ("mirrored", ""), ("resumed-tf_legacy", "")])
def test_a_run_keeps_the_newest_checkpoints_it_is_told_to_an_earlier_attempts_older_ones_removed_too(
    name: str, suffix: str, jobs: dict[str, Job], client: Any
) -> None:
    result = jobs[name].result()
    assert result["status"] == "succeeded", result.get("error")
    run_id = result["mlflow"]["run_id"]
    kept = [f"checkpoints/step-{step:08d}{suffix}" for step in (30, 40)]
    assert [info.path for info in client.list_artifacts(run_id, "checkpoints")] == kept
    if not suffix:  # a Keras checkpoint is a folder: removed whole, and the ones kept are whole
        assert client.list_artifacts(run_id, "checkpoints/step-00000020") == []
        assert all(client.list_artifacts(run_id, folder) for folder in kept)
    assert result["checkpoints"][-1]["path"] == f"runs:/{run_id}/{kept[-1]}"
    assert "OPTLAB_KEEP_CHECKPOINTS" not in jobs[name].log.read_text()  # no warning: removed as told
    # Nor a copy of the last one left in the job's folder (the run holds it), nor in a DDP job's other
    # rank's (rank 0's is the job's).
    assert list((jobs[name].workdir / "checkpoints").iterdir()) == []
    assert list(jobs[name].workdir.glob("rank-*/checkpoints/*")) == []


def test_a_job_whose_checkpoints_are_not_in_a_run_keeps_its_last_ones(
    jobs: dict[str, Job], tmp_path: Path
) -> None:
    """Untracked, its folder holds the job's only copy; the shared folder keeps the last two, and
    drops an earlier attempt's once the job has succeeded."""
    assert jobs["straight-torch"].result()["status"] == "succeeded"
    assert [p.name for p in (jobs["straight-torch"].workdir / "checkpoints").iterdir()] == [
        "step-00000040.pt"
    ]
    assert jobs["resumed-torch"].result()["status"] == "succeeded"
    shared = (
        Path(shared_folder(jobs["resumed-torch"].workdir.parent)["OPTLAB_CHECKPOINT_DIR"]) / "7" / "attempt-2"
    )
    assert sorted(p.name for p in shared.iterdir()) == ["step-00000030.pt", "step-00000040.pt"]
    # The killed attempt's folder goes once the job has succeeded: no attempt resumes from it then.
    assert sorted(p.name for p in shared.parent.iterdir()) == ["attempt-2"]


def test_an_attempt_whose_checkpoint_its_run_no_longer_keeps_resumes_from_the_newest_it_does(
    jobs: dict[str, Job], tracking_uri: str, tmp_path: Path
) -> None:
    """As when a worker killed between two reports recorded a checkpoint the run removed since."""
    result = jobs["ddp"].result()
    gone = result["checkpoints"][0]["path"]  # step 10, removed from the run once step 30 was published
    point = readable_checkpoint(
        gone, damage=lambda path: None, into=tmp_path / "x", tracking_uri=tracking_uri
    )
    assert point.path.name == "step-00000040.pt"
    assert point.warnings == (
        "checkpoint step-00000010.pt, the last one the job's worker knew of, is no longer in its run; "
        "the newest the run holds is step-00000040.pt (each one in a run was verified before it was "
        "published): resumed from it",
    )


def test_a_resume_whose_checkpoint_is_missing_fails_clearly(jobs: dict[str, Job], client: Any) -> None:
    result = jobs["missing"].result()
    assert result["status"] == "failed"
    assert result["error"]["type"] == "FileNotFoundError"
    assert "--resume: checkpoint runs:/" in result["error"]["message"]
    assert "step-00000010.pt" in result["error"]["message"]
    assert client.get_run(result["mlflow"]["run_id"]).info.status == "FAILED"


def last_checkpoint(result: dict[str, Any], into: Path, tracking_uri: str) -> Path:
    """The job's last verified checkpoint: downloaded from its MLflow run (a tracked job keeps no
    copy in its folder), or in its folder (an untracked one)."""
    return fetch_checkpoint(result["checkpoints"][-1]["path"], into=into, tracking_uri=tracking_uri)


def test_a_ddp_job_matches_one_device_with_its_checkpoints_verified_on_every_rank(
    jobs: dict[str, Job], client: Any, tracking_uri: str, tmp_path: Path
) -> None:
    import torch

    ddp, single = jobs["ddp"].result(), jobs["straight-torch"].result()
    assert ddp["status"] == "succeeded", ddp.get("error")
    assert ddp["device"] == "cpu (ddp rank 0 of 2)"
    assert [c["step"] for c in ddp["checkpoints"]] == [10, 20, 30, 40] and ddp["checkpoints_verified"] == 4
    rank_1 = json.loads((jobs["ddp"].workdir / "rank-1" / "result.json").read_text())
    assert rank_1["status"] == "succeeded" and rank_1["checkpoints_verified"] == 4
    assert rank_1["params_sha256"] == ddp["params_sha256"]  # the replicas hold bitwise the same weights

    def weights(name: str) -> dict[str, np.ndarray]:
        path = last_checkpoint(jobs[name].result(), tmp_path / name, tracking_uri)
        assert path.name == f"step-{STEPS:08d}.pt"
        saved = torch.load(path, weights_only=True)
        return {name: tensor.numpy() for name, tensor in saved["model"].items()}

    assert_close(weights("ddp"), weights("straight-torch"), ddp, single)
    assert_one_run(client, ddp)


def test_a_ddp_job_whose_optimizer_steps_by_the_loss_keeps_its_ranks_together(jobs: dict[str, Job]) -> None:
    """LBFGS's line search decides by the loss the closure returns: each rank's closure returns the
    whole batch's loss (the mean over the ranks), as each gets the averaged gradient, or the ranks'
    line searches part and so do their weights."""
    job = jobs["ddp-line-search"]
    result = job.result()
    assert result["status"] == "succeeded", result.get("error")
    rank_1 = json.loads((job.workdir / "rank-1" / "result.json").read_text())
    assert rank_1["params_sha256"] == result["params_sha256"]


def test_a_ddp_job_whose_optimizer_runs_backward_on_the_closures_loss_keeps_its_ranks_together(
    jobs: dict[str, Job],
) -> None:
    job = jobs["ddp-own-backward"]
    result = job.result()
    assert result["status"] == "succeeded", result.get("error")
    assert result["checkpoints_verified"] == len(result["checkpoints"]) == 1
    assert result["final"]["train_loss"] < 2.2  # moved off the untrained loss (about 2.3) in 10 steps
    rank_1 = json.loads((job.workdir / "rank-1" / "result.json").read_text())
    assert rank_1["params_sha256"] == result["params_sha256"]


def test_a_mirrored_job_matches_one_device_with_its_checkpoints_verified(
    jobs: dict[str, Job], client: Any, tracking_uri: str, tmp_path: Path
) -> None:
    mirrored, single = jobs["mirrored"].result(), jobs["straight-keras"].result()
    assert mirrored["status"] == "succeeded", mirrored.get("error")
    assert mirrored["device"] == "/CPU:0,/CPU:1 (mirrored)"
    assert mirrored["checkpoints_verified"] == 4

    def weights(name: str) -> dict[str, np.ndarray]:
        import h5py

        path = last_checkpoint(jobs[name].result(), tmp_path / name, tracking_uri)
        assert path.name == f"step-{STEPS:08d}"
        archive = zipfile.ZipFile(path / "model.keras")
        found: dict[str, np.ndarray] = {}
        with h5py.File(io.BytesIO(archive.read("model.weights.h5"))) as weights_file:
            weights_file["layers"].visititems(
                lambda name, item: found.update({name: np.array(item)}) if hasattr(item, "shape") else None
            )
        return found

    assert_close(weights("mirrored"), weights("straight-keras"), mirrored, single)
    assert_one_run(client, mirrored)


def assert_close(
    replicated: dict[str, np.ndarray],
    single: dict[str, np.ndarray],
    result: dict[str, Any],
    one: dict[str, Any],
) -> None:
    assert replicated.keys() == single.keys() and replicated
    apart = max(float(np.max(np.abs(replicated[k] - single[k]))) for k in single)
    print(f"max abs parameter difference to one device: {apart:.3g}")
    assert apart <= ONE_DEVICE_TOLERANCE
    for key in ("train_loss", "val_loss"):
        assert abs(result["final"][key] - one["final"][key]) <= ONE_DEVICE_TOLERANCE * abs(one["final"][key])


def assert_one_run(client: Any, result: dict[str, Any]) -> None:
    run_id = result["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(STEPS))
    assert client.get_run(run_id).data.params["distribution.devices"] == "2"
