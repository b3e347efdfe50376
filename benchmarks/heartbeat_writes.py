"""Benchmark: the job store writes (UPDATE statements on `jobs`) per minute per running job.

A worker runs one stand-in job for SECONDS (a shell script that rewrites progress.json every
0.1 s with a new step, `busy`, or never after the first, `idle`), and a SQLAlchemy event listener
counts the UPDATEs of `jobs` its supervision sends. Asserts nothing; prints the figures.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/heartbeat_writes.py [SECONDS]

Run it with PYTHONPATH at another checkout (e.g. `git archive main | tar -x -C /tmp/main`) to
measure that code: it uses only `Worker(settings, sessions, worker_id=...)` and `run_next()`.
"""

from __future__ import annotations

import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import event

from jobs.spec import JobSpec
from service import store
from service.db import make_engine, migrate, session_factory
from service.settings import Settings
from service.worker import Worker

JOB = """#!/bin/sh
while [ $# -gt 0 ] && [ "$1" != "--workdir" ]; do shift; done; W="$2"
i=0
while [ $i -lt {ticks} ]; do
  i=$((i + 1))
  if [ {busy} = 1 ] || [ $i = 1 ]; then echo '{{"step": '$i', "total": 100000}}' > "$W/progress.json"; fi
  sleep 0.1
done
echo '{{"job_id": "1", "attempt": 1, "workdir": "/w", "status": "succeeded"}}' > "$W/result.json"
"""


def writes_per_minute(seconds: float, *, busy: bool) -> float:
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "job"
        program.write_text(JOB.format(ticks=int(seconds * 10), busy=int(busy)))
        program.chmod(program.stat().st_mode | stat.S_IEXEC)
        settings = Settings(data_dir=Path(folder), job_python=str(program))
        engine = make_engine(settings.resolved_database_url)
        migrate(engine)
        sessions = session_factory(engine)
        with sessions() as session:
            spec = JobSpec.model_validate(
                {"workload": {"name": "d"}, "optimizer": {"name": "sgd"}, "steps": 1}
            )
            store.create_job(session=session, spec=spec)
        updates = 0
        lock = threading.Lock()

        def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            nonlocal updates
            if statement.lstrip().upper().startswith("UPDATE JOBS"):
                with lock:
                    updates += 1

        event.listen(engine, "before_cursor_execute", count)
        worker = Worker(settings, sessions, worker_id="bench")
        worker.run_next()
        engine.dispose()
        # Minus the claim's UPDATE and the outcome's: what supervision alone wrote.
        return (updates - 2) * 60 / seconds


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    for busy in (True, False):
        label = "progress every 0.1 s" if busy else "no new progress"
        print(f"{label:>22}: {writes_per_minute(seconds, busy=busy):6.1f} UPDATEs of jobs per minute per job")


if __name__ == "__main__":
    main()
