"""What a study puts in MLflow and how it links there: the study's own child runs as a flat chart
list, the parent run's overview, and the parent's params (grid, cadence, target); against a stand-in
for MlflowClient and a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import JobStatus
from jobs.spec import MAX_MLFLOW_PARAM_CHARS, Catalogue, StudyMember, StudySpec, study_errors
from service.models import Job, Study
from service.studies import finalize as finalize_module
from service.studies import runs as study_runs
from service.studies import store as study_store
from service.studies.report import Report
from service.studies.runs import ensure_parent_run, study_runs_url
from service.studies.schemas import StudyRead

SPEC: dict[str, Any] = {
    "name": "sweep",
    "workload": {"name": "digits_mlp"},
    "optimizers": [
        {"name": "sgd", "params": {"lr": [0.1, 0.2], "momentum": 0.9}},
        {"name": "adam", "label": "adam_fixed", "params": {"lr": 0.001}},
    ],
    "seeds": [0],
    "steps": 10,
    "eval_every": 5,
}
TARGET = {"metric": "val/accuracy", "mode": "max", "value": 0.9}
CHILD_FILTER = "tags.study_id%20%3D%20%27{id}%27%20AND%20tags.study_role%20%3D%20%27child%27"


def make_study(sessions: sessionmaker[Session], catalogue_data: dict[str, Any], **spec: Any) -> Study:
    study_spec = StudySpec.model_validate({**SPEC, **spec})
    catalogue = Catalogue.model_validate(catalogue_data)
    errors, jobs = study_errors(study_spec, catalogue, max_steps=100, max_jobs=10)
    assert not errors
    with sessions() as session:
        return study_store.create_study(session=session, spec=study_spec, jobs=jobs, submitted_by="alice")


class FakeClient:
    """Records the runs, params and ends the study code asks MLflow for."""

    def __init__(self) -> None:
        self.experiments: dict[str, SimpleNamespace] = {}
        self.params: dict[str, dict[str, str]] = {}
        self.param_batches: list[int] = []
        self.terminated: list[tuple[str, str]] = []

    def get_experiment_by_name(self, name: str) -> SimpleNamespace | None:
        return self.experiments.get(name)

    def create_experiment(self, name: str, tags: dict[str, str]) -> str:
        self.experiments[name] = SimpleNamespace(experiment_id="4", lifecycle_stage="active", tags=tags)
        return "4"

    def search_runs(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def create_run(self, experiment_id: str, *, run_name: str, tags: dict[str, str]) -> SimpleNamespace:
        run_id = f"run-{len(self.params) + 1}"
        self.params[run_id] = {}
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id))

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
        if params:
            self.param_batches.append(len(params))
        for param in params:
            # MLflow's own rules: a value changed is refused, and so is one over 6000 characters.
            assert self.params[run_id].get(param.key, param.value) == param.value, param.key
            assert len(param.value) <= MAX_MLFLOW_PARAM_CHARS, param.key
            self.params[run_id][param.key] = param.value

    def get_run(self, run_id: str) -> SimpleNamespace:
        return SimpleNamespace(
            info=SimpleNamespace(lifecycle_stage="active"),
            data=SimpleNamespace(params=dict(self.params[run_id])),
        )

    def log_dict(self, run_id: str, data: Any, path: str) -> None:
        return None

    def log_artifacts(self, run_id: str, folder: str) -> None:
        return None

    def set_terminated(self, run_id: str, status: str) -> None:
        self.terminated.append((run_id, status))


@pytest.fixture
def mlflow(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    fake = FakeClient()
    monkeypatch.setattr(study_runs, "mlflow_client", lambda tracking_uri: fake)
    monkeypatch.setattr(finalize_module, "mlflow_client", lambda tracking_uri: fake)
    return fake


def test_the_study_links_to_its_own_child_runs_listed_flat() -> None:
    """The experiment's chart view showed the collapsed parent (its summary scalars as one-bar charts)
    and, where two studies share a name, both studies' runs: the link filters on the study's id and
    sorts by name, which MLflow's UI lists flat (sorted by creation time it nests children, collapsed)."""
    assert study_runs_url("http://h:5000/", "4", 12) == (
        "http://h:5000/#/experiments/4/runs?compareRunsMode=CHART&searchFilter="
        + CHILD_FILTER.format(id=12)
        + "&orderByKey=tags.%60mlflow.runName%60&orderByAsc=true"
    )


def test_the_study_read_links_its_runs_and_its_parents_overview(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any]
) -> None:
    study = make_study(sessions, catalogue_data)
    with sessions() as session:
        study_store.set_parent_run(session=session, study_id=study.id, experiment_id="4", run_id="p1")
        row = study_store.get_study(session=session, study_id=study.id)
        assert row is not None
        read = StudyRead.from_row(row, [], tracking_uri="http://alice:secret@h:5000")
    assert read.mlflow is not None
    assert read.mlflow.url == study_runs_url("http://h:5000", "4", study.id)
    # The overview, not the model-metrics tab's wall of one-bar charts: params, children, artifacts.
    assert read.mlflow.parent_run_url == "http://h:5000/#/experiments/4/runs/p1"


def test_the_parent_run_holds_the_grid_the_cadence_and_the_target(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any], mlflow: FakeClient
) -> None:
    study = make_study(sessions, catalogue_data, target=TARGET)
    run_id = ensure_parent_run(sessions=sessions, tracking_uri="http://h:5000", study=study)
    params = mlflow.params[run_id]
    assert params["grid.sgd"] == '{"lr":[0.1,0.2]}'
    assert params["grid.adam_fixed"] == "{}"  # no grid: its fixed params are in study.json
    assert params["eval_every"] == "5"
    assert (params["target.metric"], params["target.mode"], params["target.value"]) == (
        "val/accuracy",
        "max",
        "0.9",
    )


