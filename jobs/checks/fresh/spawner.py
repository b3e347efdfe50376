"""The checking process's side of the fresh processes: start, ask, wait, time out, kill.

One child per style and checking process (`fresh_child`) imports the framework once and
then serves requests: each request runs in a process forked from it before any optimizer
code has run there, and that process imports the user's module anew, so every run is as
fresh as a new interpreter for the optimizer (class attributes and module globals start
clean, the framework's runtime is not started yet) without paying the interpreter start
and the framework import (seconds) per run. A child is kept for the next context: in a
process that checks many optimizers (the test suite, a benchmark) only the first pays the
import. A request that outlives its time has the whole child killed, helpers included,
so a hung optimizer cannot hang a check; a failure comes back as one readable line and
the user's file:line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed
from jobs.frameworks import needs_legacy_keras_process
from jobs.processes import (
    how_it_ended,
    legacy_keras_environment,
    on_exit,
    start_in_own_group,
    terminate_group,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 120.0
CHILD_MODULE = "jobs.checks.fresh.child"


class ChildFailed(Exception):
    """A fresh run failed: `observed` says how, `where` is the user's file:line if known."""

    def __init__(self, observed: str, where: str = "", *, timed_out: bool = False, fix: str = "") -> None:
        super().__init__(observed)
        self.observed = observed
        self.where = where
        self.timed_out = timed_out
        self.fix = fix  # the advice the child's error carried, if it was a typed one


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    error_path: Path
    log_path: Path
    legacy_keras: bool


