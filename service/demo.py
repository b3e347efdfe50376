"""`make demo`: start everything, train three optimizers over HTTP, compare them, stop."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from jobs.result import JobStatus
from jobs.spec import optimizer_label
from jobs.tracking import experiment_chart_url
from service.client import ApiClient, ApiError, result_of, status_of
from service.progress import follow_jobs
from service.settings import Settings
from service.supervisor import ServeError, Supervisor


def load_specs(folder: Path) -> list[dict[str, Any]]:
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no job specs (*.json) in {folder}")
    return [json.loads(path.read_text()) for path in paths]


def run_demo(settings: Settings, specs_dir: Path) -> int:
    console = Console()
    try:
        specs = load_specs(specs_dir)
    except (OSError, ValueError) as exc:
        console.print(Text(f"optlab demo: {exc}", style="red"))
        return 2
    console.print("Starting MLflow, the API and a worker (the first start takes a minute)...")
    try:
        with Supervisor(settings) as supervisor:
            client = ApiClient(supervisor.api_url)
            try:
                jobs = [client.submit(spec) for spec in specs]
            except ApiError as exc:
                console.print(Text(f"optlab demo: the API refused a demo spec: {exc}", style="red"))
                return 1
            console.print(f"Submitted {len(jobs)} jobs over HTTP to {supervisor.api_url}")
            final = follow_jobs(
                client, {job["id"]: optimizer_label(job["spec"]["optimizer"]) for job in jobs}, console
            )
            console.print(comparison_table(list(final.values())))
            experiment_ids = {job["mlflow"]["experiment_id"] for job in final.values() if job.get("mlflow")}
            for experiment_id in sorted(experiment_ids):
                url = experiment_chart_url(supervisor.mlflow_url, experiment_id)
                console.print(f"Compare the runs in the MLflow UI: {url}")
            # The link is dead once the demo stops its MLflow server: say how to open it.
            console.print(
                "Stopping everything now. To open that link, run `make serve`: it keeps the service and "
                "the MLflow UI running, with these runs, on the same ports."
            )
            ok = all(status_of(job) is JobStatus.SUCCEEDED for job in final.values())
    except ServeError as exc:
        console.print(Text(f"optlab demo: {exc}", style="red"))
        return 1
    return 0 if ok else 1


def comparison_table(jobs: list[dict[str, Any]]) -> Table:
    table = Table(title="digits_mlp: optimizers compared")
    for column in (
        "job",
        "optimizer",
        "status",
        "val accuracy",
        "val loss",
        "samples/s",
        "checkpoints verified",
    ):
        table.add_column(column, justify="left" if column in ("optimizer", "status") else "right")
    for job in sorted(jobs, key=lambda j: j["id"]):
        result = result_of(job)
        final = (result.final if result else None) or {}
        checkpoints = (result.checkpoints if result else None) or []
        table.add_row(
            str(job["id"]),
            optimizer_label(job["spec"]["optimizer"]),
            status_of(job),
            _fmt(final.get("val_accuracy"), ".3f"),
            _fmt(final.get("val_loss"), ".4f"),
            _fmt(result.samples_per_sec if result else None, ",.0f"),
            f"{(result.checkpoints_verified if result else None) or 0}/{len(checkpoints)}",
        )
    return table


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


if __name__ == "__main__":
    sys.exit(run_demo(Settings(), Path("examples/demo")))