def test_a_long_grid_is_cut_to_mlflows_limit_and_many_params_are_batched(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any], mlflow: FakeClient
) -> None:
    study = make_study(sessions, catalogue_data)
    spec = StudySpec.model_validate(
        {
            **SPEC,
            "optimizers": [{"name": "sgd", "label": f"sgd{i}", "params": {"lr": 0.1}} for i in range(32)],
            "workload": {"name": "digits_mlp", "params": {f"p{i}": i for i in range(64)}},
        }
    )
    # Over 12,000 characters of JSON (set past validation, as the job cap would refuse so many points;
    # a few long string values get there within it).
    long_grid: list[Any] = [1e-3 + i * 1e-9 for i in range(1000)]
    spec.optimizers[0].params["lr"] = long_grid
    study.spec = spec.model_dump(mode="json")
    run_id = ensure_parent_run(sessions=sessions, tracking_uri="http://h:5000", study=study)
    grid = mlflow.params[run_id]["grid.sgd0"]
    assert len(grid) == MAX_MLFLOW_PARAM_CHARS and grid.startswith('{"lr":[0.001,')
    assert grid.endswith("characters in all; the whole is in the run's study.json)")
    assert max(mlflow.param_batches) <= 100 and len(mlflow.params[run_id]) > 100


def test_a_grid_hyperparameter_named_like_the_outcome_tag_keeps_its_own_tag() -> None:
    """The job's run is tagged `outcome` as it ends (and untagged as it resumes): a grid value of that
    name is tagged `grid.outcome` instead, as for the other tags the runner sets."""
    study = SimpleNamespace(id=3, name="sweep")
    tags = study_runs.child_tags(study, StudyMember(optimizer="sgd", grid={"outcome": 2}, seed=0))  # type: ignore[arg-type]
    assert tags["grid.outcome"] == "2" and "outcome" not in tags


def finalize(sessions: sessionmaker[Session], study: Study, catalogue: Catalogue) -> str | None:
    """Finalize `study` with no child runs to read; the MLflow link its report was given."""
    given: dict[str, str | None] = {}

    def render(*args: Any, mlflow_url: str | None = None, **kwargs: Any) -> Report:
        given["url"] = mlflow_url
        return Report(html="<p>", images={})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finalize_module, "collect_runs", lambda client, study, jobs, **_: [])
        patch.setattr(finalize_module, "render_report", render)
        finalize_module.finalize(
            sessions=sessions, tracking_uri="http://h:5000", study=study, catalogue=catalogue
        )
    return given["url"]


def test_the_report_links_the_studys_own_runs_and_its_parent_records_the_default_target(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any], mlflow: FakeClient
) -> None:
    """A study that names no target is judged against its workload's default: the parent run says which."""
    data = json.loads(json.dumps(catalogue_data))
    data["workloads"][0]["default_target"] = TARGET
    study = make_study(sessions, catalogue_data)
    assert finalize(sessions, study, Catalogue.model_validate(data)) == study_runs_url(
        "http://h:5000", "4", study.id
    )
    ((run_id, params),) = mlflow.params.items()
    assert (params["target.metric"], params["target.mode"], params["target.value"]) == (
        "val/accuracy",
        "max",
        "0.9",
    )
    assert mlflow.terminated == [(run_id, "FINISHED")]
    # Finalized again (its claim expired mid-way) against a newer default: the target logged stays.
    data["workloads"][0]["default_target"] = {**TARGET, "value": 0.95}
    with sessions() as session:
        again = study_store.get_study(session=session, study_id=study.id)
    assert again is not None
    finalize(sessions, again, Catalogue.model_validate(data))
    assert mlflow.params[run_id]["target.value"] == "0.9"


def test_a_study_whose_parent_run_was_deleted_is_done_with_its_summary_kept_by_optlab(
    sessions: sessionmaker[Session], catalogue_data: dict[str, Any], tmp_path: Path
) -> None:
    """The parent run deleted in MLflow's UI while the study ran: every write to it was refused, and
    the summary was retried every 30 s for ever, the study `summarizing`, neither cancellable nor
    reported. Against a real MLflow (SQLite) store."""
    from mlflow.tracking import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = make_study(sessions, catalogue_data, experiment="deleted-parent")
    parent = ensure_parent_run(sessions=sessions, tracking_uri=tracking_uri, study=study)
    MlflowClient(tracking_uri).delete_run(parent)
    with sessions() as session:
        session.execute(update(Job).where(Job.study_id == study.id).values(status=JobStatus.CANCELLED))
        session.commit()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finalize_module, "collect_runs", lambda client, study, jobs, **_: [])
        assert finalize_module.finalize_next_study(sessions=sessions, tracking_uri=tracking_uri, within_s=60)
    with sessions() as session:
        done = study_store.get_study(session=session, study_id=study.id)
        assert done is not None
        read = StudyRead.from_row(
            done, study_store.study_jobs(session=session, study_id=study.id), tracking_uri=tracking_uri
        )
    assert read.status == "done" and read.summary is not None and read.report_url is not None
    assert read.summary_error is not None and f"parent run {parent} was deleted" in read.summary_error
    assert any(f"parent run {parent} was deleted" in note for note in read.summary.notes)
