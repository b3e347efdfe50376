"""`exit_without_teardown`: how a job's process ends (jobs.run, jobs.warm, a check's fresh child).

It skips the interpreter's teardown (seconds once torch or TensorFlow is loaded), so what that
teardown would have done for the job has to happen anyway: its output and log files are
complete, `on_exit` callbacks (the check children a job keeps) run, and the status is its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PROGRAM = """
import logging, logging.handlers, sys
from jobs.processes import exit_without_teardown, on_exit

log = logging.getLogger("job")
# Buffered: written only when the handler is flushed or closed (logging.shutdown).
log.addHandler(logging.handlers.MemoryHandler(100, target=logging.FileHandler(sys.argv[1])))
log.warning("logged last")
on_exit(lambda: print("callback ran", flush=False))
print("printed, not flushed", end=" ")
sys.stderr.write("to stderr, not flushed")
exit_without_teardown(3)
print("never")
"""


def test_a_process_ends_with_its_status_its_output_and_logs_complete_and_its_callbacks_run(
    tmp_path: Path,
) -> None:
    log = tmp_path / "job.log"
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 3, completed.stderr
    assert completed.stdout == "printed, not flushed callback ran\n"
    assert completed.stderr == "to stderr, not flushed"
    assert log.read_text() == "logged last\n"
