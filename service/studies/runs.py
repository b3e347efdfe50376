"""A study in MLflow: one experiment, a parent run, each job's run nested under it.

The worker creates the parent run before it starts the study's first job (the API never talks to
MLflow). Two workers may start two of its jobs at once, and a worker may die between creating the
run and recording it, so creation is find-or-create by the run's `study_id` tag, recorded with a
conditional update: the first recorded run is the parent; a worker whose own new run lost deletes it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jobs.spec import StudyMember, StudySpec, grid_text, mlflow_param_text
from jobs.tracking import MAX_PARAMS_PER_BATCH, OUTCOME_TAG, experiment_chart_url, experiment_id_for
from service import mlflow_import
from service.models import Job, Study
from service.secrets import split_credentials
from service.studies import store as study_store

log = logging.getLogger("optlab.worker")

PARENT_ROLE = "parent"
CHILD_ROLE = "child"
# Tags the job runner sets itself; a grid hyperparameter of the same name is tagged `grid.<name>`.
RESERVED_TAGS = {"job_id", "framework", "optimizer", "style", "attempt", "submitted_by", "kind", "workload"}
RESERVED_TAGS |= {"study", "study_id", "study_role", "seed", OUTCOME_TAG}


def mlflow_client(tracking_uri: str) -> Any:
    # Through service.mlflow_import: the finalizer's thread and a job's may import MLflow at once.
    return mlflow_import.mlflow_client(tracking_uri)


def child_tags(study: Study, member: StudyMember) -> dict[str, str]:
    """`study`, `optimizer` (the entry's label), each grid hyperparameter, `seed`: what the MLflow UI
    groups and filters by."""
    tags = {
        "study": study.name,
        "study_id": str(study.id),
        "study_role": CHILD_ROLE,
        "optimizer": member.optimizer,
    }
    for key, value in member.grid.items():
        tags[f"grid.{key}" if key in RESERVED_TAGS else key] = grid_text(value)
    tags["seed"] = str(member.seed)
    return tags


def child_arguments(*, sessions: Any, tracking_uri: str, job: Job) -> list[str]:
    """`python -m jobs.run` arguments that name a study's job's run and nest it under the parent."""
    if job.study_id is None:
        return []
    with sessions() as session:
        study = study_store.get_study(session=session, study_id=job.study_id)
    member = study_store.member_of(study, job.id) if study is not None else None
    if study is None or member is None:
        return []
    parent = ensure_parent_run(sessions=sessions, tracking_uri=tracking_uri, study=study)
    tags = [f"--tag={key}={value}" for key, value in child_tags(study, member).items()]
    return [f"--run-name={member.run_name()}", f"--parent-run-id={parent}", *tags]


def ensure_parent_run(*, sessions: Any, tracking_uri: str, study: Study) -> str:
    """The study's parent run id, created (once) if it has none yet."""
    if study.parent_run_id:
        return study.parent_run_id
    spec = StudySpec.model_validate(study.spec)
    client = mlflow_client(tracking_uri)
    restored: list[str] = []
    experiment_id = experiment_id_for(client, spec.experiment_name, warnings=restored)
    for warning in restored:  # its jobs' runs find the experiment restored: the study's start says it
        log.warning("study %s: %s", study.id, warning)
    found = client.search_runs(
        [experiment_id],
        filter_string=study_filter(study.id, PARENT_ROLE),
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    run_id = found[0].info.run_id if found else _create_parent(client, experiment_id, study, spec)
    with sessions() as session:
        recorded = study_store.set_parent_run(
            session=session, study_id=study.id, experiment_id=experiment_id, run_id=run_id
        )
    if recorded != run_id and not found:
        client.delete_run(run_id)  # another worker recorded its own first
    assert recorded is not None
    return recorded


def _create_parent(client: Any, experiment_id: str, study: Study, spec: StudySpec) -> str:
    from mlflow.entities import Param

    tags = {"study": study.name, "study_id": str(study.id), "study_role": PARENT_ROLE}
    if study.submitted_by:
        tags["submitted_by"] = study.submitted_by
    run = client.create_run(experiment_id, run_name=f"study {study.name}", tags=tags)
    params = {
        "framework": spec.framework,
        "workload.name": spec.workload.name,
        **{f"workload.{k}": str(v) for k, v in spec.workload.params.items()},
        "schedule.name": spec.schedule.name,
        "optimizers": ",".join(o.key for o in spec.optimizers),
        "seeds": ",".join(map(str, spec.seeds)),
        "steps": str(spec.steps),
        "batch_size": str(spec.batch_size),
        "jobs": str(len(study.members)),
        "baseline": spec.baseline or "",
        "eval_every": str(spec.eval_every),
        **grid_params(spec),
        # A study without one is judged against its workload's default: the finalizer logs that one.
        **(target_params(spec.target.metric, spec.target.mode, spec.target.value) if spec.target else {}),
    }
    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):  # up to 32 optimizers, 64 workload params
        client.log_batch(run.info.run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])
    client.log_dict(run.info.run_id, study.spec, "study.json")
    return str(run.info.run_id)


def grid_params(spec: StudySpec) -> dict[str, str]:
    """`grid.<optimizer>`: each optimizer's grid axes as JSON, `{"lr":[0.001,0.003]}` (`{}` for none).
    Cut short where MLflow's limit requires it: study.json, beside them, holds the whole spec."""
    return {
        f"grid.{optimizer.key}": mlflow_param_text(
            json.dumps(optimizer.axes(), separators=(",", ":")), whole="study.json"
        )
        for optimizer in spec.optimizers
    }


def target_params(metric: str, mode: str, value: float) -> dict[str, str]:
    """The target the study is judged against, as the parent run's params."""
    return {"target.metric": metric, "target.mode": mode, "target.value": str(value)}


def log_missing_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    """Log the params the run lacks: MLflow refuses to change a param's value, and a finalizer run
    again may see another default target (a newer catalogue) than the one it logged before."""
    from mlflow.entities import Param

    logged = client.get_run(run_id).data.params
    missing = [Param(key, value) for key, value in params.items() if key not in logged]
    if missing:
        client.log_batch(run_id, params=missing)


def study_filter(study_id: int, role: str) -> str:
    """MLflow's search filter for a study's runs in `role`: by id, since studies of one name share an
    experiment and a `study` tag."""
    return f"tags.study_id = '{study_id}' AND tags.study_role = '{role}'"


def study_runs_url(tracking_uri: str, experiment_id: str, study_id: int) -> str:
    """The study's job runs as charts in the MLflow UI: its own child runs only, flat (the parent's
    summary scalars, one bar each, and another study of the same name left out), so their curves show."""
    return experiment_chart_url(tracking_uri, experiment_id, search_filter=study_filter(study_id, CHILD_ROLE))


def shown_tracking_uri(tracking_uri: str) -> str:
    """The tracking URI without credentials, for the URLs a study shows."""
    return split_credentials(tracking_uri)[0]
