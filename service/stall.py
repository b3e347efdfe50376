"""A running job whose progress stops moving: said where its user looks, with its threads' stacks.

A step that never returns (a collective waiting for a rank that is gone, a lock, a loop in a
plugin's step) had read as `running` at the same step until the job's time limit, a day by
default, with nothing to say where it was stuck. The worker watches the progress the job writes:
once it has not moved for `OPTLAB_STALL_NOTICE_S`, and for STALL_INTERVALS of the job's own usual
intervals between the steps it reported (a job whose steps take minutes is not told at each), the job's
`waiting_reason` says so, with the CPU its processes used meanwhile (none: waiting on something; a
core or more: computing), and every process of the job that catches SIGUSR1 (each
`python -m jobs.run` does, through faulthandler) writes the stacks of its threads to the job's log,
then again each time the stall doubles. A notice, never a failure: a long evaluation or checkpoint
reads the same, and the job goes on as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from jobs.processes import STACKS_SIGNAL, catches, session_cpu_s, session_processes
from jobs.result import Progress

# The notice waits for this many of the job's usual intervals between steps, at least.
STALL_INTERVALS = 20
# The CPU figure covers the last this many seconds (half the notice time, where that is less).
CPU_WINDOW_S = 30.0
# Under this share of one core in that window (in percent), the job's processes read as idle.
IDLE_SHARE = 5.0


class StallWatch:
    """When one attempt's progress last moved, and what to say once it has not for long."""

    def __init__(self, notice_after_s: float, now: float) -> None:
        self.notice_after_s = notice_after_s
        self.cpu_window_s = min(CPU_WINDOW_S, notice_after_s / 2)
        self.seen: Progress | None = None
        self.moved_at = now  # the process's start counts as its first move
        self.step_times: list[float] = []  # when the step changed: the first time and the last
        self.step_moves = 0
        self.stacks_line: str | None = None  # what the last ask for this stall's stacks told (None: none yet)
        self.next_ask_s = 0.0  # the stall's length at which its stacks are asked for again
        self.cpu_samples: list[tuple[float, float]] = []  # (monotonic time, CPU seconds), the last two
        self.asked = False  # the last notice asked for stacks
        self.asks = 0  # how many times stacks were asked for, over every stall
        self.log_copied = ""  # where the log was copied with the latest stacks, once it was

    def restart(self, now: float) -> None:
        """Count from `now`: time the job was paused or stopped by someone else is no stall of its own
        (after a store outage every running job had read as stalled at once)."""
        self.moved_at, self.stacks_line, self.cpu_samples = now, None, []

    def copied(self, ask: int, where: str) -> None:
        """The log, with the stacks of ask number `ask`, was copied to `where` (from another thread)."""
        if ask == self.asks:
            self.log_copied = where

    def see(self, progress: Progress | None, now: float) -> None:
        """Take the progress the job wrote last; what it waits on (`waiting`) is no move."""
        shown = None if progress is None else progress.model_copy(update={"waiting": None})
        if shown == self.seen:
            return
        if shown is not None and self.seen is not None and shown.step != self.seen.step:
            self.step_times = [*self.step_times[:1], now]
            self.step_moves += 1
        self.seen, self.moved_at, self.stacks_line = shown, now, None

    def quiet_for(self, now: float) -> float | None:
        """Seconds since the progress last moved, once that is past the notice time; else None."""
        quiet = now - self.moved_at
        usual = 0.0  # between two steps the job reported (not its start-up's writes: they come fast)
        if self.step_moves >= 2:
            usual = (self.step_times[-1] - self.step_times[0]) / (self.step_moves - 1)
        return quiet if quiet >= max(self.notice_after_s, STALL_INTERVALS * usual) else None

    def notice(self, now: float, session_id: int, log: Path) -> str | None:
        """What the job's waiting_reason says now: None while its progress moves. The first notice of
        a stall asks the job's processes for their stacks (into `log`)."""
        self._sample_cpu(now, session_id)
        quiet = self.quiet_for(now)
        if quiet is None:
            return None
        if self.seen is None:
            what = f"it has reported no progress for {span(quiet)}, since it started or was continued"
        else:
            what = (
                f"its progress has not moved for {span(quiet)} (step {self.seen.step} of {self.seen.total})"
            )
        # Asked again each time the stall doubles: where a first look caught a moment that passed,
        # a later one shows where it stays (a few times a day at most).
        self.asked = self.stacks_line is None or quiet >= self.next_ask_s
        if self.asked:
            self.stacks_line = ask_for_stacks(session_id, log, what)
            self.next_ask_s = 2 * quiet
            self.asks += 1
            self.log_copied = ""
        copied = f" (copied to {self.log_copied})" if self.stacks_line and self.log_copied else ""
        parts = [what, self._cpu_line(), (self.stacks_line or "") + copied]
        parts.append("a step, an evaluation or a checkpoint that takes this long reads the same as a hang")
        return "; ".join(part for part in parts if part)

    def _sample_cpu(self, now: float, session_id: int) -> None:
        if self.cpu_samples and now - self.cpu_samples[-1][0] < self.cpu_window_s:
            return
        self.cpu_samples = [*self.cpu_samples[-1:], (now, session_cpu_s(session_id))]

    def _cpu_line(self) -> str:
        """The CPU the job's processes used over the last whole window inside this stall."""
        if len(self.cpu_samples) < 2 or self.cpu_samples[0][0] < self.moved_at:
            return ""
        (start, used_before), (end, used) = self.cpu_samples
        seconds, window = max(0.0, used - used_before), end - start
        share = 100 * seconds / window
        what = (
            "busy: computing, or spinning"
            if share >= IDLE_SHARE
            else "idle: waiting on something (a lock, another rank, a device, a file)"
        )
        used_line = f"its processes used {seconds:.1f} s of CPU in the last {window:.0f} s"
        return f"{used_line} ({share:.0f}% of a core, {what})"


def ask_for_stacks(session_id: int, log: Path, why: str) -> str:
    """Have every process of the job's session that catches STACKS_SIGNAL write its threads' stacks to
    the job's log, after a line saying why; what to tell the user ('' where none could)."""
    askable = [
        pid
        for pid, fields in session_processes(session_id)
        if fields[0] != "Z" and catches(pid, STACKS_SIGNAL)
    ]
    if not askable:
        return ""  # a process that does not catch it would be ended by it
    clock = time.strftime("%H:%M:%S UTC", time.gmtime())
    with open(log, "a") as out:
        out.write(f"\n[optlab worker, {clock}] {why}: the stacks of the job's processes follow\n")
    asked = 0
    for pid in askable:
        try:
            os.kill(pid, STACKS_SIGNAL)
            asked += 1
        except ProcessLookupError:
            continue
    ranks = " (a DDP job's other ranks: rank-N/log.txt beside it)" if asked > 1 else ""
    return f"the stacks of its threads went to its log ({log}){ranks} at {clock}" if asked else ""


def span(seconds: float) -> str:
    """'45 s', '5 min 3 s', '2 h 7 min': a duration as a person reads it."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"
