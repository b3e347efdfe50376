"""A running job whose progress stops moving (service/stall.py): when it is told, what it says, and
the stacks its processes write. The worker-level test with a real job is in test_durable_worker.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobs.processes import catches, session_cpu_s, start_in_own_group, terminate_group
from jobs.result import Progress
from service.stall import STALL_INTERVALS, StallWatch, span

NO_SUCH_SESSION = 2**31 - 1  # beyond any pid_max: no process is in it


def progress(step: int, **fields: object) -> Progress:
    return Progress.model_validate({"step": step, "total": 100, **fields})


def test_a_notice_comes_after_the_floor_and_only_while_the_progress_stands_still(tmp_path: Path) -> None:
    watch = StallWatch(notice_after_s=10, now=0)
    log = tmp_path / "log.txt"
    assert watch.notice(9, NO_SUCH_SESSION, log) is None  # nothing written yet, not long enough
    notice = watch.notice(12, NO_SUCH_SESSION, log)
    assert notice is not None and notice.startswith("it has reported no progress for 12 s, since it started")
    assert "reads the same as a hang" in notice
    watch.see(progress(3), 13)
    assert watch.notice(20, NO_SUCH_SESSION, log) is None  # it moved: quiet again
    watch.see(progress(3, waiting="waiting to publish the checkpoint of step 3: 10 s so far"), 21)
    notice = watch.notice(24, NO_SUCH_SESSION, log)  # what it waits on is no move
    assert notice is not None and notice.startswith("its progress has not moved for 11 s (step 3 of 100)")
    assert not log.exists()  # no process could be asked for its stacks, and none was


def test_a_job_that_moves_slowly_is_told_only_after_many_of_its_own_intervals() -> None:
    watch = StallWatch(notice_after_s=10, now=0)
    watch.see(progress(0), 1)  # start-up's writes, quick ones: not steps
    watch.see(
        progress(0, mlflow={"tracking_uri": "u", "experiment_id": "1", "run_id": "r", "run_url": "u"}), 2
    )
    for step in range(1, 6):  # a step every 30 s
        watch.see(progress(step), 30.0 * step)
        watch.see(progress(step, loss=1.0 / step), 30.0 * step + 0.5)  # not a step either
    last = 150.5
    assert watch.quiet_for(last + 60) is None  # 60 s quiet: far over the floor, but 2 of its intervals
    assert watch.quiet_for(last + STALL_INTERVALS * 30 - 1) is None
    assert watch.quiet_for(last + STALL_INTERVALS * 30) == STALL_INTERVALS * 30


def test_the_cpu_figure_covers_only_time_inside_the_stall() -> None:
    """A busy process: the figure counts its CPU over a whole window after the last move."""
    busy = start_in_own_group([sys.executable, "-c", "while True: pass"])
    try:
        watch = StallWatch(notice_after_s=1.0, now=time.monotonic())  # a 0.5 s window
        watch.see(progress(1), time.monotonic())
        lines: list[str] = []
        deadline = time.monotonic() + 20
        while not any("of CPU" in line for line in lines) and time.monotonic() < deadline:
            lines.append(watch.notice(time.monotonic(), busy.pid, Path(os.devnull)) or "")
            time.sleep(0.1)
        line = next(line for line in lines if "of CPU" in line)
        assert "its processes used" in line and "% of a core, busy: computing, or spinning)" in line
        share = int(line.split("(")[2].split("%")[0])
        assert share >= 30, line  # a spinning process: most of a core, whatever the machine's load
    finally:
        terminate_group(busy, 0)
    idle = start_in_own_group(["sleep", "60"])
    try:
        watch = StallWatch(notice_after_s=1.0, now=time.monotonic())
        deadline = time.monotonic() + 20
        line = ""
        while "of CPU" not in line and time.monotonic() < deadline:
            line = watch.notice(time.monotonic(), idle.pid, Path(os.devnull)) or ""
            time.sleep(0.1)
        assert "used 0.0 s of CPU in the last" in line and "(0% of a core, idle: waiting on something" in line
    finally:
        terminate_group(idle, 0)
    assert session_cpu_s(NO_SUCH_SESSION) == 0.0


STUCK_PROGRAM = """
import faulthandler, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
helper = subprocess.Popen(["sleep", "60"])  # in the session too, and it does not catch SIGUSR1
print(helper.pid, flush=True)

def stuck_in_the_users_step():
    time.sleep(60)

