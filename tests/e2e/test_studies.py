"""Studies end to end: `optlab serve` (API, worker, MLflow server), a 2 x 2 x 2 study on digits_mlp
whose summary is checked against figures computed here from the child runs read back from MLflow,
its nested runs and tags, its report; a study with a failing optimizer, cancelled mid-way.

One service for the module (its tests share it and run in order on one worker).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from scipy import stats

from service.settings import Settings
from service.studies.runs import study_runs_url
from service.studies.summary import StudySummary
from service.supervisor import Supervisor
from tests.conftest import free_port
from tests.e2e.test_service import EXPLODING_PLUGIN

# Generous: the study's jobs are real processes, slow on a loaded 2-core machine.
pytestmark = [pytest.mark.xdist_group("e2e_studies"), pytest.mark.timeout(600)]

TARGET = {"metric": "val/accuracy", "mode": "max", "value": 0.5}
STUDY: dict[str, Any] = {
    "name": "e2e adam vs sgd",
    "workload": {"name": "digits_mlp", "params": {"hidden": 16}},
    "optimizers": [
        {"name": "adam", "params": {"lr": [0.003, 0.03]}},
        {"name": "sgd", "label": "sgd_momentum", "params": {"lr": [0.05, 0.2], "momentum": 0.9}},
    ],
    "seeds": [0, 1],
    "steps": 30,
    "batch_size": 32,
    "eval_every": 10,
    "checkpoint_every": 30,
    "target": TARGET,
    "baseline": "adam",
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "exploding.py").write_text(EXPLODING_PLUGIN)
    api_port, mlflow_port = free_port(), free_port()
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        api_port=api_port,
        mlflow_port=mlflow_port,
        mlflow_tracking_uri=f"http://127.0.0.1:{mlflow_port}",
        poll_interval_s=0.2,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPTLAB_PLUGIN_DIRS", str(plugins))
        with Supervisor(settings) as supervisor:
            # A second worker: the study's jobs run two at a time, and two workers race to create
            # its parent run (find-or-create, recorded once).
            supervisor._spawn("worker-2", [sys.executable, "-m", "service.cli", "worker"], supervisor._env())
            yield supervisor


@pytest.fixture(scope="module")
def api(service: Supervisor) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.api_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def mlflow(service: Supervisor) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(service.mlflow_url)


def wait_until_done(api: httpx.Client, study_id: int, timeout_s: float = 400) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        study: dict[str, Any] = api.get(f"/studies/{study_id}").json()
        if study["status"] == "done":
            return study
        time.sleep(0.5)
    raise AssertionError(f"study {study_id} not done after {timeout_s}s: {study['summary_error']} {study}")


@pytest.fixture(scope="module")
def cli_output(service: Supervisor, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`optlab study STUDY.yaml --wait`: submits, follows the study to its end, prints the ranking."""
    import yaml  # type: ignore[import-untyped]

    from service import cli

    path = tmp_path_factory.mktemp("study") / "study.yaml"
    path.write_text(yaml.safe_dump(STUDY))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(["study", str(path), "--wait", "--api", service.api_url])
    assert code == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


@pytest.fixture(scope="module")
def study(api: httpx.Client, cli_output: str) -> dict[str, Any]:
    found = re.search(r"^study (\d+) running: 8 jobs", cli_output, re.MULTILINE)
    assert found, cli_output[-3000:]
    return wait_until_done(api, int(found.group(1)))


def test_the_cli_follows_the_study_and_prints_the_ranking(
    cli_output: str, study: dict[str, Any], service: Supervisor
) -> None:
    assert "ranking on val/accuracy" in cli_output
    for row in StudySummary.model_validate(study["summary"]).ranking:
        assert re.search(rf"^\W*{row.rank}\W+{row.optimizer}\W", cli_output, re.MULTILINE), cli_output[-3000:]
    assert f"report: {service.api_url}{study['report_url']}\n" in cli_output
    assert f"MLflow: {study['mlflow']['url']}\n" in cli_output


def children_of(mlflow: Any, study: dict[str, Any]) -> list[Any]:
    return list(
        mlflow.search_runs(
            [study["mlflow"]["experiment_id"]],
            filter_string=f"tags.study_id = '{study['id']}' AND tags.study_role = 'child'",
        )
    )


def final_values(mlflow: Any, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow.get_metric_history(run_id, metric))


