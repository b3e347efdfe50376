"""Check table (being written)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

CHECKS: Mapping[str, Callable[[Any], Any]] = {}
