"""Produce the catalogue the API validates jobs against.

Run as `python -m jobs.catalogue` (the worker does this at start and stores the JSON),
so the API process never imports a framework. torch and Keras 3 optimizers are read in
this process; legacy tf.keras ones in a child process started with
TF_USE_LEGACY_KERAS=1, because that switch changes `tf.keras` for a whole process and
the two Keras styles must never meet in one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

from jobs.processes import legacy_keras_environment, start_in_own_group
from jobs.workloads import describe_workloads
from optimizers.schedules import describe_schedules

IN_PROCESS_STYLES = ("torch", "keras")


def build_part(styles: Iterable[str]) -> dict[str, Any]:
    """The optimizers of `styles` that this process can load, and the load failures."""
    from optimizers.registry import load_registry

    registry = load_registry(styles=tuple(styles))
    return {
        "optimizers": [entry.describe() for entry in registry.entries.values()],
        "errors": [
            {"source": e.source, "error": e.error, "scope": "file" if e.whole_file else "class"}
            for e in registry.errors
        ],
    }


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One catalogue from the per-process parts.

    A plugin file that failed as a whole in one process but registered optimizers in another is
    not an error (e.g. one written for `tf.keras` under TF_USE_LEGACY_KERAS=1). Every other error
    stays: one a class met in the process that loaded its file (a bad declaration, a name taken) had
    been dropped too wherever the file registered another class, so the class vanished unexplained.
    """
    from optimizers.registry import PLUGIN_SOURCE

    optimizers = [optimizer for part in parts for optimizer in part["optimizers"]]
    registered_by_part = [{optimizer["source"] for optimizer in part["optimizers"]} for part in parts]
    errors: list[dict[str, str]] = []
    for index, part in enumerate(parts):
        elsewhere = set().union(*(sources for i, sources in enumerate(registered_by_part) if i != index))
        for error in part["errors"]:
            whole_file = error.get("scope", "file") == "file"
            if whole_file and f"{PLUGIN_SOURCE}{error['source']}" in elsewhere:
                continue
            said = {"source": error["source"], "error": error["error"]}
            if said not in errors:
                errors.append(said)
    return {
        "optimizers": optimizers,
        "schedules": describe_schedules(),
        "workloads": describe_workloads(with_parameters=True),
        "errors": errors,
    }


def legacy_part() -> subprocess.Popen[str]:
    """The legacy part, in a child that ends with this process (a timed-out catalogue leaves none)."""
    command = [sys.executable, "-m", "jobs.catalogue", "--part", "tf_legacy"]
    return start_in_own_group(
        command,
        die_with_parent=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=legacy_keras_environment(os.environ),
    )


def collect(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate()
    if process.returncode != 0:
        tail = err.strip().splitlines()[-1:] or ["no output"]
        return {"optimizers": [], "errors": [{"source": "tf_legacy catalogue process", "error": tail[0]}]}
    part: dict[str, Any] = json.loads(out)
    return part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.catalogue", description=__doc__)
    parser.add_argument("--part", help="print only the part for these comma-separated styles")
    args = parser.parse_args(argv)
    # Plugin code may print at import time; keep stdout for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        if args.part:
            output = build_part(args.part.split(","))
        else:
            legacy = legacy_part()  # runs while this process loads torch and Keras 3
            output = merge_parts([build_part(IN_PROCESS_STYLES), collect(legacy)])
    json.dump(output, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