def describe(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, sample std, and the 95% Student's t interval of the mean of an accuracy (cut to [0, 1])."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.975, len(values) - 1) * std / math.sqrt(len(values))
    return mean, std, max(mean - half, 0.0), min(mean + half, 1.0)


def test_the_study_expands_into_jobs_visible_through_jobs(api: httpx.Client, study: dict[str, Any]) -> None:
    assert study["progress"]["counts"]["succeeded"] == 8 and study["progress"]["jobs"] == 8
    assert [(o["optimizer"], o["jobs"]) for o in study["progress"]["optimizers"]] == [
        ("adam", 4),
        ("sgd_momentum", 4),
    ]
    jobs = api.get("/jobs", params={"study": study["id"]}).json()
    assert jobs["total"] == 8 and {job["study_id"] for job in jobs["items"]} == {study["id"]}
    specs = sorted(
        (job["spec"]["optimizer"]["name"], job["spec"]["optimizer"]["params"]["lr"], job["spec"]["seed"])
        for job in jobs["items"]
    )
    assert specs == sorted(
        (name, lr, seed)
        for name, lrs in (("adam", (0.003, 0.03)), ("sgd", (0.05, 0.2)))
        for lr in lrs
        for seed in (0, 1)
    )
    assert all(job["spec"]["optimizer"]["params"].get("momentum", 0.9) == 0.9 for job in jobs["items"])
    assert study["report_url"] == f"/studies/{study['id']}/report"


def test_mlflow_holds_a_parent_run_and_nested_children_tagged_for_the_ui(
    mlflow: Any, study: dict[str, Any], service: Supervisor
) -> None:
    link = study["mlflow"]
    experiment = mlflow.get_experiment(link["experiment_id"])
    assert experiment.name == STUDY["name"]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # The study's own child runs, flat (MLflow's UI reads the filter and the order from the address).
    assert link["url"] == study_runs_url(service.mlflow_url, experiment.experiment_id, study["id"])
    assert link["parent_run_url"] == (
        f"{service.mlflow_url}/#/experiments/{experiment.experiment_id}/runs/{link['parent_run_id']}"
    )
    parent = mlflow.get_run(link["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.info.run_name == f"study {STUDY['name']}"
    # What the study was run with, beside the summary.
    params = parent.data.params
    assert json.loads(params["grid.adam"]) == {"lr": [0.003, 0.03]}
    assert json.loads(params["grid.sgd_momentum"]) == {"lr": [0.05, 0.2]}
    assert params["eval_every"] == "10"
    assert (params["target.metric"], params["target.mode"], params["target.value"]) == (
        "val/accuracy",
        "max",
        "0.5",
    )
    # Two workers started its jobs: one parent run all the same (a run that lost the race is deleted).
    parents = mlflow.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.study_id = '{study['id']}' AND tags.study_role = 'parent'",
    )
    assert [run.info.run_id for run in parents] == [parent.info.run_id]
    children = children_of(mlflow, study)
    assert len(children) == 8
    names = sorted(run.info.run_name for run in children)
    assert names == sorted(
        f"{name} lr={lr} seed={seed}"
        for name, lrs in (("adam", ("0.003", "0.03")), ("sgd_momentum", ("0.05", "0.2")))
        for lr in lrs
        for seed in (0, 1)
    )
    for run in children:
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["study"] == STUDY["name"] and tags["study_id"] == str(study["id"])
        assert run.info.run_name == f"{tags['optimizer']} lr={tags['lr']} seed={tags['seed']}"
        assert run.info.status == "FINISHED" and tags["outcome"] == "succeeded"
    jobs_by_run = {job["run_id"]: job for job in study["jobs"]}
    assert set(jobs_by_run) == {run.info.run_id for run in children}


def test_the_summary_matches_figures_computed_from_the_child_runs(mlflow: Any, study: dict[str, Any]) -> None:
    summary = StudySummary.model_validate(study["summary"])
    assert summary.selection_metric == "val/accuracy" and summary.selection_mode == "max"
    finals: dict[tuple[str, float], dict[int, float]] = {}
    reached: dict[tuple[str, float], dict[int, int | None]] = {}
    for run in children_of(mlflow, study):
        tags = run.data.tags
        history = final_values(mlflow, run.info.run_id, "val/accuracy")
        assert [step for step, _ in history] == [10, 20, 30]
        point = (tags["optimizer"], float(run.data.params["optimizer.lr"]))
        finals.setdefault(point, {})[int(tags["seed"])] = history[-1][1]
        first = next((step for step, value in history if value >= TARGET["value"]), None)
        reached.setdefault(point, {})[int(tags["seed"])] = first
    assert len(finals) == 4
    for point, by_seed in finals.items():
        optimizer, lr = point
        (summarized,) = [p for p in summary.grid_points if p.optimizer == optimizer and p.grid == {"lr": lr}]
        stat = summarized.metric("val/accuracy")
        assert stat is not None and stat.final.n == 2
        mean, std, low, high = describe([by_seed[0], by_seed[1]])
        assert stat.final.mean == pytest.approx(mean, abs=1e-9)
        assert stat.final.std == pytest.approx(std, abs=1e-9)
        assert (stat.final.ci_low, stat.final.ci_high) == (
            pytest.approx(low, abs=1e-9),
            pytest.approx(high, abs=1e-9),
        )
        assert summarized.time_to_target is not None
        assert {s.seed: s.step if s.reached else None for s in summarized.time_to_target.seeds} == reached[
            point
        ]
    best = {
        optimizer: max(
            (lr for o, lr in finals if o == optimizer),
            key=lambda lr: statistics.fmean(finals[(optimizer, lr)].values()),
        )
        for optimizer in ("adam", "sgd_momentum")
    }
    assert {row.optimizer: row.grid for row in summary.ranking} == {o: {"lr": lr} for o, lr in best.items()}
    ranked = sorted(best, key=lambda o: -statistics.fmean(finals[(o, best[o])].values()))
    assert [row.optimizer for row in sorted(summary.ranking, key=lambda r: r.rank or 99)] == ranked
    (comparison,) = summary.comparisons
    assert (comparison.optimizer, comparison.baseline, comparison.n) == ("sgd_momentum", "adam", 2)
    differences = [
        finals[("sgd_momentum", best["sgd_momentum"])][s] - finals[("adam", best["adam"])][s] for s in (0, 1)
    ]
    assert comparison.mean_difference == pytest.approx(statistics.fmean(differences), abs=1e-9)
    assert "few" in comparison.conclusion  # two seeds cannot settle it, and it says so
    # No job of it was interrupted: each history holds only the attempt that ended it.
    assert not [note for note in summary.notes if "was interrupted at step" in note], summary.notes


def test_the_parent_run_holds_the_summary_metrics_and_the_report(mlflow: Any, study: dict[str, Any]) -> None:
    summary = StudySummary.model_validate(study["summary"])
    parent = mlflow.get_run(study["mlflow"]["parent_run_id"])
    flat = summary.flat_metrics()
    assert flat and parent.data.metrics == pytest.approx(flat)
    artifacts = {a.path for a in mlflow.list_artifacts(parent.info.run_id)}
    assert {"summary.json", "report.html", "images", "study.json"} <= artifacts
    assert [a.path for a in mlflow.list_artifacts(parent.info.run_id, "images")]


def test_the_report_is_html_whose_images_decode(api: httpx.Client, study: dict[str, Any]) -> None:
    from PIL import Image

    response = api.get(study["report_url"])
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', response.text)
    assert len(images) >= 3, response.text[:2000]
    for encoded in images:
        picture = Image.open(io.BytesIO(base64.b64decode(encoded)))
        picture.load()
        assert picture.format == "PNG" and picture.size[0] > 100
    assert STUDY["name"] in response.text and "sgd_momentum" in response.text


def test_a_failed_job_is_counted_and_a_cancelled_study_ends(
    api: httpx.Client, mlflow: Any, study: dict[str, Any]
) -> None:
    body = {
        "name": "e2e failing and cancelled",
        "workload": {"name": "digits_mlp"},
        "optimizers": [
            {"name": "exploding_optimizer", "params": {"lr": [0.1]}},
            {"name": "adam", "params": {"lr": [0.001]}},
        ],
        "seeds": [0],
        "steps": 500_000,
        "checkpoint_every": 100_000,
        "eval_every": 100_000,
        "baseline": "adam",
    }
    created = api.post("/studies", json=body)
    assert created.status_code == 201, created.text
    study_id = created.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        current = api.get(f"/studies/{study_id}").json()
        by_optimizer = {job["optimizer"]: job for job in current["jobs"]}
        if by_optimizer["exploding_optimizer"]["status"] == "failed" and by_optimizer["adam"]["step"] > 0:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"the study did not get there: {current}")
    cancelled = api.post(f"/studies/{study_id}/cancel", json={})
    assert cancelled.status_code == 200 and cancelled.json()["cancel_requested"]
    done = wait_until_done(api, study_id, timeout_s=120)
    assert done["progress"]["counts"] == {
        "queued": 0, "running": 0, "succeeded": 0, "failed": 1, "diverged": 0, "cancelled": 1,
    }  # fmt: skip
    summary = StudySummary.model_validate(done["summary"])
    assert (summary.counts.failed, summary.counts.cancelled, summary.counts.total) == (1, 1, 2)
    problems = {p.optimizer: p for p in summary.problems}
    assert problems["exploding_optimizer"].status == "failed"
    assert "boom" in (problems["exploding_optimizer"].error or "")
    assert mlflow.get_run(done["mlflow"]["parent_run_id"]).info.status == "KILLED"
    report = api.get(f"/studies/{study_id}/report").text
    assert "exploding_optimizer" in report and "failed" in report
    assert api.post(f"/studies/{study_id}/cancel", json={}).status_code == 409