stuck_in_the_users_step()
"""


def test_the_stacks_of_the_processes_that_catch_the_signal_go_to_the_log_and_no_other_is_signalled(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log.txt"
    with open(log, "ab") as out:
        job = start_in_own_group([sys.executable, "-c", STUCK_PROGRAM], stdout=subprocess.PIPE, stderr=out)
    try:
        assert job.stdout is not None
        helper = int(job.stdout.readline())
        assert catches(job.pid, signal.SIGUSR1) and not catches(helper, signal.SIGUSR1)
        watch = StallWatch(notice_after_s=0.5, now=time.monotonic())
        time.sleep(0.6)
        notice = watch.notice(time.monotonic(), job.pid, log)
        assert notice is not None and f"the stacks of its threads went to its log ({log}) at" in notice
        deadline = time.monotonic() + 10
        while "stuck_in_the_users_step" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert "[optlab worker, " in text and "it has reported no progress for" in text
        assert "line 8 in stuck_in_the_users_step" in text, text
        asked_at = time.monotonic()
        again = watch.notice(asked_at, job.pid, log)  # the same stall, not twice as long: not asked again
        assert again is not None and again.endswith(notice.split("; ", 1)[1])
        time.sleep(0.5)
        assert log.read_text().count("[optlab worker, ") == 1
        assert watch.quiet_for(asked_at) is not None
        later = watch.notice(asked_at + watch.next_ask_s, job.pid, log)  # twice as long: asked again
        assert later is not None and watch.asked
        assert log.read_text().count("[optlab worker, ") == 2
        assert job.poll() is None  # the signal does not end the process that catches it
        os.kill(helper, 0)  # nor was the one that does not catch it sent it
    finally:
        terminate_group(job, 0)


def test_durations_read_as_a_person_reads_them() -> None:
    assert [span(s) for s in (0.4, 45, 303, 7620)] == ["0 s", "45 s", "5 min 3 s", "2 h 7 min"]


def test_time_paused_or_stopped_by_someone_else_is_no_stall(tmp_path: Path) -> None:
    """After a store outage (the worker pauses its jobs) every running job had read as stalled at once."""
    watch = StallWatch(notice_after_s=10, now=0)
    watch.see(progress(3), 1)
    watch.restart(30)  # paused from 1 to 30
    assert watch.notice(35, NO_SUCH_SESSION, tmp_path / "log.txt") is None
    assert watch.quiet_for(41) == 11


WATCHED_JOB = """
import sys, time
from pathlib import Path
from jobs.processes import watch_the_worker
workdir = Path(sys.argv[1])
assert watch_the_worker(workdir, ".worker-alive", ".frozen-by-itself", "OPTLAB_WORKER_SILENCE_S")
print("watching", flush=True)
time.sleep(60)
"""


def test_a_job_freezes_itself_only_while_its_worker_is_silent_and_clears_its_mark_once_continued(
    tmp_path: Path,
) -> None:
    """The watch of jobs.processes.watch_the_worker, on a real process group: frozen once the worker's
    sign of life is older than the limit, its mark taken away by the job once continued, and no freeze
    while the sign is gone (a worker ending the job gracefully takes it away first: the freeze had cut
    a 60 s grace to 13 s)."""
    from jobs.processes import is_stopped, write_alive

    alive, frozen = tmp_path / ".worker-alive", tmp_path / ".frozen-by-itself"
    write_alive(alive)
    job = start_in_own_group(
        [sys.executable, "-c", WATCHED_JOB, str(tmp_path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "OPTLAB_WORKER_SILENCE_S": "1"},
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == b"watching"
        for _ in range(8):  # the worker looks in: no freeze
            write_alive(alive)
            time.sleep(0.25)
        assert not is_stopped(job.pid) and not frozen.exists()
        deadline = time.monotonic() + 15  # silent: frozen, saying for how long
        while not is_stopped(job.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_stopped(job.pid) and float(frozen.read_text()) >= 1  # its silence, rounded
        write_alive(alive)
        os.killpg(job.pid, signal.SIGCONT)  # the worker, answering again, continues it
        deadline = time.monotonic() + 10
        while frozen.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not frozen.exists() and not is_stopped(job.pid)
        alive.unlink()  # a graceful end: the worker takes its sign away first
        time.sleep(2)
        assert not is_stopped(job.pid) and job.poll() is None
    finally:
        os.killpg(job.pid, signal.SIGCONT)
        terminate_group(job, 0)
