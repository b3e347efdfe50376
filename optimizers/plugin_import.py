"""Import a Python file as a module: the registry's plugin files and the checker's `file.py:Class`.

In optimizers/ rather than jobs/ because both use it and imports point one way
(jobs -> optimizers, never back).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


class NotAModule(ImportError):
    """`path` cannot be loaded as a Python module at all (not: the module's own import failed)."""


def module_name_for(path: Path, *, prefix: str) -> str:
    """`<prefix>_<stem>_<hash of the absolute path>`: same-named files in two folders stay apart."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    return f"{prefix}_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"


def import_file(path: Path, *, prefix: str, reuse: bool = False) -> ModuleType:
    """Execute `path` as a module registered in `sys.modules` (dataclasses and pickling look classes
    up there); `reuse`: return the module if this file was imported before.

    FileNotFoundError when `path` is no file, NotAModule when it cannot be loaded as a module; the
    module's own errors propagate as they are, and leave nothing half-imported behind.
    """
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    module_name = module_name_for(path, prefix=prefix)
    if reuse and module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise NotAModule(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
