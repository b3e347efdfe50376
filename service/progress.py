"""Live progress bars for jobs followed over HTTP (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from jobs.result import JobStatus
from service.client import ApiClient, status_of


def follow_jobs(
    client: ApiClient, labels: dict[int, str], console: Console | None = None
) -> dict[int, dict[str, Any]]:
    """Show one bar per job (step / total, status, latest loss, why it waits) until every job has ended."""
    # The counts, status, loss and time are kept whole (no_wrap): in a terminal too narrow for every
    # column the bar shrinks and the label is cut first; the total had read "20000/2…".
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[status]:<10} loss {task.fields[loss]}", table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        TextColumn("{task.fields[waiting]}"),
        console=console,
    )
    tasks = {
        job_id: progress.add_task(
            escape(f"#{job_id} {label}"), total=None, status=JobStatus.QUEUED, loss="-", waiting=""
        )
        for job_id, label in labels.items()
    }

    def update(job: dict[str, Any]) -> None:
        loss = job.get("latest_loss")
        progress.update(
            tasks[job["id"]],
            completed=job["progress"]["step"],
            total=job["progress"]["total"],
            status=status_of(job),
            loss=f"{loss:.4f}" if isinstance(loss, float) else "-",
            # A queued job no worker can run, a running one held up, one that runs again: said where
            # the user looks.
            waiting=escape(job.get("waiting_reason") or interruption_line(job)),
        )

    with progress:
        return client.wait(list(labels), on_update=update)


def interruption_line(job: dict[str, Any]) -> str:
    """A job that lost an attempt: which attempt this is (or is to come) and why the last one ended."""
    interruption = job.get("interruption")
    if not interruption:
        return ""
    number = job["attempt"] + (status_of(job) is JobStatus.QUEUED)
    return f"attempt {number}: {interruption['message']}"
