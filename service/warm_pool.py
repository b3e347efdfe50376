"""The warm pool: at most one pre-started job process per slot, its framework already imported.

A cold job spends seconds before its first step importing torch or TensorFlow, its driver, MLflow
and the rest (benchmarks/startup.py). A warm process (`python -m jobs.warm STYLE`) has done that
before the job is claimed; handed the job's `jobs.run` arguments it runs the job exactly as
`python -m jobs.run` would and exits, one job per process.

Which style a slot keeps warm: the style of the last job it ran (torch before its first job, when
the worker can run torch). Jobs of one study, or one user's series, come in runs of one framework,
so the last job is a good guess for the next; guessing from the queue instead would cost a store
query per poll and guess wrong whenever another worker claims that job first. A guess that misses
costs nothing but the idle process: the job starts cold, and the slot warms the new style.

A warm process is started with exactly the environment a job on its slot gets (the slot's
CUDA_VISIBLE_DEVICES, set before the framework could initialise CUDA; the thread count; the
legacy-Keras switch of `tf_legacy`) and is used only if that is still the job's environment (less
MLflow's private `_MLFLOW_*` variables, which MLflow sets on the worker itself). Like
a cold job it leads its own session (the worker's signals, the reaper and the memory limit work on
the session, not on the job's pid). It dies with the worker: it gets SIGTERM when the thread that
started it ends (PR_SET_PDEATHSIG), and an idle one also exits on end of file on stdin, which the
kernel gives it when the worker's end of the pipe closes, however the worker died. For the first,
only the worker's claim loop starts warm processes: it lives as long as the worker (a job's thread
ends with its job, which would kill the idle process it started).
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.processes import WarmOrder, start_in_own_group, style_environment, terminate_group
from jobs.spec import default_style

log = logging.getLogger("optlab.worker")

WARM_MODULE = "jobs.warm"


@dataclass
class WarmProcess:
    style: str  # the optimizer style it imported for: torch, keras or tf_legacy
    environment: dict[str, str]  # the environment it was started with
    process: subprocess.Popen[bytes]


class WarmPool:
    """The idle warm processes, one slot each, and the style each slot keeps warm next."""

    def __init__(self, job_python: str) -> None:
        self.job_python = job_python
        self.idle: dict[int, WarmProcess] = {}
        self.next_style: dict[int, str] = {}
        self.lock = threading.Lock()
        self.closed = False

    def fill(
        self, slots: Sequence[int], environment_of: Callable[[int], Mapping[str, str]], *, first_style: str
    ) -> None:
        """Start a warm process for each of `slots` that has none (only from the claim loop's thread),
        of the style its last job had, `first_style` before its first.

        Busy slots too, once their job has taken its first step (the worker says which): the
        process replacing the one the running job took is then ready for the slot's next job, the
        usual case when jobs queue up, without slowing that job's start on a host with few cores.
        """
        for slot in slots:
            with self.lock:
                # One that died idle (killed, out of memory) stays until the slot's next job finds
                # it dead and starts cold: a process that cannot start is retried once a job, not
                # once a poll.
                if self.closed or slot in self.idle:
                    continue
                style = self.next_style.get(slot, first_style)
            environment = style_environment(environment_of(slot), style)
            started = self._start(style, environment)
            with self.lock:
                if self.closed or slot in self.idle:  # closed meanwhile: not ours to keep
                    terminate_group(started.process, 0)
                    continue
                self.idle[slot] = started

    def take(self, slot: int, style: str, environment: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """The slot's idle process if it is still alive and was started for this job's style and
        environment, else None (the job starts cold). Either way the slot is left without an idle
        process, and the next one `fill` starts is warm for `style`."""
        with self.lock:
            warm = self.idle.pop(slot, None)
            self.next_style[slot] = style
        if warm is None:
            return None
        wanted = style_environment(environment, style)
        same = variables_that_matter(warm.environment) == variables_that_matter(wanted)
        if warm.process.poll() is None and warm.style == style and same:
            return warm.process
        if warm.process.poll() is None:
            why = "its style" if warm.style != style else "its environment changed"
            log.info("slot %s: warm %s process not used (%s); starting the job cold", slot, warm.style, why)
        terminate_group(warm.process, 0)
        return None

    def close(self) -> None:
        """Stop every idle process (the worker is stopping); no new ones start after this."""
        with self.lock:
            self.closed = True
            idle, self.idle = list(self.idle.values()), {}
        for warm in idle:
            terminate_group(warm.process, 0)

    def _start(self, style: str, environment: dict[str, str]) -> WarmProcess:
        # What it prints while importing goes to an unnamed file; jobs.warm copies it into the job's
        # log when it gets one, where a cold job would have printed it.
        with tempfile.TemporaryFile() as early_output:
            process: subprocess.Popen[bytes] = start_in_own_group(
                [self.job_python, "-m", WARM_MODULE, style],
                die_with_parent=True,
                stdin=subprocess.PIPE,
                stdout=early_output,
                stderr=subprocess.STDOUT,
                env=environment,
            )
        return WarmProcess(style=style, environment=environment, process=process)


# MLflow's private variables, which it sets in os.environ on itself (its first import in the worker
# adds _MLFLOW_TELEMETRY_SESSION_ID): they change nothing a job does, and had made the first job after
# every worker start run cold ("its environment changed").
SET_BY_MLFLOW_ON_ITSELF = "_MLFLOW_"


def variables_that_matter(environment: Mapping[str, str]) -> dict[str, str]:
    """The variables that decide how a job runs: the environment less MLflow's private ones."""
    return {k: v for k, v in environment.items() if not k.startswith(SET_BY_MLFLOW_ON_ITSELF)}


def style_of_stored_spec(spec: dict[str, Any]) -> str:
    """The optimizer style a stored spec runs (the API stores the resolved one; else the default)."""
    optimizer = spec.get("optimizer")
    style = optimizer.get("style") if isinstance(optimizer, dict) else None
    return str(style or default_style(str(spec.get("framework", "torch"))))


def hand_over(process: subprocess.Popen[bytes], argv: Sequence[str], log_file: Path) -> bool:
    """Give a warm process its job: the `jobs.run` arguments and the log file. False when it died
    meanwhile (the job then starts cold: the process ran nothing)."""
    assert process.stdin is not None
    try:
        process.stdin.write(WarmOrder(argv=list(argv), log=str(log_file)).to_line())
        process.stdin.close()  # it reads one order; its stdin is /dev/null from then on
    except (BrokenPipeError, OSError):
        terminate_group(process, 0)
        return False
    return True
