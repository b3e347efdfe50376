"""The fresh child: `python -m jobs.checks.fresh.child TASK.json`, started by `spawner.spawn`.

The task names a style. The child imports the style's framework once, then reads
requests, one JSON line each, from its stdin until it closes, and runs each in a process
forked from itself: that process resolves the request's target exactly as the user wrote
it (the working directory, the import path and, for each request anew, the environment
are the checking process's, so plugins and relative paths resolve; the user's module is
imported anew), builds the optimizer
with the same hyperparameters and runs the request's role. The child itself never runs
optimizer code nor starts the framework's runtime, so every fork is fresh as far as the
optimizer is concerned. Any failure is written as one readable line plus the user's
`file:line`, never a raw traceback; a run's output goes to the request's log.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jobs.checks.context import CheckContext, LoopSetup, one_line
from jobs.checks.fresh.plan import FreshRuns, runs_for
from jobs.checks.target import resolve_target
from jobs.checks.tools import method_location
from jobs.frameworks.base import known_fix
from jobs.processes import exit_without_teardown


class AlreadyReported(Exception):
    """A forked run has written the request's error file; nothing more to add."""


def main(argv: Sequence[str]) -> int:
    task = json.loads(Path(argv[0]).read_text())
    try:
        runs = runs_for(task["style"])
        runs.import_framework(task["style"])
    except BaseException as exc:
        report_failure(task, None, exc)
        return 1
    for line in iter(sys.stdin.readline, ""):  # ends when the checking process closes the pipe
        request = {**task, **json.loads(line)}
        status = _in_fork(functools.partial(_run, request, runs), Path(request["log_path"]))
        _write_status(Path(request["status_path"]), status)
    return 0


def _run(request: Mapping[str, Any], runs: FreshRuns) -> None:
    """In the forked process: settings first (they must precede the framework's runtime), then
    the user's class as the checking process resolved it, then the role."""
    context = None
    try:
        os.environ.clear()
        os.environ.update(request["environment"])
        runs.prepare_run(request)
        target = resolve_target(request["target"], style=request["style"])
        context = CheckContext(
            target=target,
            params=dict(request["params"]),
            workdir=Path(request["workdir"]),
            setup=LoopSetup.from_json(request.get("setup")),
        )
        role = {"resume": runs.resume, "distributed": runs.distributed}[request["role"]]
        role(request, context)
    except AlreadyReported:
        raise
    except BaseException as exc:
        report_failure(request, context, exc)
        raise AlreadyReported() from None


def _in_fork(run: Callable[[], None], log_path: Path) -> int:
    """Run `run` in a forked copy of this process, output to `log_path`; its exit status
    (negative: the signal that ended it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, sys.stdout.fileno())
        os.dup2(log, sys.stderr.fileno())
        _exit_after(run)
    return _wait_for(pid)


def _wait_for(pid: int) -> int:
    """The fork's exit status; if the checking process dies meanwhile (this child is handed to
    another parent), its whole process group goes too, so a hung run cannot outlive it."""
    parent = os.getppid()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if os.getppid() != parent:
            os.killpg(0, signal.SIGKILL)
        time.sleep(0.02)


def _exit_after(run: Callable[[], None]) -> None:
    status = 0
    try:
        run()
    except BaseException:
        status = 1  # reported by `run` (or by run_forked's runs) before it raised
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _write_status(path: Path, status: int) -> None:
    # Written whole, then renamed: the checking process polls for this name.
    partial = path.with_name(f".{path.name}")
    partial.write_text(str(status))
    os.replace(partial, path)


def report_failure(task: Mapping[str, Any], context: CheckContext | None, exc: BaseException) -> None:
    """Write the failure as one line and the user's file:line (the first report wins)."""
    error_path = Path(task["error_path"])
    if not error_path.exists():
        where = context.where(exc) if context is not None else _deepest_frame(exc)
        error, fix = one_line(exc), getattr(exc, "fix", "")
        skipped_init = context.driver.base_init_skipped(exc) if context is not None else None
        if context is not None and skipped_init is not None:  # said at __init__, as in the checking process
            error, fix = f"{error}: {skipped_init[0]}", skipped_init[1]
            where = method_location(context, "__init__")
        # Whole or not at all, and the first wins: two DDP ranks often fail at the same moment,
        # and a reader must never see a file one of them is still writing.
        partial = error_path.with_name(f"{error_path.name}.{os.getpid()}.partial")
        # A typed error's advice (StateNotRestored's `fix`) crosses the process boundary with it.
        fix = fix if isinstance(fix, str) and fix else known_fix(exc) or ""
        partial.write_text(json.dumps({"error": error, "where": where, "fix": fix}))
        try:
            os.link(partial, error_path)
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)
    traceback.print_exc()  # kept in the child's log for whoever wants the whole story


def run_forked(
    task: Mapping[str, Any], context: CheckContext, runs: Mapping[str, Callable[[], None]]
) -> None:
    """Each run in its own forked copy of this process, all at once (DDP's ranks).

    The first failure stops the others; AlreadyReported says it is written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, str] = {}
    for name, run in runs.items():
        pid = os.fork()
        if pid == 0:
            _exit_after(functools.partial(_reporting, task, context, run))
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


def _reporting(task: Mapping[str, Any], context: CheckContext, run: Callable[[], None]) -> None:
    try:
        run()
    except BaseException as exc:
        report_failure(task, context, exc)
        raise


def _deepest_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
