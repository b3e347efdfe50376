"""A verified checkpoint's publication, on a thread of its own while training goes on.

Publishing a checkpoint (`CheckpointStore.publish`: every point logged so far delivered, then the
file uploaded to the run) took most of a checkpoint's time on a small model, with the training
thread waiting on the tracking server (benchmarks/README.md, phase 4). It needs nothing of the
training state: the file is written and verified before it starts. So the loop starts it and trains
on; it settles it (the record, the progress report another attempt resumes from, the superseded
checkpoint retired) once it is done, at the next flush that finds it done, and waits for it before
the next checkpoint and at the end. At most one is in flight, so they are reported in order, and a
checkpoint is still reported only once it is published. A publication that fails fails the job where
it is settled, as it did where it was published.
"""

from __future__ import annotations

import threading
from pathlib import Path

from jobs.resume import CheckpointStore


class Publication:
    """`store.publish(path)` running on a daemon thread; `reference()` waits for it."""

    def __init__(self, store: CheckpointStore, path: Path, step: int) -> None:
        self.store, self.path, self.step = store, path, step
        self._reference: str | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._publish, name=f"publish-step-{step}", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        try:
            self._reference = self.store.publish(self.path)
        except BaseException as failure:  # raised on the training thread, in reference()
            self._failure = failure

    def done(self) -> bool:
        return not self._thread.is_alive()

    def reference(self) -> str:
        """Where another attempt finds the checkpoint, once published; the publication's own
        failure, if it failed."""
        self._thread.join()
        if self._failure is not None:
            raise self._failure
        assert self._reference is not None
        return self._reference