def spawn(name: str, task: Mapping[str, Any], workdir: Path, *, legacy_keras: bool = False) -> Child:
    """Start `python -m jobs.checks.fresh.child` on `task` (written to `workdir/<name>.json`);
    it reads its requests from the pipe on its stdin and ends when that closes."""
    task_path = workdir / f"{name}.json"
    error_path = workdir / f"{name}.error"
    log_path = workdir / f"{name}.log"
    error_path.unlink(missing_ok=True)
    task_path.write_text(json.dumps({**task, "error_path": str(error_path)}))
    env = child_environment(legacy_keras=legacy_keras)
    with log_path.open("wb") as log:
        # Its own process group, so a kill takes its helpers (forked runs, DDP ranks) too.
        process = start_in_own_group(
            [sys.executable, "-m", CHILD_MODULE, str(task_path)],
            cwd=os.getcwd(),  # relative target paths resolve as they did for the parent
            env=env,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Child(name, process, error_path, log_path, legacy_keras)


def child_environment(*, legacy_keras: bool) -> dict[str, str]:
    env = dict(os.environ)  # OPTLAB_PLUGIN_DIRS, PYTHONPATH and the rest pass through
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return legacy_keras_environment(env, legacy=legacy_keras)  # set before TensorFlow is imported


def kill(child: Child) -> None:
    if child.process.poll() is None:
        terminate_group(child.process, grace_s=0)
    if child.process.stdin is not None:
        child.process.stdin.close()


@dataclass
class _Kept:
    child: Child
    started_for: str  # the working directory and import path it inherited
    folder: Path  # its task, log and error files


_KEPT: dict[str, _Kept] = {}  # style -> its child


def stop_all() -> None:
    for style in list(_KEPT):
        _stop(style)


on_exit(stop_all)  # a child left behind would also end by itself, at the end of its stdin


def fresh_child(style: str, *, legacy_keras: bool) -> Child:
    """The style's child, started on first use and again when it died or was killed, or when what
    the interpreter reads at its start changed: the working directory and PYTHONPATH make its
    import path. The rest of the environment each request brings along (`run_fresh`)."""
    env = child_environment(legacy_keras=legacy_keras)
    started_for = json.dumps([os.getcwd(), env["PYTHONPATH"]])
    kept = _KEPT.get(style)
    if kept is not None and kept.started_for == started_for and kept.child.process.poll() is None:
        return kept.child
    if kept is not None:
        _stop(style)
    folder = Path(tempfile.mkdtemp(prefix=f"optlab-fresh-{style}-"))
    child = spawn(style, {"style": style}, folder, legacy_keras=legacy_keras)
    _KEPT[style] = _Kept(child, started_for, folder)
    return child


def child_for(ctx: CheckContext) -> Child:
    """The fresh child for the context's target; starting it early overlaps its imports with
    the checking process's work."""
    style = ctx.target.style
    return fresh_child(style, legacy_keras=needs_legacy_keras_process(style))


def _stop(style: str) -> None:
    kept = _KEPT.pop(style)
    kill(kept.child)
    shutil.rmtree(kept.folder, ignore_errors=True)


def run_fresh(
    ctx: CheckContext, role: str, request: Mapping[str, Any], timeout_s: float | None = None
) -> None:
    """Run `role` ("resume", "distributed") on the context's target in a fresh process, its files
    in the context's workdir; ChildFailed says why it failed."""
    child = child_for(ctx)
    paths = {name: ctx.workdir / f"{role}.{name}" for name in ("error", "status", "log")}
    for path in paths.values():
        path.unlink(missing_ok=True)
    line = json.dumps(
        {
            **request,
            "role": role,
            "target": ctx.target.text,
            "style": ctx.target.style,
            "params": ctx.params,
            "setup": ctx.setup.to_json(),
            "workdir": str(ctx.workdir),
            # As the checking process has it now (a test may have set OPTLAB_PLUGIN_DIRS since).
            "environment": child_environment(legacy_keras=child.legacy_keras),
            **{f"{name}_path": str(path) for name, path in paths.items()},
        }
    )
    try:
        assert child.process.stdin is not None
        child.process.stdin.write(f"{line}\n".encode())
        child.process.stdin.flush()
        _wait(child, role, paths["status"], CHILD_TIMEOUT_S if timeout_s is None else timeout_s)
    except BrokenPipeError:  # the child ended before it read the request
        raise _failure_of(role, child.process.wait(), child.error_path, child.log_path) from None
    except BaseException:  # a check's time limit, Ctrl-C: the child may be mid-request, never reuse it
        if child.name in _KEPT:
            _stop(child.name)
        raise
    code = int(paths["status"].read_text())
    if code != 0:
        raise _failure_of(role, code, paths["error"], paths["log"])


def _wait(child: Child, role: str, status_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not status_path.exists():
        code = child.process.poll()
        if code is not None:
            raise _failure_of(role, code, child.error_path, child.log_path)
        if time.monotonic() > deadline:
            _stop(child.name)  # a child is named after its style
            raise ChildFailed(
                f"the fresh process ({role}) did not finish within {timeout_s:.0f} s and was stopped; "
                "the optimizer's step may hang or be extremely slow there",
                timed_out=True,
            )
        time.sleep(0.02)


def _failure_of(role: str, code: int, error_path: Path, log_path: Path) -> ChildFailed:
    """What the process wrote about its failure, else the end of its output."""
    try:
        reported = json.loads(error_path.read_text()) if error_path.is_file() else None
    except ValueError:  # not written whole (it is written atomically; kept for an older child)
        reported = None
    if reported is not None:
        return ChildFailed(
            f"in a fresh process ({role}): {reported['error']}",
            reported.get("where", ""),
            fix=reported.get("fix", ""),
        )
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    tail = [line for line in lines if line.strip()][-3:]
    return ChildFailed(f"the fresh process ({role}) {how_it_ended(code)}: {' | '.join(tail)[-400:]}")


def failed_in_child(exc: ChildFailed, what: str, *, where: str, fix: str = "") -> Outcome:
    """The check's fail for a run that raised or hung; `where` is the fallback location."""
    if exc.timed_out:
        fix = (
            "make sure the step finishes; a blocking call or an endless loop in the update hangs training too"
        )
    elif not fix:
        fix = exc.fix or "the optimizer raised in a fresh process; the error above and its line say why"
    return failed(f"{what} failed: {exc.observed}", where=exc.where or where, fix=fix)
