"""MLflow's client for the worker's threads, imported once, by one thread at a time.

The worker imports MLflow lazily (the API process never needs it, and a worker with no study and no
run to end never pays for it), on whichever thread first needs it: a job's thread ending a run left
open or creating a study's parent run, the study finalizer, the log copier, the run closer. Two
threads importing `mlflow` for the first time at once meet MLflow's circular imports half done
(`cannot import name '_get_store' from partially initialized module 'mlflow.tracking'`), and the
half-made module stays in `sys.modules`: MLflow was broken in that worker for good (`partially
initialized module 'mlflow' has no attribute 'version'` on every later use). So every first import
goes through `mlflow_client`, under one process-wide lock; once `mlflow` is whole, the lazy imports
of its submodules elsewhere (`mlflow.entities`, `mlflow.exceptions`) find them loaded.
"""

from __future__ import annotations

import threading
from typing import Any

_IMPORT_LOCK = threading.Lock()


def mlflow_client(tracking_uri: str) -> Any:
    """An `MlflowClient` for `tracking_uri`, MLflow imported under the process-wide lock."""
    with _IMPORT_LOCK:
        import mlflow.tracking  # the client only: no framework comes with it

    # Looked up at the call, not bound at import: tests stand a recorder in for the client.
    return mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
