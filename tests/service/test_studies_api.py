"""The study routes without a worker: validation (422 naming the field), the job cap, quotas and
atomicity (all of a study's jobs or none), the `?study=` filter, cancelling, 404/409s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from jobs.result import JobStatus
from service import store
from service.models import Job, Study
from service.settings import Settings
from service.studies import store as study_store

STUDY: dict[str, Any] = {
    "name": "lion-vs-adam",
    "workload": {"name": "digits_mlp"},
    "optimizers": [
        {"name": "lion", "params": {"lr": [0.0001, 0.0003]}},
        {"name": "adam", "params": {"lr": [0.001, 0.003], "eps": 1e-7}},
    ],
    "seeds": [0, 1],
    "steps": 20,
    "eval_every": 10,
    "baseline": "adam",
}


def study_with(change: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(STUDY))
    change(body)
    return body


def test_a_study_expands_into_queued_jobs_seen_through_jobs(client: TestClient) -> None:
    response = client.post("/studies", json=STUDY)
    assert response.status_code == 201, response.text
    study = response.json()
    assert study["status"] == "running" and study["mlflow"] is None and study["summary"] is None
    assert study["progress"]["counts"]["queued"] == 8 and study["progress"]["steps_total"] == 160
    assert [(o["optimizer"], o["jobs"]) for o in study["progress"]["optimizers"]] == [
        ("lion", 4),
        ("adam", 4),
    ]
    members = [(j["optimizer"], j["grid"], j["seed"]) for j in study["jobs"]]
    # interleaved: each round runs every optimizer, the one that goes first turning (see the next test)
    assert members[:4] == [
        ("lion", {"lr": 0.0001}, 0),
        ("adam", {"lr": 0.001}, 0),
        ("adam", {"lr": 0.003}, 0),
        ("lion", {"lr": 0.0003}, 0),
    ]
    client.post("/jobs", json={"workload": {"name": "digits_mlp"}, "optimizer": {"name": "sgd"}, "steps": 5})
    jobs = client.get("/jobs", params={"study": study["id"]}).json()
    assert jobs["total"] == 8 and client.get("/jobs").json()["total"] == 9
    adam = [j for j in jobs["items"] if j["spec"]["optimizer"]["name"] == "adam"]
    assert {j["spec"]["optimizer"]["params"]["eps"] for j in adam} == {1e-7}  # fixed params kept
    assert {j["spec"]["experiment"] for j in jobs["items"]} == {"lion-vs-adam"}
    assert client.get(f"/studies/{study['id']}").json()["jobs"] == study["jobs"]
    listed = client.get("/studies").json()
    assert listed["total"] == 1 and listed["items"][0]["id"] == study["id"]


# (change to the good study, the field the error points at, text the message contains)
BAD_STUDIES = [
    (lambda b: b.update(baseline="sgd"), ["body", "baseline"], "one of the study's optimizers (lion, adam)"),
    (
        lambda b: b["optimizers"][1]["params"].update(lr=[0.001, -1.0]),
        ["body", "optimizers", 1, "params", "lr", 1],
        "lr must be a number > 0; received -1.0",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[0.1 * (i + 1) for i in range(99)]),
        ["body", "optimizers"],
        "expands to 202 jobs",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[]),
        ["body", "optimizers", 0, "params", "lr"],
        "at least one",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(lr=[0.1, 0.1]),
        ["body", "optimizers", 0, "params", "lr"],
        "repeats a value",
    ),
    (
        # Equal as numbers, so the same job twice: a summary had pooled the two as seeds (n=2, std 0).
        lambda b: b["optimizers"][0]["params"].update(lr=[1, 1.0]),
        ["body", "optimizers", 0, "params", "lr"],
        "repeats a value: 1 and 1.0 are equal",
    ),
    (
        # Not a repeat: the catalogue never takes both (true for a number, 1 for a flag), so the
        # element it refuses is named.
        lambda b: b["optimizers"][0]["params"].update(lr=[True, 0.5, 1]),
        ["body", "optimizers", 0, "params", "lr", 0],
        "lr must be a number > 0; received true",
    ),
    (
        lambda b: b["optimizers"][1]["params"].update(betas=[[0.9, 0.999], [0.9, 0.999]]),
        ["body", "optimizers", 1, "params", "betas"],
        "repeats a value",
    ),
    (
        lambda b: b["optimizers"][0]["params"].update(gamma=[1, 2]),
        ["body", "optimizers", 0, "params", "gamma", 0],
        "no hyperparameter 'gamma'",
    ),
    (
        lambda b: b["optimizers"][0].update(name="nope"),
        ["body", "optimizers", 0, "name"],
        "unknown optimizer",
    ),
    (
        lambda b: b["optimizers"].append({"name": "adam"}),
        ["body", "optimizers", 2, "label"],
        "distinct label",
    ),
    (
        lambda b: b["optimizers"][1].update(
            param_groups=[{"match": {"ndim": "<2"}, "params": {"eps_": 0.1}}]
        ),
        ["body", "optimizers", 1, "param_groups", 0, "params", "eps_"],
        "optimizer 'adam' has no hyperparameter 'eps_'",
    ),
    (
        lambda b: b["optimizers"][1].update(base={"name": "sgd"}),
        ["body", "optimizers", 1, "base"],
        "adam",
    ),
    (
        # A misspelt field of an optimizer lists the allowed ones, as the body's own fields do.
        lambda b: b["optimizers"][0].update(groups=[]),
        ["body", "optimizers", 0, "groups"],
        "unknown field 'optimizers.0.groups'; allowed: base, needs, param_groups, name, label, style, params",
    ),
    (lambda b: b.update(seeds=[1, 1]), ["body", "seeds"], "seeds must differ"),
    (lambda b: b.update(eval_every=50), ["body", "eval_every"], "at most steps (20)"),
    (lambda b: b.update(workload={"name": "imagenet"}), ["body", "workload", "name"], "unknown workload"),
    (
        lambda b: b.update(target={"metric": "val/loss", "mode": "up", "value": 1}),
        ["body", "target", "mode"],
        "min",
    ),
    (lambda b: b.update(name="a/b"), ["body", "name"], "may contain only"),
    (
        # A metric the workload's jobs never log: every job had run, and nothing was ranked.
        lambda b: b.update(target={"metric": "val/rmse", "mode": "min", "value": 1}),
        ["body", "target", "metric"],
        "workload 'digits_mlp' logs train/loss, val/loss, val/accuracy; received 'val/rmse'",
    ),
    (
        # Accuracy to be minimized: the study would pick and rank the worst grid points.
        lambda b: b.update(target={"metric": "val/accuracy", "mode": "min", "value": 0.5}),
        ["body", "target", "mode"],
        "val/accuracy improves upward: mode must be 'max'; received 'min'",
    ),
    (
        # Accuracy is a fraction: the whole study would run and report "not reached".
        lambda b: b.update(target={"metric": "val/accuracy", "mode": "max", "value": 2.0}),
        ["body", "target", "value"],
        "val/accuracy lies from 0 to 1: a target outside is reached by no job or by every one; received 2",
    ),
]


@pytest.mark.parametrize(("change", "loc", "text"), BAD_STUDIES)
def test_bad_studies_get_422_naming_the_field_and_store_nothing(
    client: TestClient, change: Any, loc: list[Any], text: str
) -> None:
    response = client.post("/studies", json=study_with(change))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert any(item["loc"] == loc and text in item["msg"] for item in detail), detail
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_a_study_s_optimizer_takes_param_groups_and_needs_as_a_job_does(client: TestClient) -> None:
    """Each job of it gets the same recipe (a Muon hybrid, decay left off the biases): a study had
    refused the fields, so such setups could not be compared."""
    recipe = [{"match": {"ndim": "<2"}, "params": {"weight_decay": 0.0}}, {"match": "rest", "params": {}}]
    body = study_with(lambda b: b["optimizers"][1].update(param_groups=recipe, needs={"closure": False}))
    response = client.post("/studies", json=body)
    assert response.status_code == 201, response.text
    jobs = client.get("/jobs", params={"study": response.json()["id"]}).json()["items"]
    adam = [j["spec"]["optimizer"] for j in jobs if j["spec"]["optimizer"]["name"] == "adam"]
    assert len(adam) == 4
    for optimizer in adam:
        groups = optimizer["param_groups"]
        assert [(g["match"], g["params"]) for g in groups] == [
            ({"ndim": "<2", "name": None}, {"weight_decay": 0.0}),
            ("rest", {}),
        ]
        assert optimizer["needs"] == {"closure": False}
    lion = [j["spec"]["optimizer"] for j in jobs if j["spec"]["optimizer"]["name"] == "lion"]
    assert all(o["param_groups"] is None and o["needs"] is None for o in lion)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_target_value_that_is_not_finite_is_a_422(client: TestClient, value: str) -> None:
    """pydantic's own finiteness check (not our grid's, which names a key within the field): a 500 before."""
    body = study_with(lambda b: b.update(target={"metric": "val/loss", "mode": "min", "value": "VALUE"}))
    raw = json.dumps(body).replace('"VALUE"', value)
    response = client.post("/studies", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "target", "value"], problem
    assert problem["msg"].startswith("target.value: Input should be a finite number; received "), problem
    assert client.get("/studies").json()["total"] == 0


# (the grid value as JSON text, what the message says of it)
BAD_GRID_VALUES = [
    ("NaN", "must be a finite number; received NaN"),
    ("Infinity", "must be a finite number; received Infinity"),
    ("1e400", "must be a finite number; received Infinity"),  # parsed as an infinite float
    ("1e300", "must be a number of magnitude at most 1e9; received 1e+300"),
    (
        "1e-50",
        "must be 0 or of magnitude at least 1.2e-38 (float32's smallest normal number, which jobs compute "
        "in: a smaller one becomes 0); received 1e-50",
    ),
]


@pytest.mark.parametrize(("value", "text"), BAD_GRID_VALUES)
def test_a_bad_grid_value_is_located_at_its_index(client: TestClient, value: str, text: str) -> None:
    """As a value out of range is (`optimizers.1.params.lr.1`), not at the whole grid."""
    body = study_with(lambda b: b["optimizers"][1]["params"].update(lr=[0.001, "VALUE"]))
    raw = json.dumps(body).replace('"VALUE"', value)  # JSON has no NaN: written as Python's json does
    response = client.post("/studies", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "optimizers", 1, "params", "lr", 1], problem
    assert problem["msg"] == f"optimizers.1.params.lr.1 {text}", problem
    assert problem["type"] in ("finite_number", "number_too_large", "number_too_small")
    assert client.get("/studies").json()["total"] == 0


def test_a_bad_fixed_value_is_still_located_at_its_name(client: TestClient) -> None:
    body = study_with(lambda b: b["optimizers"][1]["params"].update(eps="VALUE"))
    raw = json.dumps(body).replace('"VALUE"', "NaN")
    response = client.post("/studies", content=raw, headers={"Content-Type": "application/json"})
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "optimizers", 1, "params", "eps"], problem
    assert problem["msg"] == "optimizers.1.params.eps must be a finite number; received NaN"


def test_the_job_cap_is_a_setting(settings: Settings, client: TestClient) -> None:
    client.app.state.settings = settings.model_copy(update={"max_study_jobs": 7})  # type: ignore[attr-defined]
    refused = client.post("/studies", json=STUDY)
    assert refused.status_code == 422 and "at most 7 (OPTLAB_MAX_STUDY_JOBS)" in refused.text


def test_quotas_count_the_whole_study_at_once(settings: Settings, client: TestClient) -> None:
    client.app.state.settings = settings.model_copy(update={"max_queued": 12})  # type: ignore[attr-defined]
    assert client.post("/studies", json=STUDY).status_code == 201
    refused = client.post("/studies", json=STUDY)  # 8 queued + 8 > 12: none of the 8 is stored
    assert refused.status_code == 429 and "this request adds 8" in refused.json()["detail"]
    assert client.get("/studies").json()["total"] == 1 and client.get("/jobs").json()["total"] == 8


def test_a_study_larger_than_any_queue_may_hold_is_refused_not_told_to_retry(
    settings: Settings, client: TestClient
) -> None:
    """8 jobs against a cap of 6: waiting never helps, so a 422 saying so, not a 429 with Retry-After."""
    client.app.state.settings = settings.model_copy(update={"max_queued": 6})  # type: ignore[attr-defined]
    refused = client.post("/studies", json=STUDY)
    assert refused.status_code == 422 and "Retry-After" not in refused.headers
    [problem] = refused.json()["detail"]
    assert problem["msg"].startswith(
        "this request adds 8 jobs, more than the 6 queued jobs this service holds"
    )
    assert "submit it in parts" in problem["msg"]
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_a_failure_while_writing_leaves_no_half_study(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = store.job_row

    def fails_on_the_fifth(**kwargs: Any) -> Any:
        made.append(1)
        if len(made) == 5:
            raise RuntimeError("disk full")
        return real(**kwargs)

    monkeypatch.setattr(store, "job_row", fails_on_the_fifth)
    assert client.post("/studies", json=STUDY).status_code == 500
    assert len(made) == 5
    assert client.get("/studies").json()["total"] == 0 and client.get("/jobs").json()["total"] == 0


def test_cancelling_a_study_cancels_its_queued_jobs(client: TestClient) -> None:
    study = client.post("/studies", json=STUDY).json()
    other = client.post("/studies", json={**STUDY, "name": "other"}).json()
    cancelled = client.post(f"/studies/{study['id']}/cancel", json={})
    assert cancelled.status_code == 200, cancelled.text
    body = cancelled.json()
    assert body["cancel_requested"] and body["progress"]["counts"]["cancelled"] == 8
    assert body["status"] == "summarizing"  # every job ended; a worker makes the summary
    assert {j["status"] for j in client.get(f"/studies/{other['id']}").json()["jobs"]} == {"queued"}
    report = client.get(f"/studies/{study['id']}/report")
    assert report.status_code == 409 and "no report yet" in report.json()["detail"]


def set_jobs(sessions: sessionmaker[Session], study_id: int, **values: Any) -> None:
    """What workers would have recorded for the study's jobs."""
    with sessions() as session:
        session.execute(update(Job).where(Job.study_id == study_id).values(**values))
        session.commit()


