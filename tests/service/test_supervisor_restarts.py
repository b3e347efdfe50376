"""`optlab serve` starts a part that exits again, and stops everything once a part keeps exiting
(the whole service, killed parts and all, is tried in tests/e2e/test_cli.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from service import supervisor as supervision
from service.settings import Settings
from service.supervisor import ServeError, Supervisor


def test_a_part_that_keeps_exiting_is_restarted_a_bounded_number_of_times(tmp_path: Path) -> None:
    parts = Supervisor(Settings(data_dir=tmp_path))
    parts.logs.mkdir(parents=True)
    parts._spawn("flaky", [sys.executable, "-c", "print('bad setting'); raise SystemExit(3)"], {})
    try:
        for restart in range(1, supervision.RESTARTS_ALLOWED + 1):
            parts.children[0].process.wait(timeout=30)
            [said] = parts.restart_exited()
            assert said.startswith(
                f"flaky exited with code 3; started it again (restart {restart} of at most 5"
            )
            assert f"Last lines of {parts.logs / 'flaky.log'}:\nbad setting" in said
        parts.children[0].process.wait(timeout=30)
        # Each start's lines begin after a marker, so a log tail says which start it shows.
        assert (
            "--- optlab serve: flaky started again (5) ---\nbad setting"
            in (parts.logs / "flaky.log").read_text()
        )
        with pytest.raises(
            ServeError, match="flaky exited with code 3, after 5 restarts within 10 minutes: stopping"
        ):
            parts.restart_exited()
    finally:
        parts.stop()


def test_restarts_longer_ago_than_the_window_do_not_count(tmp_path: Path) -> None:
    parts = Supervisor(Settings(data_dir=tmp_path))
    parts.logs.mkdir(parents=True)
    parts._spawn("flaky", [sys.executable, "-c", "raise SystemExit(3)"], {})
    parts.children[0].restarted_at = [time.monotonic() - supervision.RESTART_WINDOW_S - 1] * 5
    try:
        parts.children[0].process.wait(timeout=30)
        [said] = parts.restart_exited()
        assert "(restart 1 of at most 5" in said
    finally:
        parts.stop()


def test_one_port_for_the_api_and_mlflow_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Each port check found it free; MLflow then took it, the API died of it, and serve reported
    "mlflow exited with code 0"."""
    parts = Supervisor(Settings(data_dir=tmp_path, api_port=18223, mlflow_port=18223))
    with pytest.raises(
        ServeError, match=r"^--port and --mlflow-port are both 18223: the API and MLflow need"
    ):
        parts.start()
    assert parts.children == []
