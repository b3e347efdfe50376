"""Produce the catalogue the API validates jobs against.

Run as `python -m jobs.catalogue` (the worker does this at start and stores the JSON),
so the API process never imports a framework.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

from jobs.workloads import describe_workloads
from optimizers.schedules import describe_schedules


def build_catalogue() -> dict[str, Any]:
    from optimizers.registry import load_registry

    registry = load_registry()
    return {
        "optimizers": [entry.describe() for entry in registry.entries.values()],
        "schedules": describe_schedules(),
        "workloads": describe_workloads(),
        "errors": [{"source": e.source, "error": e.error} for e in registry.errors],
    }


def main() -> int:
    # Plugin code may print at import time; keep stdout for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        catalogue = build_catalogue()
    json.dump(catalogue, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
