"""`optlab study --wait` (service/studies/follow.py): its progress, fed by a stand-in client, and the ranking
and the lines it prints under it."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from service import client as client_module
from service.client import ApiClient, ApiError
from service.studies.follow import comparison_lines, follow_study, ranking_table
from service.studies.summary import RANKING_CAVEAT, MetricPoint, StudyRun, StudySummary, summarize


def study(status: str, summary_error: str | None = None) -> dict[str, Any]:
    counts = {"succeeded": 2}
    row = {"steps_done": 40, "steps_total": 40, "counts": counts}
    return {
        "status": status,
        "summary_error": summary_error,
        "progress": {**row, "optimizers": [{"optimizer": "adam", **row}]},
    }


class Replies(ApiClient):
    """GET /studies/1, answered from a list (its last answer repeated); an ApiError in it is raised."""

    def __init__(self, *answers: dict[str, Any] | ApiError) -> None:
        super().__init__("http://api.test")
        self.answers = list(answers)

    def study(self, study_id: int) -> dict[str, Any]:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, ApiError):
            raise answer
        return answer


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


def summary_of(finals: dict[str, float], baseline: str | None = None) -> StudySummary:
    runs = [
        StudyRun(job, optimizer, {"lr": 0.1}, seed, "succeeded", {"val/loss": [MetricPoint(10, 1.0, final)]})
        for job, (optimizer, final) in enumerate(finals.items())
        for seed in (0, 1)
    ]
    return summarize(runs, target=None, baseline=baseline, selection_metric="val/loss", selection_mode="min")


def test_the_cli_prints_the_reports_caveat_on_what_the_ranking_says() -> None:
    """The terminal showed a ranking with no word that it orders means chosen on the seeds it reports."""
    assert comparison_lines(summary_of({"a": 0.4, "b": 0.5}))[0] == RANKING_CAVEAT
    lines = comparison_lines(summary_of({"a": 0.4, "b": 0.5}, baseline="b"))
    assert lines[0] == RANKING_CAVEAT and lines[1].startswith("a vs b on val/loss over 2 seeds")


def test_the_ranking_table_shows_a_tie_as_one_rank() -> None:
    out = io.StringIO()
    Console(file=out, width=200).print(ranking_table(summary_of({"a": 0.4, "b": 0.5, "c": 0.5, "d": 0.6})))
    ranks = re.findall(r"^\W*(\d)\W+([abcd])\W", out.getvalue(), re.MULTILINE)
    assert ranks == [("1", "a"), ("2", "b"), ("2", "c"), ("4", "d")], out.getvalue()


def test_only_the_study_s_bar_shows_the_time_elapsed() -> None:
    """Each optimizer's bar counted from the study's start (adam 0:33, sgd 0:55 for equal work), which
    read as a speed comparison; and an optimizer labelled "all" keeps a bar of its own."""
    answer = study("done")
    answer["progress"]["optimizers"] = [
        {"optimizer": "all", **{k: answer["progress"][k] for k in ("steps_done", "steps_total", "counts")}}
    ]
    out = io.StringIO()
    follow_study(Replies(answer), 1, console=Console(file=out, width=200, force_terminal=False), poll_s=0)
    bars = [line for line in out.getvalue().splitlines() if line.startswith("all")]
    assert len(bars) == 2, out.getvalue()
    assert sum(bool(re.search(r"\d:\d\d:\d\d\s*$", line)) for line in bars) == 1, bars


def test_the_wait_goes_on_through_an_api_whose_store_does_not_answer(monkeypatch: Any) -> None:
    """A 503 (the job store down for a few seconds) ended `optlab study --wait`; the study went on."""
    monkeypatch.setattr(client_module, "UNREACHABLE_POLL_S", 0.0)
    down = ApiError(503, "the job store does not answer; retry in 1 s")
    ended = follow_study(
        Replies(study("running"), down, down, study("done")), 1, console=Console(file=io.StringIO()), poll_s=0
    )
    assert ended["status"] == "done"
    refused = ApiError(404, "no study with id 1")
    with pytest.raises(ApiError, match="no study with id 1"):
        follow_study(Replies(refused), 1, console=Console(file=io.StringIO()), poll_s=0)


def test_the_cli_says_why_jobs_failed_in_a_few_lines(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed "0/7 ok (7 failed)" and "no succeeded seed" with no word of why (the report said)."""
    from service import cli

    runs = [
        StudyRun(
            job, "adam", {"lr": 0.1}, job, "failed", {}, error=f"ValueError: lr refused {job}\nits detail"
        )
        for job in range(7)
    ]
    summary = summarize(runs, target=None, baseline=None, selection_metric="val/loss", selection_mode="min")
    ended = {
        "id": 3,
        "status": "done",
        "jobs": list(range(7)),
        "summary": summary.model_dump(mode="json"),
        "report_url": "/studies/3/report",
        "progress": {"counts": {"failed": 7}},
    }
    monkeypatch.setattr(ApiClient, "submit_study", lambda self, body: {**ended, "status": "running"})
    monkeypatch.setattr("service.studies.follow.follow_study", lambda client, study_id: ended)
    spec = tmp_path / "study.json"
    spec.write_text('{"name": "s"}')
    assert cli.main(["study", str(spec), "--wait", "--api", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr().out
    assert "failed, diverged and cancelled jobs (7; the report lists every one):" in out, out
    assert "  job 0 (adam lr=0.1 seed 0) failed: ValueError: lr refused 0\n" in out, out
    assert "lr refused 4" in out and "lr refused 5" not in out and "its detail" not in out, out
    assert "  ... and 2 more\n" in out, out
