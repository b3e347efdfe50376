"""The checker catches: each deliberately broken optimizer in tests/checks/broken fails
exactly the checks its file names in EXPECTED_FAILURES, and no other.

Warnings named in EXPECTED_WARNINGS must be raised too (step_cost and deprecations only
ever warn); other warnings are allowed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.checks.report import CHECK_IDS
from jobs.checks.runner import run_checks
from tests.checks.tables import Broken, broken_corpus, target_of

CORPUS = broken_corpus()


def test_every_check_has_a_broken_optimizer() -> None:
    caught = set().union(*(b.expected_failures | b.expected_warnings for b in CORPUS))
    # device_placement needs a GPU: without one it is skipped, and nothing can fail it here.
    missing = sorted(set(CHECK_IDS) - caught - {"device_placement"})
    assert not missing, f"no broken optimizer demonstrates: {', '.join(missing)}"


@pytest.mark.parametrize("broken", CORPUS, ids=lambda b: b.path.stem)
def test_broken_optimizer_fails_exactly_its_check(broken: Broken, tmp_path: Path) -> None:
    report = run_checks(target_of(broken.text), {}, workdir=tmp_path)
    by_status = {status: {c.id for c in report.checks if c.status == status} for status in ("fail", "warn")}
    noted = [c for c in report.checks if c.status in ("fail", "warn")]
    details = "\n".join(f"{c.id} {c.status}: {c.detail}" for c in noted)
    assert by_status["fail"] == broken.expected_failures, details
    assert broken.expected_warnings <= by_status["warn"], details
    for check in report.checks:
        if check.id in broken.expected_failures:
            # A fail says where: the user's file.
            assert broken.path.name in check.detail or broken.path.name in check.where, check
            assert "Fix:" in check.detail, check
