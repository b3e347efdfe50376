"""Fresh processes for the checks that need one: `python -m jobs.checks.child TASK.json`.

A task file names the target exactly as the user wrote it, the style, the validated
hyperparameters and a role; the child resolves the same class again (the working
directory and the environment pass through, so plugins and relative paths resolve),
builds the optimizer the same way, runs the role of `task["module"]` and writes its
results where the task says. Any failure is written as one readable line plus the
user's `file:line`, never a raw traceback.

The parent side (`spawn`, `wait_all`) lives here too: it kills children that outlive
their time, so a hung optimizer cannot hang a check. `run_forked` lets one child
import the framework once and fork a process per run (DDP's ranks).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.checks.context import one_line
from jobs.checks.report import Outcome, failed
from jobs.processes import legacy_keras_environment, start_in_own_group, terminate_group

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120.0

# What the two fresh-process checks share, in every framework.
SEED = 20240607
RESUME_STEPS = 6  # N steps straight ...
RESUME_SPLIT = 3  # ... against k steps, save, a fresh process runs the other N - k
GLOBAL_BATCH = 8  # each replica (DDP rank, MirroredStrategy replica) takes an equal share of the rows
# Replicas average their share's gradients, which rounds differently from one full-batch
# mean (a few float32 ulps). Over a few steps that moves parameters by about 1e-6 of their
# movement; a real distribution fault (a gradient summed twice, a norm over replicas,
# replicas drifting apart) changes the movement itself by a large fraction. So parameters
# must agree within 1e-3 of their movement, and optimizer state within 1e-3 of its own size.
RELATIVE_TOLERANCE = 1e-3
ABSOLUTE_FLOOR = 1e-7


class ChildFailed(Exception):
    """A child process failed: `observed` says how, `where` is the user's file:line if known."""

    def __init__(self, observed: str, where: str = "", *, timed_out: bool = False) -> None:
        super().__init__(observed)
        self.observed = observed
        self.where = where
        self.timed_out = timed_out


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    error_path: Path
    log_path: Path


def spawn(name: str, task: Mapping[str, Any], workdir: Path, *, legacy_keras: bool = False) -> Child:
    """Start `python -m jobs.checks.child` on `task` (written to `workdir/<name>.json`)."""
    task_path = workdir / f"{name}.json"
    error_path = workdir / f"{name}.error.json"
    log_path = workdir / f"{name}.log"
    error_path.unlink(missing_ok=True)
    task_path.write_text(json.dumps({**task, "error_path": str(error_path)}))
    env = child_environment(legacy_keras=legacy_keras)
    with log_path.open("wb") as log:
        # Its own process group, so a kill takes its helpers too.
        process = start_in_own_group(
            [sys.executable, "-m", "jobs.checks.child", str(task_path)],
            cwd=os.getcwd(),  # relative target paths resolve as they did for the parent
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Child(name, process, error_path, log_path)


def child_environment(*, legacy_keras: bool) -> dict[str, str]:
    env = dict(os.environ)  # OPTLAB_PLUGIN_DIRS, PYTHONPATH and the rest pass through
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return legacy_keras_environment(env, legacy=legacy_keras)  # set before TensorFlow is imported


def wait_all(children: Sequence[Child], timeout_s: float | None = None) -> None:
    """Wait for every child; raise ChildFailed on the first failure (the others are killed)."""
    timeout_s = CHILD_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(children)
        while pending:
            for child in list(pending):
                code = child.process.poll()
                if code is None:
                    continue
                pending.remove(child)
                if code != 0:
                    raise failure_of(child, code)
            if pending and time.monotonic() > deadline:
                raise ChildFailed(
                    f"the fresh process ({pending[0].name}) did not finish within {timeout_s:.0f} s and "
                    "was stopped; the optimizer's step may hang or be extremely slow there",
                    timed_out=True,
                )
            if pending:
                time.sleep(0.02)
    finally:
        for child in children:
            kill(child)


def kill(child: Child) -> None:
    if child.process.poll() is None:
        terminate_group(child.process, grace_s=0)


def failure_of(child: Child, code: int) -> ChildFailed:
    """What the child wrote about its failure, else the end of its output."""
    if child.error_path.is_file():
        reported = json.loads(child.error_path.read_text())
        return ChildFailed(
            f"in a fresh process ({child.name}): {reported['error']}", reported.get("where", "")
        )
    tail = [line for line in child.log_path.read_text(errors="replace").splitlines() if line.strip()][-3:]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return ChildFailed(f"the fresh process ({child.name}) {how}: {' | '.join(tail)[-400:]}")


def failed_in_child(exc: ChildFailed, what: str, *, where: str, fix: str = "") -> Outcome:
    """The check's fail for a child that raised or hung; `where` is the fallback location."""
    if exc.timed_out:
        fix = (
            "make sure the step finishes; a blocking call or an endless loop in the update hangs training too"
        )
    elif not fix:
        fix = "the optimizer raised in a fresh process; the error above and its line say why"
    return failed(f"{what} failed: {exc.observed}", where=exc.where or where, fix=fix)


# -- the child's side -----------------------------------------------------------------------------------


class AlreadyReported(Exception):
    """A forked run has written the task's error file; nothing more to add."""


def main(argv: Sequence[str]) -> int:
    task = json.loads(Path(argv[0]).read_text())
    context = None
    try:
        module = importlib.import_module(task["module"])
        module.prepare_child(task)  # e.g. logical devices, which must precede TensorFlow's start
        from jobs.checks.context import CheckContext
        from jobs.checks.target import resolve_target

        target = resolve_target(task["target"], style=task["style"])
        context = CheckContext(target=target, params=dict(task["params"]), workdir=Path(task["workdir"]))
        if task.get("wait_for"):
            _wait_for(Path(task["wait_for"]))
        module.run_child(task, context)
    except AlreadyReported:
        return 1
    except BaseException as exc:
        report_failure(task, context, exc)
        return 1
    return 0


def report_failure(task: Mapping[str, Any], context: Any, exc: BaseException) -> None:
    """Write the failure as one line and the user's file:line (the first report wins)."""
    error_path = Path(task["error_path"])
    if not error_path.exists():
        where = context.where(exc) if context is not None else _deepest_frame(exc)
        error_path.write_text(json.dumps({"error": one_line(exc), "where": where}))
    traceback.print_exc()  # kept in the child's log for whoever wants the whole story


def run_forked(task: Mapping[str, Any], context: Any, runs: Mapping[str, Callable[[], None]]) -> None:
    """Each run in its own forked copy of this process, all at once.

    The framework is imported once (seconds) instead of once per run, and every run
    still starts from a process in which no optimizer has stepped yet, as a fresh one.
    The first failure stops the others; AlreadyReported says it is written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, str] = {}
    for name, run in runs.items():
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                run()
            except BaseException as exc:
                report_failure(task, context, exc)
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        pids[pid] = name
    while pids:
        pid, status = os.wait()
        pids.pop(pid, None)
        if status != 0:
            for other in pids:
                os.kill(other, signal.SIGKILL)
            for other in pids:
                os.waitpid(other, 0)
            raise AlreadyReported()


def _wait_for(path: Path, timeout_s: float = CHILD_TIMEOUT_S) -> None:
    """The parent starts a child before its input exists, so the imports overlap its own work."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def ready(path: Path) -> None:
    """Tell a child waiting on `path` (see `wait_for` in the task) that its input is written."""
    path.touch()


def _deepest_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip the interpreter's teardown, which takes TensorFlow seconds.
    os._exit(status)
