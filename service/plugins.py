"""Plugins without restarts: notice when a plugin folder's files change.

The worker publishes the optimizer catalogue at start; a user who drops or edits a file in
a folder of `OPTLAB_PLUGIN_DIRS` should not have to restart workers to train with it. A
`PluginWatcher` takes a cheap fingerprint of the folders (the name, size and modification
time of every `*.py` file, exactly the files the registry loads) and says when it changed;
the worker then publishes the catalogue again, load errors included. Job processes load the
registry anew for every job, so they see the new file without any of this.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from optimizers.registry import PLUGIN_DIRS_ENV, PLUGIN_SOURCE, plugin_dirs_from_environment

__all__ = [
    "PLUGIN_DIRS_ENV",
    "PLUGIN_SOURCE",
    "PluginWatcher",
    "fingerprint",
    "plugin_dirs_from_environment",
    "plugin_files_by_name",
]

Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(folders: Iterable[Path]) -> Fingerprint:
    """(path, size, mtime in ns) of every `*.py` file directly in `folders`; a missing folder has none."""
    found = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".py") and entry.is_file():
                info = entry.stat()
                found.append((entry.path, info.st_size, info.st_mtime_ns))
    return tuple(sorted(found))


class PluginWatcher:
    """Says when the plugin folders hold other files than the catalogue was last published from."""

    def __init__(self, folders: Iterable[Path]) -> None:
        self.folders = list(folders)
        self.published = fingerprint(self.folders)  # the worker sets it each time it publishes
        self._previous = self.published

    def poll(self) -> Fingerprint | None:
        """The folders' fingerprint when it differs from the published one and has not changed
        since the previous poll (so a file still being written is not published half-done)."""
        now = fingerprint(self.folders)
        settled = now == self._previous and now != self.published
        self._previous = now
        return now if settled else None


def plugin_files_by_name(catalogue: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each plugin optimizer's name -> the files the catalogue found it in (one per style it is in).
    A job whose spec records no file of its own (one the API validated does) is told these
    (`jobs.run --plugin-file`), so it reads its own optimizer's file only."""
    files: dict[str, list[str]] = {}
    for optimizer in catalogue.get("optimizers", []):
        source = str(optimizer.get("source") or "")
        if source.startswith(PLUGIN_SOURCE):
            files.setdefault(optimizer["name"], []).append(source.removeprefix(PLUGIN_SOURCE))
    return files
