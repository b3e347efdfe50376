"""A DDP job, as `python -m jobs.run` runs it, whose other rank is at fault: its own error is the
job's (rank 0 meets only the collective it broke), and ranks that end with other weights than rank
0 are said in the job's warnings (they had succeeded without a word)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.test_resume_and_distribution import SLOW_PLUGIN, Job, Runner, spec_for

pytestmark = pytest.mark.xdist_group("ddp_rank_faults")

# Fails on rank 1 alone, after a few steps: a fault of that rank's own (a file only it reads).
RANK_FAULT_PLUGIN = """
import os

import torch


class RankOneFails(torch.optim.SGD):
    def __init__(self, params, lr: float = 0.05):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps > 3 and os.environ.get("OPTLAB_DDP_RANK") == "1":
            raise ValueError("RANK-LOCAL FAULT: scratch file unreadable")
        return super().step(closure)
"""

# Steps by a value that differs between processes (here the rank): the replicas part at once.
PER_PROCESS_PLUGIN = """
import os

import torch


class PerProcessStep(torch.optim.SGD):
    def __init__(self, params, lr: float = 0.05):
        super().__init__(params, lr=lr * (1 + int(os.environ.get("OPTLAB_DDP_RANK", "0"))))
"""

# Rank 0's checkpoint publication outlasts the ranks' collective timeout (an MLflow server that does
# not answer for minutes, against gloo's 120 s; here 5 s, and 12 s of publication, to keep it short).
SLOW_PUBLICATION_PLUGIN = """
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import jobs.resume

_publish = jobs.resume.WorkdirCheckpoints.publish


def _slow_on_rank_0(self, path):
    if os.environ.get("OPTLAB_DDP_RANK") == "0":
        time.sleep(12)
    return _publish(self, path)


jobs.resume.WorkdirCheckpoints.publish = _slow_on_rank_0


class SlowPublication(torch.optim.SGD):
    def __init__(self, params, lr: float = 0.05):
        super().__init__(params, lr=lr)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=5))  # the ranks have joined
"""

DDP = {"strategy": "ddp", "devices": 2}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("ddp-faults")
    plugins = root / "plugins"
    plugins.mkdir()
    (plugins / "rank_fault.py").write_text(RANK_FAULT_PLUGIN)
    (plugins / "per_process.py").write_text(PER_PROCESS_PLUGIN)
    (plugins / "slow_momentum.py").write_text(SLOW_PLUGIN)
    (plugins / "slow_publication.py").write_text(SLOW_PUBLICATION_PLUGIN)
    runner = Runner(root, "", plugins)
    started = {
        name: runner.start(
            name,
            spec_for("torch", optimizer={"name": optimizer}, distribution=DDP, steps=10, checkpoint_every=5),
            tracked=False,
        )
        for name, optimizer in (
            ("fault", "rank_one_fails"),
            ("drift", "per_process_step"),
            ("slow-publication", "slow_publication"),
        )
    }
    started["stopped"] = runner.start(
        "stopped", spec_for("torch", distribution=DDP, steps=400), tracked=False
    )
    yield started
    for job in started.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


def test_a_ranks_own_fault_is_the_ddp_jobs_error(jobs: dict[str, Job]) -> None:
    result = jobs["fault"].result()
    assert result["status"] == "failed"
    error = result["error"]
    assert error["type"] == "ValueError", error
    assert error["message"].startswith(
        "DDP rank 1 of 2 did not succeed: RANK-LOCAL FAULT: scratch file unreadable"
    )
    assert "; rank 0 then: " in error["message"]  # what rank 0 met, as context
    assert "raise ValueError" in error["traceback"]  # rank 1's traceback, not rank 0's


def test_ranks_that_end_with_other_weights_are_a_warning_of_the_ddp_job(jobs: dict[str, Job]) -> None:
    result = jobs["drift"].result()
    assert result["status"] == "succeeded", result.get("error")
    rank_1 = json.loads((jobs["drift"].workdir / "rank-1" / "result.json").read_text())
    assert rank_1["params_sha256"] != result["params_sha256"]
    (warning,) = [w for w in result["warnings"] if w.startswith("DDP rank 1 of 2 ended with other weights")]
    assert "`distributed` check" in warning
    assert warning in Path(jobs["drift"].log).read_text()  # in the job's log too


def test_a_rank_stopped_by_sigterm_from_outside_fails_the_ddp_job_as_killed_so_it_is_retried(
    jobs: dict[str, Job],
) -> None:
    """A rank handles SIGTERM (a cancelled result, exit code 1): it had failed the job for good, where
    a SIGTERM to rank 0, or a -15, is retried (OPTLAB_JOB_RETRIES)."""
    job = jobs["stopped"]
    deadline = time.monotonic() + 120
    while job.progress().get("step", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    (rank_1,) = Path(f"/proc/{job.process.pid}/task/{job.process.pid}/children").read_text().split()
    os.kill(int(rank_1), signal.SIGTERM)  # an operator's, a container runtime's
    result = job.result()
    assert result["status"] == "failed"
    assert result["error"]["type"] == "RankKilled", result["error"]
    assert result["error"]["message"].startswith(
        "DDP rank 1 of 2 was stopped by a SIGTERM it was sent from outside"
    )


def test_the_other_ranks_wait_for_rank_0s_checkpoint_publication_past_the_collective_timeout(
    jobs: dict[str, Job],
) -> None:
    """Rank 0 waits for its last checkpoint's publication before it takes the next one; the other
    ranks, in the next step's collective meanwhile, timed out there and failed the job for good."""
    result = jobs["slow-publication"].result()
    assert result["status"] == "succeeded", result.get("error")
    assert [c["step"] for c in result["checkpoints"]] == [5, 10]
