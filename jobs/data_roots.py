"""Where a workload may read a user's data file: only under the configured data roots.

`OPTLAB_DATA_ROOTS` lists folders, separated like PATH (`os.pathsep`, ':' on Linux). A path a
spec gives is resolved (symlinks and `..` followed) and must lie inside one of the resolved
roots, so `../../etc/passwd` or a link pointing out of a root is refused. The API checks this
at submission with its own setting; the job checks it again with the variable the worker
passes on (service/secrets.py `job_environment`), so a job never reads outside them.

Standard library only: the API process imports this (through jobs.spec).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

DATA_ROOTS_VARIABLE = "OPTLAB_DATA_ROOTS"


def parse_data_roots(text: str) -> list[Path]:
    """`/data/a:/data/b` -> [Path('/data/a'), Path('/data/b')], resolved; empty entries ignored."""
    return [Path(entry).expanduser().resolve() for entry in text.split(os.pathsep) if entry.strip()]


def data_roots_from_environment(environ: Mapping[str, str] | None = None) -> list[Path]:
    return parse_data_roots((os.environ if environ is None else environ).get(DATA_ROOTS_VARIABLE, ""))


def resolve_data_path(
    value: str, roots: Sequence[Path], *, field: str, suffixes: tuple[str, ...] = ()
) -> Path:
    """The existing file `value` names, resolved, if it lies under one of `roots`.

    A relative `value` is taken relative to each root in turn. Raises ValueError naming
    `field`, what is allowed and the value received.
    """
    if not roots:
        raise ValueError(
            f"{field}: no data roots are configured, so no data file may be read; the service's "
            f"{DATA_ROOTS_VARIABLE} lists the folders allowed; received {value!r}"
        )
    listed = os.pathsep.join(str(root) for root in roots)
    candidates = [Path(value)] if Path(value).is_absolute() else [root / value for root in roots]
    inside = []
    for candidate in candidates:
        resolved = candidate.resolve()
        if any(resolved.is_relative_to(root) for root in roots):
            inside.append(resolved)
    if not inside:
        raise ValueError(
            f"{field} must lie under a data root ({listed}) once symlinks and '..' are resolved; "
            f"received {value!r}"
        )
    if suffixes and not value.endswith(suffixes):  # after the roots: a path outside is told that first
        raise ValueError(f"{field} must name a {' or '.join(suffixes)} file; received {value!r}")
    for resolved in inside:
        if resolved.is_file():
            return resolved
    raise ValueError(f"{field}: no such file under the data roots ({listed}); received {value!r}")