def test_a_study_whose_jobs_all_ended_cannot_be_cancelled(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Summarizing, it has no job left to stop: a cancel had ended its parent run KILLED though
    every job succeeded."""
    study = client.post("/studies", json=STUDY).json()
    set_jobs(sessions, study["id"], status=JobStatus.SUCCEEDED, step=20)
    refused = client.post(f"/studies/{study['id']}/cancel", json={})
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"] == (
        f"study {study['id']} has no job left to cancel: its 8 jobs have all ended (succeeded 8) "
        "and its summary is being made"
    )
    after = client.get(f"/studies/{study['id']}").json()
    assert after["status"] == "summarizing" and not after["cancel_requested"]


def test_a_report_that_keeps_failing_says_why_not_to_wait(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Every job ended and the summary failed (retried): "it is made once every job has ended" was
    untrue, and `optlab study --wait` showed nothing but a full bar."""
    study = client.post("/studies", json=STUDY).json()
    set_jobs(sessions, study["id"], status=JobStatus.SUCCEEDED, step=20)
    with sessions() as session:
        study_store.record_finalize_error(
            session=session,
            study_id=study["id"],
            error="ValidationError: 4 validation errors for GridPointSummary\ngrid.betas.float ...",
            retry_s=30,
        )
    report = client.get(f"/studies/{study['id']}/report")
    assert report.status_code == 409
    assert report.json()["detail"] == (
        f"study {study['id']} has no report yet: making it failed and is retried: "
        "ValidationError: 4 validation errors for GridPointSummary"
    )


def test_a_summary_that_waits_on_mlflow_says_so_while_it_waits_then_why_it_failed(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's client waits out a stopped server for many minutes: the study had read "summarizing"
    with nothing more all along."""
    import threading
    import time

    from service.studies import finalize

    study = client.post("/studies", json=STUDY).json()
    set_jobs(sessions, study["id"], status=JobStatus.SUCCEEDED, step=20)
    answered = threading.Event()

    def waits_on_mlflow(**_: Any) -> Any:
        answered.wait(20)
        raise ConnectionError("MLflow gave up")

    monkeypatch.setattr(finalize, "finalize", waits_on_mlflow)
    monkeypatch.setattr(finalize, "SLOW_SUMMARY_NOTE_S", 0.05)
    summarizing = threading.Thread(
        target=finalize.finalize_next_study,
        kwargs={"sessions": sessions, "tracking_uri": "http://mlflow.test:5000", "within_s": 30},
    )
    summarizing.start()
    try:
        deadline = time.monotonic() + 20
        while (
            not client.get(f"/studies/{study['id']}").json()["summary_waiting"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        seen = client.get(f"/studies/{study['id']}").json()
        assert seen["status"] == "summarizing" and seen["summary_error"] is None
        assert seen["summary_waiting"].startswith("the summary has been in the making for ")
        assert (
            "s: it reads the jobs' runs from MLflow at http://mlflow.test:5000, whose client waits"
            in (seen["summary_waiting"])
        )
        report = client.get(f"/studies/{study['id']}/report").json()["detail"]
        assert report.startswith(f"study {study['id']} has no report yet: the summary has been in the making")
    finally:
        answered.set()
        summarizing.join(20)
    failed = client.get(f"/studies/{study['id']}").json()
    assert failed["summary_waiting"] is None and failed["summary_error"] == "ConnectionError: MLflow gave up"
    # A note a stopped finalizer left is no longer true once another claims the study.
    with sessions() as session:
        study_store.record_summary_waiting(session=session, study_id=study["id"], note="left behind")
        session.execute(update(Study).where(Study.id == study["id"]).values(finalizing_until=None))
        session.commit()
        assert study_store.claim_study_to_finalize(session=session, lease_s=60) is not None
    assert client.get(f"/studies/{study['id']}").json()["summary_waiting"] is None


@pytest.mark.parametrize("held", [True, False])
def test_a_claim_is_renewed_while_its_summary_is_made_and_only_while_held(
    client: TestClient, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """Renewed every note, a claim outlives its two minutes for a summary of long jobs; one its worker
    gave back (stopping) is renewed no more, so the next worker may take the study at once."""
    import time

    from service.studies import finalize
    from service.studies.collect import ReadProgress

    study = client.post("/studies", json=STUDY).json()
    set_jobs(sessions, study["id"], status=JobStatus.SUCCEEDED, step=20)
    with sessions() as session:
        assert study_store.claim_study_to_finalize(session=session, lease_s=1) is not None
        before = session.scalars(select(Study.finalizing_until).where(Study.id == study["id"])).one()
    monkeypatch.setattr(finalize, "SLOW_SUMMARY_NOTE_S", 0.05)
    with finalize._said_while_slow(sessions, study["id"], "http://m:5000", ReadProgress(), held=lambda: held):
        time.sleep(0.5)
    with sessions() as session:
        after = session.scalars(select(Study.finalizing_until).where(Study.id == study["id"])).one()
    seen = client.get(f"/studies/{study['id']}").json()
    if held:
        assert after > before and seen["summary_waiting"].startswith("the summary has been in the making")
    else:
        assert after == before and seen["summary_waiting"] is None


def test_an_error_of_a_summary_given_back_never_lands_on_the_study_another_worker_finished(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    study = client.post("/studies", json=STUDY).json()
    with sessions() as session:
        study_store.record_summary(session=session, study_id=study["id"], summary={"x": 1}, report_html="<p>")
        study_store.record_finalize_error(session=session, study_id=study["id"], error="late", retry_s=30)
        done = study_store.get_study(session=session, study_id=study["id"])
    assert done is not None and done.finalize_error is None and done.finalizing_until is None


def test_a_study_cancelled_once_may_be_cancelled_again_until_it_is_done(client: TestClient) -> None:
    """A retried cancel (its answer lost) is answered as a cancelled job's is: 200, nothing changed."""
    study = client.post("/studies", json=STUDY).json()
    assert client.post(f"/studies/{study['id']}/cancel", json={}).status_code == 200
    again = client.post(f"/studies/{study['id']}/cancel", json={})
    assert again.status_code == 200, again.text
    assert again.json()["progress"]["counts"]["cancelled"] == 8


def test_a_cancelled_study_counts_the_steps_its_jobs_ran(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Not their totals: a study cancelled after 7 of its 160 steps had read 160 / 160, fraction 1."""
    study = client.post("/studies", json=STUDY).json()
    first, second, *_ = [job["job_id"] for job in study["jobs"] if job["optimizer"] == "lion"]
    with sessions() as session:
        session.execute(update(Job).where(Job.id == first).values(status=JobStatus.RUNNING, step=5))
        session.execute(update(Job).where(Job.id == second).values(status=JobStatus.SUCCEEDED, step=20))
        session.commit()
    client.post(f"/studies/{study['id']}/cancel", json={})
    with sessions() as session:  # the running job's worker stops it at step 7
        session.execute(update(Job).where(Job.id == first).values(status=JobStatus.CANCELLED, step=7))
        session.commit()
    progress = client.get(f"/studies/{study['id']}").json()["progress"]
    assert progress["ended"] == 8 and progress["counts"]["cancelled"] == 7
    assert (progress["steps_done"], progress["steps_total"], progress["fraction"]) == (27, 160, 0.1688)
    lion = progress["optimizers"][0]
    assert (lion["optimizer"], lion["steps_done"], lion["steps_total"]) == ("lion", 27, 80)
    assert progress["optimizers"][1]["steps_done"] == 0  # adam's jobs were cancelled while queued


def test_a_failed_or_diverged_job_counts_the_steps_it_ran(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    study = client.post("/studies", json=STUDY).json()
    set_jobs(sessions, study["id"], status=JobStatus.DIVERGED, step=3)
    progress = client.get(f"/studies/{study['id']}").json()["progress"]
    assert (progress["steps_done"], progress["steps_total"], progress["fraction"]) == (24, 160, 0.15)


def test_studies_page_by_before_without_repeats_while_studies_are_created(client: TestClient) -> None:
    ids = [client.post("/studies", json=STUDY).json()["id"] for _ in range(3)]
    first = client.get("/studies", params={"limit": 2}).json()
    client.post("/studies", json=STUDY)  # created between two pages: an offset would repeat one
    second = client.get("/studies", params={"limit": 2, "before": first["next_before"]}).json()
    assert [s["id"] for s in first["items"] + second["items"]] == ids[::-1]
    assert second["next_before"] is None


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/studies/99"), ("POST", "/studies/99/cancel"), ("GET", "/studies/99/report")],
)
def test_unknown_studies_are_404(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path, json={} if method == "POST" else None)
    assert response.status_code == 404 and "no study with id 99" in response.json()["detail"]


def test_the_openapi_declares_the_study_routes(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    paths = document["paths"]
    assert set(paths["/studies"]["post"]["responses"]) >= {"201", "422", "429", "503"}
    assert "text/html" in paths["/studies/{study_id}/report"]["get"]["responses"]["200"]["content"]
    assert {"404", "409"} <= set(paths["/studies/{study_id}/cancel"]["post"]["responses"])
    schemas = document["components"]["schemas"]
    assert "lion" in schemas["StudyOptimizer"]["properties"]["name"]["enum"]
    assert "study" in {p["name"] for p in paths["/jobs"]["get"]["parameters"]}


def test_the_example_study_is_accepted(client: TestClient) -> None:
    import yaml  # type: ignore[import-untyped]

    from tests.conftest import ROOT

    example = yaml.safe_load((ROOT / "examples" / "studies" / "lion-vs-adamw.yaml").read_text())
    response = client.post("/studies", json=example)
    assert response.status_code == 201, response.text
    assert response.json()["progress"]["jobs"] == 12
