"""Process plumbing, written once: child processes in their own group, ending a group,
dying with the parent, the legacy-Keras re-exec, a job's thread count, and the order a warm
(pre-started) job process receives.

Standard library only, so the service may use it too (the worker and the supervisor start
and stop process groups exactly as the check children do): `tests/service/test_imports.py`
allows `jobs.processes` in service/ for that reason, and checks it stays stdlib-only.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

# What a job process catches to write the stacks of its threads to its log (jobs.run registers
# faulthandler on it; the worker sends it to a job whose progress stopped moving, service/stall.py).
STACKS_SIGNAL = signal.SIGUSR1
# Legacy tf.keras (`tf_keras`) replaces `tf.keras` only when this is "1" before TensorFlow is
# imported, and for the whole process: a legacy job or check runs in a process of its own.
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
PR_SET_PDEATHSIG = 1
# The style whose process needs LEGACY_KERAS_ENV (as jobs.frameworks.LEGACY_KERAS_STYLES says).
LEGACY_KERAS_STYLE = "tf_legacy"

# A job's CPU threads, read by each library when it starts its thread pools: OpenMP (torch's
# intra-op pool, and torch reads it at import), MKL and OpenBLAS (numpy), TensorFlow's intra- and
# inter-op pools (read when its runtime starts). Through the environment, so the job's helpers
# (check children, DDP ranks) get the same, and a warm process has it before importing anything.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
)


def in_legacy_keras_process() -> bool:
    return os.environ.get(LEGACY_KERAS_ENV) == "1"


def legacy_keras_environment(env: Mapping[str, str], *, legacy: bool = True) -> dict[str, str]:
    """`env` with the legacy-Keras switch on (or, `legacy=False`, removed)."""
    changed = dict(env)
    if legacy:
        changed[LEGACY_KERAS_ENV] = "1"
    else:
        changed.pop(LEGACY_KERAS_ENV, None)
    return changed


def style_environment(env: Mapping[str, str], style: str) -> dict[str, str]:
    """The environment a process running a job of `style` has once it trains: with the legacy-Keras
    switch for `tf_legacy` (jobs.run re-executes itself with it; a warm process starts with it)."""
    return legacy_keras_environment(env) if style == LEGACY_KERAS_STYLE else dict(env)


def thread_environment(threads: int) -> dict[str, str]:
    """The variables that give a job `threads` CPU threads in every library it may use."""
    if threads < 1:
        raise ValueError(f"a job needs at least 1 thread; received {threads}")
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def threads_of(env: Mapping[str, str]) -> int | None:
    """The thread count the worker gave this job (thread_environment), None when it gave none."""
    value = env.get(THREAD_VARIABLES[0], "")
    return int(value) if value.isdigit() and int(value) >= 1 else None


@dataclass(frozen=True)
class WarmOrder:
    """What a warm job process (`python -m jobs.warm`) reads from its stdin, one JSON line: the
    arguments of `python -m jobs.run` and the log file its output goes to (as a cold job's does)."""

    argv: list[str]
    log: str

    def to_line(self) -> bytes:
        return json.dumps({"argv": self.argv, "log": self.log}).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> WarmOrder:
        data = json.loads(line)
        if not (isinstance(data.get("argv"), list) and isinstance(data.get("log"), str)):
            raise ValueError(f"a warm order is {{'argv': [...], 'log': '...'}}; received {line[:200]!r}")
        return cls(argv=[str(arg) for arg in data["argv"]], log=data["log"])


def reexec_with_legacy_keras(module: str, argv: Sequence[str]) -> NoReturn:
    """Start `python -m module *argv` over in this process (same pid, so whoever watches it keeps
    watching) with TF_USE_LEGACY_KERAS=1, which must be set before TensorFlow is imported."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(
        sys.executable,
        [sys.executable, "-m", module, *argv],
        legacy_keras_environment(os.environ),
    )


_ON_EXIT: list[Callable[[], None]] = []


def on_exit(callback: Callable[[], None]) -> None:
    """Run `callback` when the process ends, however it ends normally: at the interpreter's exit
    (atexit) and in `exit_without_teardown`, which skips atexit."""
    atexit.register(callback)
    _ON_EXIT.append(callback)


def exit_without_teardown(status: int) -> NoReturn:
    """End a job's process once everything it writes is written: the `on_exit` callbacks run and
    its output flushed, then `os._exit`, as multiprocessing ends its children. The interpreter's
    teardown would take seconds once torch (its operator libraries' finalizers) or TensorFlow is
    loaded: CPU that every job would spend after its result, and time a cancelled job would keep
    its slot."""
    import logging

    for callback in reversed(_ON_EXIT):
        callback()
    logging.shutdown()  # flushes every handler (a job's or a user's log file)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing more can reach it
    os._exit(status)


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies, so no child outlives a killed parent.

    Meant as a `preexec_fn` (it runs in the child between fork and exec); elsewhere a no-op.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def start_in_own_group(
    command: Sequence[str], *, die_with_parent: bool = False, **popen: Any
) -> subprocess.Popen[Any]:
    """`subprocess.Popen(command, **popen)` as the leader of a new process group (a new session), so
    `terminate_group` ends it and every helper it started, and a terminal's Ctrl-C reaches only us."""
    preexec = _die_with_parent if die_with_parent else None
    return subprocess.Popen(list(command), start_new_session=True, preexec_fn=preexec, **popen)


def _die_with_parent() -> None:
    die_with_parent()


def terminate_group(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM `process`'s group, then SIGKILL whatever is left after `grace_s` seconds (children the
    leader left behind included); `grace_s=0`: SIGKILL at once. Returns once the leader is reaped."""
    if grace_s > 0:
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    signal_group(process, signal.SIGKILL)
    process.wait()


def how_it_ended(returncode: int | None) -> str:
    """How an ended process ended, as words to follow its name: "was killed by signal SIGKILL",
    "exited with code 3". Real-time signals have no name in `signal.Signals`: their number is said."""
    if returncode is None:
        return "ended without an exit status"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def signal_group(process: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """Send `sig` to the group `process` leads; a group already gone is not an error."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): it runs nothing until it is
    continued. Read from /proc (Linux); False where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) S ...": the state follows the last ")" (a command name may hold one).
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def session_stopped(session_id: int) -> bool:
    """Whether a process of session `session_id` is stopped (SIGSTOP, SIGTSTP, a debugger): a DDP
    job's other ranks are in its top process's session, and one rank stopped holds up them all."""
    return any(fields[0] in ("T", "t") for _, fields in session_processes(session_id))


