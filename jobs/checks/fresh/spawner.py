"""The checking process's side of the fresh processes: start, ask, wait, time out, kill.

One child per check context (`fresh_child`) imports the framework once and then serves
requests: each request runs in a process forked from it before any optimizer code has
run there, so every run is as fresh as a new interpreter for the optimizer (its module
is imported anew, class attributes and module globals start clean) without paying the
interpreter start and the framework import (seconds) per run. A request that outlives
its time has the whole child killed, helpers included, so a hung optimizer cannot hang
a check; a failure comes back as one readable line and the user's file:line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed
from jobs.checks.target import LEGACY_KERAS_ENV, needs_legacy_keras

REPO_ROOT = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 120.0
CHILD_MODULE = "jobs.checks.fresh.child"
_NOTE = "fresh_child"  # where a context keeps its child between the two checks


class ChildFailed(Exception):
    """A fresh run failed: `observed` says how, `where` is the user's file:line if known."""

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
    """Start `python -m jobs.checks.fresh.child` on `task` (written to `workdir/<name>.json`);
    it reads its requests from the pipe on its stdin and ends when that closes."""
    task_path = workdir / f"{name}.json"
    error_path = workdir / f"{name}.error.json"
    log_path = workdir / f"{name}.log"
    error_path.unlink(missing_ok=True)
    task_path.write_text(json.dumps({**task, "error_path": str(error_path)}))
    env = child_environment(legacy_keras=legacy_keras)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, str(task_path)],
            cwd=os.getcwd(),  # relative target paths resolve as they did for the parent
            env=env,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a kill takes its helpers too
        )
    return Child(name, process, error_path, log_path)


def child_environment(*, legacy_keras: bool) -> dict[str, str]:
    env = dict(os.environ)  # OPTLAB_PLUGIN_DIRS, PYTHONPATH and the rest pass through
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if legacy_keras:
        env[LEGACY_KERAS_ENV] = "1"  # must be set before TensorFlow is imported
    else:
        env.pop(LEGACY_KERAS_ENV, None)
    return env


def kill(child: Child) -> None:
    if child.process.poll() is None:
        try:
            os.killpg(child.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.process.wait()
    if child.process.stdin is not None:
        child.process.stdin.close()


def fresh_child(ctx: CheckContext) -> Child:
    """The context's fresh child, started on first use; it is killed with the context."""
    child = ctx.notes.get(_NOTE)
    if isinstance(child, Child) and child.process.poll() is None:
        return child
    task = {
        "target": ctx.target.text,
        "style": ctx.target.style,
        "params": ctx.params,
        "workdir": str(ctx.workdir),
    }
    legacy = needs_legacy_keras(ctx.target.text, style=ctx.target.style)
    child = spawn("fresh", task, ctx.workdir, legacy_keras=legacy)
    ctx.notes[_NOTE] = child
    weakref.finalize(ctx, kill, child)  # also at exit; the child ends by itself if we die
    return child


def run_fresh(
    ctx: CheckContext, role: str, request: Mapping[str, Any], timeout_s: float | None = None
) -> None:
    """Run `role` ("resume", "distributed") in a fresh process; ChildFailed says why it failed."""
    child = fresh_child(ctx)
    error_path, status_path = (ctx.workdir / f"{role}.{suffix}" for suffix in ("error.json", "status"))
    error_path.unlink(missing_ok=True)
    status_path.unlink(missing_ok=True)
    line = json.dumps(
        {**request, "role": role, "error_path": str(error_path), "status_path": str(status_path)}
    )
    try:
        assert child.process.stdin is not None
        child.process.stdin.write(f"{line}\n".encode())
        child.process.stdin.flush()
        _wait(child, role, status_path, CHILD_TIMEOUT_S if timeout_s is None else timeout_s)
    except BrokenPipeError:  # the child ended before it read the request
        raise _failure_of(child, role, child.process.wait(), child.error_path) from None
    code = int(status_path.read_text())
    if code != 0:
        raise _failure_of(child, role, code, error_path)


def _wait(child: Child, role: str, status_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not status_path.exists():
        code = child.process.poll()
        if code is not None:
            raise _failure_of(child, role, code, child.error_path)
        if time.monotonic() > deadline:
            kill(child)
            raise ChildFailed(
                f"the fresh process ({role}) did not finish within {timeout_s:.0f} s and was stopped; "
                "the optimizer's step may hang or be extremely slow there",
                timed_out=True,
            )
        time.sleep(0.02)


def _failure_of(child: Child, role: str, code: int, error_path: Path) -> ChildFailed:
    """What the run wrote about its failure, else the end of the child's output."""
    if error_path.is_file():
        reported = json.loads(error_path.read_text())
        return ChildFailed(f"in a fresh process ({role}): {reported['error']}", reported.get("where", ""))
    tail = [line for line in child.log_path.read_text(errors="replace").splitlines() if line.strip()][-3:]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return ChildFailed(f"the fresh process ({role}) {how}: {' | '.join(tail)[-400:]}")


def failed_in_child(exc: ChildFailed, what: str, *, where: str, fix: str = "") -> Outcome:
    """The check's fail for a run that raised or hung; `where` is the fallback location."""
    if exc.timed_out:
        fix = (
            "make sure the step finishes; a blocking call or an endless loop in the update hangs training too"
        )
    elif not fix:
        fix = "the optimizer raised in a fresh process; the error above and its line say why"
    return failed(f"{what} failed: {exc.observed}", where=exc.where or where, fix=fix)
