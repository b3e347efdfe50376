"""No false alarms: every framework built-in the issue names and every optimizer in our
catalogue, in every style, passes every check that applies (no `fail`).

The catalogue part is the registry itself, so a newly registered optimizer is held to
the same standard without editing this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.checks.report import CHECK_IDS, CheckReport
from jobs.checks.runner import run_checks
from optimizers.registry import load_registry
from tests.checks.tables import FRAMEWORK_BUILTINS, target_of


def _catalogue() -> list[tuple[str, str]]:
    """(name, style) of every registered built-in, all three styles."""
    return sorted(load_registry(plugin_dirs=[]).entries)


def _assert_no_failures(report: CheckReport) -> None:
    assert [c.id for c in report.checks] == list(CHECK_IDS)
    failures = [f"{c.id}: {c.detail}" for c in report.checks if c.status == "fail"]
    assert not failures, f"{report.target} ({report.style}) failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("text", FRAMEWORK_BUILTINS)
def test_framework_builtin_passes(text: str, tmp_path: Path) -> None:
    _assert_no_failures(run_checks(target_of(text), {}, workdir=tmp_path))


@pytest.mark.parametrize(("name", "style"), _catalogue(), ids=lambda v: str(v))
def test_catalogue_optimizer_passes(name: str, style: str, tmp_path: Path) -> None:
    _assert_no_failures(run_checks(target_of(name, style), {}, workdir=tmp_path))