def session_processes(session_id: int) -> list[tuple[int, list[str]]]:
    """Every process of session `session_id` (a job's, which `start_in_own_group` made it lead), with
    the fields of its /proc stat from the state on (the state is [0], field 3 of proc(5)); [] off Linux."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()  # a command name may hold ")"
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session_id:  # field 6, the session id
            found.append((int(entry.name), fields))
    return found


def session_cpu_s(session_id: int) -> float:
    """CPU seconds (user and system) the live processes of session `session_id` have used."""
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(f[11]) + int(f[12]) for _, f in session_processes(session_id)) / ticks  # fields 14, 15


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc): sending it a signal it
    does not catch may end it (SIGUSR1's default action does)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def write_alive(path: Path) -> None:
    """The worker's sign of life for `watch_the_worker`: this host's monotonic clock (system-wide on
    Linux), written whole (a reader never sees half of it); a wall clock stepped, or a file server's
    clock in a file's mtime, would freeze healthy jobs."""
    partial = path.with_name(f"{path.name}.tmp")
    partial.write_text(f"{time.monotonic():.3f}")
    os.replace(partial, path)


def watch_the_worker(workdir: Path, alive_file: str, frozen_file: str, silence_env: str) -> bool:
    """Freeze this job's process group whenever its worker has shown no sign of life (a touch of
    `workdir/alive_file`) for the seconds `silence_env` says; True where a watch started.

    A worker that is frozen itself (SIGSTOP, a paused VM, a debugger) renews no lease, so another
    worker takes its job over after the lease, while this job's process, which no one stopped, went
    on training beside the new attempt, logging into the same MLflow run (it had ended that run
    FINISHED while the new attempt trained on). The worker's own rule for a lease it cannot renew
    (service.worker `_keep_lease_safe`) is applied here from the job's side, with the same timing:
    frozen before anyone may take over. The worker, once it answers again, continues the group if
    the job is still its own and kills it otherwise. Only in a job the worker watches (the file and
    the setting are there), only in the group's leader (a DDP job's rank 0 freezes its ranks too)."""
    silence = os.environ.get(silence_env)
    alive = workdir / alive_file
    if not silence or not alive.exists() or os.getpgid(0) != os.getpid():
        return False  # a job the worker does not watch so, or a DDP rank (its rank 0 freezes them all)
    limit = float(silence)

    def watch() -> None:
        frozen = workdir / frozen_file
        while True:
            time.sleep(min(1.0, limit / 4))
            try:
                quiet = time.monotonic() - float(alive.read_text())
            except (OSError, ValueError):  # gone (the worker ends the job gracefully), or mid-write
                continue
            if quiet <= limit:
                # Running, and the worker answers: a freeze is over. (Not at once after SIGSTOP: the
                # calling thread runs on for a moment before the group stop takes it too.)
                if frozen.exists():
                    frozen.unlink(missing_ok=True)
                continue
            frozen.write_text(f"{quiet:.1f}\n")  # the worker sends SIGCONT while it is there
            os.killpg(0, signal.SIGSTOP)  # the whole group, this thread too, until the worker says

    threading.Thread(target=watch, name="optlab-worker-watch", daemon=True).start()
    return True
