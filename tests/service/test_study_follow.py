"""`optlab study --wait`'s progress (service/studies/follow.py), fed by a stand-in client."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from service.studies.follow import follow_study


def study(status: str, summary_error: str | None = None) -> dict[str, Any]:
    counts = {"succeeded": 2}
    row = {"steps_done": 40, "steps_total": 40, "counts": counts}
    return {
        "status": status,
        "summary_error": summary_error,
        "progress": {**row, "optimizers": [{"optimizer": "adam", **row}]},
    }


class Replies:
    """GET /studies/1, answered from a list (its last answer repeated)."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)

    def study(self, study_id: int) -> dict[str, Any]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_summary_that_keeps_failing_is_shown_once_while_waiting() -> None:
    """Every job ended and the summary failed: the bars stood full with no word of why it waited."""
    error = "ValidationError: 4 validation errors for GridPointSummary\ngrid.betas.float ..."
    replies = Replies(
        study("summarizing"), study("summarizing", error), study("summarizing", error), study("done")
    )
    out = io.StringIO()
    ended = follow_study(replies, 1, console=Console(file=out, width=200), poll_s=0)  # type: ignore[arg-type]
    assert ended["status"] == "done"
    shown = out.getvalue()
    line = (
        "the summary could not be made yet (retried): ValidationError: 4 validation errors for "
        "GridPointSummary"
    )
    assert shown.count(line) == 1, shown
    assert "grid.betas.float" not in shown
