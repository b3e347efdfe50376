"""The HTTP API: accepted specs, every kind of bad input, listing, cancelling."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.conftest import ROOT

GOOD: dict[str, Any] = {
    "framework": "torch",
    "workload": {"name": "digits_mlp"},
    "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
    "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
    "steps": 300,
    "batch_size": 64,
    "seed": 0,
    "checkpoint_every": 100,
    "eval_every": 100,
    "experiment": "demo",
}


def with_changes(**changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = spec
        for part in parents:
            target = target[part]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return spec


class _Delete:
    """A marker: remove this field from the spec (a stable repr keeps the test ids the same in every
    pytest-xdist worker)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


def test_submit_returns_the_queued_job(client: TestClient) -> None:
    response = client.post("/jobs", json=GOOD)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued"
    assert job["spec"]["optimizer"] == {
        "name": "ema_momentum",
        "params": {"lr": 0.05},
        "style": None,
        "base": None,
        "needs": None,
        "param_groups": None,
        "source": None,  # a built-in's: no plugin file can change it
    }
    assert job["progress"] == {"step": 0, "total": 300, "fraction": 0.0}
    assert job["created_at"].endswith("Z") or "+00:00" in job["created_at"]
    assert client.get(f"/jobs/{job['id']}").json()["id"] == job["id"]


# (changes to the good spec, text every message must contain, field the error points at)
BAD_SPECS = [
    ({"optimizer__name": "nope"}, ["unknown optimizer 'nope'", "ema_momentum", "adam"], "optimizer"),
    ({"schedule__name": "zigzag"}, ["unknown schedule 'zigzag'", "cosine"], "schedule"),
    ({"workload__name": "imagenet"}, ["unknown workload 'imagenet'", "digits_mlp"], "workload"),
    ({"optimizer__params": {"lr": 0.1, "gamma": 2}}, ["no hyperparameter 'gamma'", "beta"], "gamma"),
    # torch's own switch, which the class takes: said why it is no hyperparameter here.
    (
        {"optimizer__params": {"lr": 0.1, "maximize": True}},
        ["no hyperparameter 'maximize'", "one of the framework's own switches"],
        "maximize",
    ),
    ({"optimizer__params": {"lr": 0}}, ["lr must be a number > 0", "received 0"], "lr"),
    ({"optimizer__params": {"lr": -1.0}}, ["lr must be a number > 0"], "lr"),
    ({"optimizer__params": {"beta": 1.5}}, ["[0, 1)", "received 1.5"], "beta"),
    ({"optimizer__params": {"beta": 1.0}}, ["[0, 1)", "received 1.0"], "beta"),
    ({"optimizer__params": {"lr": "fast"}}, ["lr must be a number", "fast"], "lr"),
    ({"optimizer__params": {"lr": True}}, ["lr must be a number"], "lr"),
    ({"schedule__params": {"warmup_steps": -3}}, ["warmup_steps"], "warmup_steps"),
    # Settings no step of the job reaches: accepted, the job logged a schedule it was not given.
    (
        {"schedule__params": {"warmup_steps": 299}},
        ["warmup_steps must be at most 298 for the warm-up to leave a step to decay", "received 299"],
        "warmup_steps",
    ),
    (
        {"schedule": {"name": "linear_warmup"}, "steps": 50},
        ["at most 50 for the warm-up to reach the base rate within the job's 50 steps", "100 (its default)"],
        "warmup_steps",
    ),
    (
        {
            "schedule": {
                "name": "piecewise_constant",
                "params": {"boundaries": [100, 300], "values": [1, 0.1, 0.01]},
            }
        },
        ["boundaries must be below steps (300)", "received [100, 300]"],
        "boundaries",
    ),
    # Parameters that do not fit together, at the one to change: they had pointed at schedule.params.
    (
        {
            "schedule": {
                "name": "piecewise_constant",
                "params": {"boundaries": [200, 100], "values": [1, 0.1, 0.01]},
            }
        },
        ["boundaries must be strictly increasing; received [200, 100]"],
        "boundaries",
    ),
    (
        {"schedule": {"name": "piecewise_constant", "params": {"boundaries": [100], "values": [1]}}},
        ["piecewise_constant needs one more value than boundaries"],
        "values",
    ),
    (  # values left out: the 1 value received is its default, which the message had not said
        {"schedule": {"name": "piecewise_constant", "params": {"boundaries": [100, 200]}}},
        ["received 2 boundaries [100, 200] and 1 values [1.0] (values' default, where it is left out)"],
        "values",
    ),
    (  # a name glob that takes nothing: told at submission, with the model's parameters to choose from
        {"optimizer__param_groups": [{"match": {"name": "head.*"}, "params": {"lr": 0.1}}]},
        ["param_groups[0] matches no parameter of workload 'digits_mlp'", "logits.weight (ndim 2)"],
        "match",
    ),
    ({"steps": 0}, ["steps", "greater than 0"], "steps"),
    ({"steps": 10_001}, ["steps must be at most 10000", "10001"], "steps"),
    # Past the schema's 32-bit bound: the server's cap, not "less than or equal to 2147483647".
    ({"steps": 10**12}, ["steps must be at most 10000 (OPTLAB_MAX_STEPS); received 1000000000000"], "steps"),
    ({"steps": "300"}, ["steps", "integer"], "steps"),
    ({"steps": 3.5}, ["steps"], "steps"),
    ({"batch_size": 5000}, ["batch_size must be at most the training set size"], "batch_size"),
    ({"framework": "jax"}, ["framework", "torch"], "framework"),
    ({"device": "tpu"}, ["device"], "device"),
    ({"optimiser": {"name": "adam"}}, ["unknown field 'optimiser'", "optimizer"], "optimiser"),
    ({"optimizer__lr": 0.1}, ["unknown field 'optimizer.lr'", "params"], "lr"),
    ({"optimizer": DELETE}, ["optimizer", "Field required"], "optimizer"),
    ({"experiment": ""}, ["experiment"], "experiment"),
    # The holes a fuzzer found: cadences beyond the job, absurd magnitudes, names that spoof or escape.
    ({"checkpoint_every": 10**30}, ["checkpoint_every", "less than or equal"], "checkpoint_every"),
    ({"eval_every": 2**64}, ["eval_every"], "eval_every"),
    ({"checkpoint_every": 301}, ["checkpoint_every must be at most steps (300)", "301"], "checkpoint_every"),
    ({"eval_every": 1000}, ["eval_every must be at most steps (300)"], "eval_every"),
    ({"optimizer__params": {"lr": 1e308}}, ["lr must be a number of magnitude at most 1e9"], "lr"),
    ({"optimizer__params": {"lr": 1.0000001e9}}, ["at most 1e9; received 1000000100.0"], "lr"),
    ({"optimizer__params": {"lr": 10**30}}, ["magnitude at most 1e9"], "lr"),
    # Below float32's smallest normal: eps=1e-50 became 0 in the step, and a zero gradient NaN.
    (
        {"optimizer__params": {"lr": 5e-324}},
        ["lr must be 0 or of magnitude at least 1.2e-38", "received 5e-324"],
        "lr",
    ),
    ({"experiment": "demo\u202egnp.exe"}, ["experiment", "may contain only letters"], "experiment"),
    ({"experiment": "demo\x7f"}, ["may contain only"], "experiment"),
    ({"experiment": "../../etc"}, ["may contain only"], "experiment"),
    ({"experiment": "a/b"}, ["may contain only"], "experiment"),
    # A value no member of a union takes: one message saying what it may be (there were five, one a
    # member, named `list[nullable[union[bool,int,float,str]]]`); an object reaching a model: its own.
    (
        {"optimizer__params": {"lr": {"a": 1}}},
        ['optimizer.params.lr: must be a boolean, a number, a string or a list of them; received {"a": 1}'],
        "lr",
    ),
    (  # a hyperparameter named like a tag (`K`) is the request's key, not a union member's tag
        {"optimizer__params": {"lr": 0.1, "K": {"a": 1}}},
        ['optimizer.params.K: must be a boolean, a number, a string or a list of them; received {"a": 1}'],
        "K",
    ),
    (
        {"optimizer__param_groups": [{"match": "all", "params": {"lr": 0.1}}]},
        ["optimizer.param_groups.0.match: must be an object or 'rest'; received \"all\""],
        "match",
    ),
    (
        {"optimizer__param_groups": [{"match": {"ndim": "big"}, "params": {"lr": 0.1}}]},
        ["optimizer.param_groups.0.match.ndim: ndim must be a comparison with a whole number"],
        "ndim",
    ),
]


@pytest.mark.parametrize(("changes", "expected", "field"), BAD_SPECS, ids=[str(c[0]) for c in BAD_SPECS])
def test_bad_specs_get_422_naming_the_field(
    client: TestClient, changes: dict[str, Any], expected: list[str], field: str
) -> None:
    response = client.post("/jobs", json=with_changes(**changes))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    messages = " | ".join(item["msg"] for item in detail)
    for text in expected:
        assert text in messages, messages
    assert any(field in map(str, item["loc"]) for item in detail), detail
    assert client.get("/jobs").json()["total"] == 0, "a rejected request stored something"


def test_a_validators_message_that_names_its_field_is_not_prefixed_twice(client: TestClient) -> None:
    """It had read `optimizer.needs: optimizer.needs: unknown need 'foo'`."""
    response = client.post("/jobs", json=with_changes(optimizer__needs={"foo": True}))
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["msg"].startswith("optimizer.needs: unknown need 'foo'; known: closure"), problem


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"null",
        b"[]",
        b'"a string"',
        b"42",
        b'{"steps": NaN}',
        json.dumps(GOOD).replace('"lr": 0.05', '"lr": NaN').encode(),
        json.dumps(GOOD).replace('"lr": 0.05', '"lr": Infinity').encode(),
        json.dumps(GOOD).replace('"steps": 300', '"steps": 1e400').encode(),
        json.dumps(GOOD).replace('"steps": 300', '"steps": 99999999999999999999999999').encode(),
        json.dumps(GOOD).replace('"lr": 0.05', '"lr": [0.1, {"x": 1}]').encode(),
        json.dumps(GOOD).replace('"params": {"lr": 0.05}', '"params": [1, 2]').encode(),
        json.dumps(GOOD).replace('"seed": 0', '"seed": -1').encode(),
        '{"experiment": "\udcff"}'.encode("utf-8", "surrogatepass"),
        b"\xff\xfe\x00garbage",
    ],
)
def test_malformed_bodies_get_422_never_500(client: TestClient, body: bytes) -> None:
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["detail"]
    assert client.get("/jobs").json()["total"] == 0


def test_a_bad_item_of_a_list_valued_hyperparameter_is_located_at_its_index(client: TestClient) -> None:
    body = json.dumps(GOOD).replace('"lr": 0.05', '"lr": 0.05, "betas": [0.9, NaN]').encode()
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "optimizer", "params", "betas", 1]
    assert problem["msg"] == "optimizer.params.betas.1 must be a finite number; received NaN"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"experiment": "caf\xe9"}', "not valid UTF-8 (byte 0xe9 at offset 19)"),
        (b"[" * 100 + b"]" * 100, "deeper than 32 levels"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "deeper than 32 levels"),
        # Python's limit on reading integers: a 400 "There was an error parsing the body" before.
        (
            b'{"steps": 1' + b"0" * 5000 + b"}",
            "the body is not valid JSON (a number has more than 4300 digits)",
        ),
        (b'{"seed": 0, "x": [' + b"9" * 4301 + b"]}", "a number has more than 4300 digits"),
    ],
)
def test_undecodable_and_too_deep_bodies_get_a_clear_422(
    client: TestClient, body: bytes, expected: str
) -> None:
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"][0]["msg"]
    assert response.json()["detail"][0]["loc"] == ["body"]


def test_a_default_cadence_longer_than_a_short_job_means_at_its_end(client: TestClient) -> None:
    short = with_changes(
        steps=20,
        checkpoint_every=DELETE,
        eval_every=DELETE,
        schedule={"name": "cosine", "params": {"warmup_steps": 5}},  # 20 would leave no step to decay
    )
    assert client.post("/jobs", json=short).status_code == 201


def test_bodies_over_64_kib_are_refused_before_parsing(client: TestClient) -> None:
    big = with_changes(experiment="x" * 70_000)
    response = client.post("/jobs", json=big)
    assert response.status_code == 413
    assert "65536" in response.json()["detail"]

    def chunks() -> Any:  # no content-length: the limit must hold for streamed bodies too
        for _ in range(100):
            yield b" " * 1024

    response = client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert client.get("/jobs").json()["total"] == 0


def test_paging_by_before_neither_repeats_nor_skips_a_job_while_jobs_are_submitted(
    client: TestClient,
) -> None:
    """By offset, each job submitted between two pages shifts the next one: a probe paging while
    submitting saw 287 duplicates in 70 pages."""
    ids = [client.post("/jobs", json=GOOD).json()["id"] for _ in range(5)]
    seen: list[int] = []
    params: dict[str, Any] = {"limit": 2}
    while True:
        page = client.get("/jobs", params=params).json()
        seen += [job["id"] for job in page["items"]]
        client.post("/jobs", json=GOOD)  # submitted between two pages
        if page["next_before"] is None:
            break
        params = {"limit": 2, "before": page["next_before"]}
    assert seen == ids[::-1]
    assert client.get("/jobs", params={"before": 0}).status_code == 422


def test_list_filters_by_status_and_paginates(client: TestClient) -> None:
    ids = [client.post("/jobs", json=GOOD).json()["id"] for _ in range(5)]
    client.post(f"/jobs/{ids[0]}/cancel", json={})
    page = client.get("/jobs", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 5 and page["limit"] == 2 and page["offset"] == 1
    assert [job["id"] for job in page["items"]] == [ids[3], ids[2]]  # newest first
    cancelled = client.get("/jobs", params={"status": "cancelled"}).json()
    assert [job["id"] for job in cancelled["items"]] == [ids[0]]
    # Repeated, any of them: the last one alone had been used.
    either = client.get("/jobs", params=[("status", "cancelled"), ("status", "queued")]).json()
    assert either["total"] == 5 and [job["id"] for job in either["items"]] == ids[::-1]
    queued = client.get("/jobs", params=[("status", "queued"), ("status", "succeeded")]).json()
    assert queued["total"] == 4 and ids[0] not in [job["id"] for job in queued["items"]]
    assert client.get("/jobs", params={"status": "bogus"}).status_code == 422
    assert client.get("/jobs", params={"limit": 0}).status_code == 422


def test_list_filters_by_experiment_and_optimizer(client: TestClient) -> None:
    demo_ema = client.post("/jobs", json=GOOD).json()["id"]
    demo_sgd = client.post("/jobs", json=with_changes(optimizer={"name": "sgd"})).json()["id"]
    other_ema = client.post("/jobs", json=with_changes(experiment="other run")).json()["id"]

    def ids(**filters: str) -> list[int]:
        page = client.get("/jobs", params=filters).json()
        assert page["total"] == len(page["items"]), page
        return [job["id"] for job in page["items"]]

    assert ids(experiment="demo") == [demo_sgd, demo_ema]
    assert ids(experiment="other run") == [other_ema]
    assert ids(optimizer="ema_momentum") == [other_ema, demo_ema]
    assert ids(experiment="demo", optimizer="sgd") == [demo_sgd]
    assert ids(optimizer="lion") == []
    refused = client.get("/jobs", params={"experiment": "../x"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["query", "experiment"]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("/jobs?stat=failed", "unknown query parameter 'stat'; allowed: status, kind, study, experiment, "
         "optimizer, limit, offset, before"),
        ("/studies?status=done", "unknown query parameter 'status'; allowed: limit, offset, before"),
        ("/optimizers?style=keras", "unknown query parameter 'style'; allowed: framework"),
        ("/jobs/1?verbose=1", "unknown query parameter 'verbose'; this endpoint takes none"),
        ("/healthz?probe=1", "unknown query parameter 'probe'; this endpoint takes none"),
    ],
)  # fmt: skip
def test_an_unknown_query_parameter_is_refused_naming_it_and_the_allowed_ones(
    client: TestClient, url: str, said: str
) -> None:
    """`GET /jobs?stat=failed` had answered every job, as if filtered."""
    client.post("/jobs", json=GOOD)
    response = client.get(url)
    assert response.status_code == 422
    name = said.split("'")[1]
    assert response.json() == {"detail": [{"loc": ["query", name], "msg": said, "type": "extra_forbidden"}]}


def test_a_single_valued_query_parameter_given_twice_is_refused_naming_it(client: TestClient) -> None:
    """`GET /jobs?limit=1&limit=2` had listed two jobs: FastAPI reads the last value."""
    response = client.get("/jobs?limit=1&limit=2")
    assert response.status_code == 422, response.text
    assert response.json()["detail"] == [
        {
            "loc": ["query", "limit"],
            "msg": "query parameter 'limit' is given more than once; it takes one value",
            "type": "repeated_query_parameter",
        }
    ]
    assert client.get("/jobs?status=queued&status=running").status_code == 200  # a list: repeated


def test_a_key_given_twice_in_a_json_body_is_refused_naming_it(client: TestClient) -> None:
    """`{"lr": 0.1, "lr": 0.2}` had trained at 0.2 without a word; the CLI refuses the same file."""
    body = json.dumps(GOOD).replace('"lr": 0.05', '"lr": 0.1, "lr": 0.2').encode()
    assert b'"lr": 0.1, "lr": 0.2' in body
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["detail"] == [
        {
            "loc": ["body"],
            "msg": "the body gives the key 'lr' twice in one JSON object; give each key once",
            "type": "json_invalid",
        }
    ]
    assert client.get("/jobs").json()["total"] == 0  # nothing was stored


def test_unknown_query_parameters_are_each_named_and_nothing_is_done(client: TestClient) -> None:
    response = client.post("/jobs?dry_run=1&verbose=2", json=GOOD)
    assert response.status_code == 422
    assert [error["loc"] for error in response.json()["detail"]] == [
        ["query", "dry_run"],
        ["query", "verbose"],
    ]
    assert client.get("/jobs").json()["total"] == 0  # nothing was stored


def test_every_operation_refuses_an_unknown_query_parameter_and_allows_exactly_the_documented_ones(
    client: TestClient,
) -> None:
    """Each documented operation, with every query parameter it documents and one it does not: only
    that one is refused, and the ones it names as allowed are the documented ones (a request that
    keeps to the document is never refused for its parameters)."""
    document = client.get("/openapi.json").json()
    operations = [
        (method.upper(), path, [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"])
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]
    operations += [("GET", "/docs", []), ("GET", "/openapi.json", [])]  # served, not documented
    for method, path, documented in operations:
        url = re.sub(r"\{[^}]+\}", "1", path)
        query = [(name, "1") for name in documented] + [("zz_unknown", "1")]
        answer = client.request(method, url, params=query, json={})
        allowed = f"allowed: {', '.join(documented)}" if documented else "this endpoint takes none"
        assert answer.status_code == 422, (method, path, answer.text)
        assert answer.json()["detail"] == [
            {
                "loc": ["query", "zz_unknown"],
                "msg": f"unknown query parameter 'zz_unknown'; {allowed}",
                "type": "extra_forbidden",
            }
        ], (method, path)


def test_cancel(client: TestClient) -> None:
    job = client.post("/jobs", json=GOOD).json()
    cancelled = client.post(f"/jobs/{job['id']}/cancel", json={})
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert client.post(f"/jobs/{job['id']}/cancel", json={}).status_code == 200  # idempotent
    assert client.post("/jobs/999/cancel", json={}).status_code == 404
    missing = client.get("/jobs/999")
    assert missing.status_code == 404 and "999" in missing.json()["detail"]
    assert client.get("/jobs/not-a-number").status_code == 422


def test_catalogue_routes(client: TestClient) -> None:
    names = {o["name"] for o in client.get("/optimizers").json()["items"]}
    assert {"ema_momentum", "sgd", "adam", "adamw"} <= names
    ema = client.get("/optimizers/ema_momentum").json()
    assert {i["style"] for i in ema["implementations"]} == {"torch", "keras", "tf_legacy"}
    for implementation in ema["implementations"]:
        # torch's implementation also takes fused=True (torch's fused SGD kernel).
        fused = {"fused"} if implementation["style"] == "torch" else set()
        assert {p["name"] for p in implementation["params"]} == {"lr", "beta", "weight_decay", *fused}
    tensorflow = client.get("/optimizers", params={"framework": "tensorflow"}).json()["items"]
    assert {o["style"] for o in tensorflow} == {"keras", "tf_legacy"}
    assert "known:" in client.get("/optimizers/zzz").json()["detail"]
    assert {s["name"] for s in client.get("/schedules").json()["items"]} >= {
        "constant",
        "exponential",
        "cosine",
    }
    assert client.get("/workloads").json()["items"][0]["name"] == "digits_mlp"
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["optimizers"] >= 4


def test_submitting_before_any_worker_published_a_catalogue_is_503(settings: Settings) -> None:
    with TestClient(create_app(settings)) as fresh:
        response = fresh.post("/jobs", json=GOOD)
    assert response.status_code == 503
    assert "optlab worker" in response.json()["detail"]


def test_the_api_process_never_imports_a_framework(tmp_path: Any) -> None:
    script = f"""
import sys
from fastapi.testclient import TestClient
from service.app import create_app
from service.settings import Settings
import service.cli, service.worker, service.supervisor, service.remote_check
with TestClient(create_app(Settings(data_dir={str(tmp_path)!r}))) as client:
    client.post("/jobs", json={{"workload": {{"name": "x"}}, "optimizer": {{"name": "y"}}, "steps": 1}})
    client.post("/checks", json={{"optimizer": {{"name": "y"}}}})
    client.get("/healthz")
loaded = sorted(m for m in ("torch", "tensorflow", "keras", "sklearn", "mlflow") if m in sys.modules)
print(loaded)
"""
    completed = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "[]", completed.stdout


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("GET", "/jobs/3000000000"),
        ("GET", "/jobs/0"),
        ("POST", "/jobs/9223372036854775808/cancel"),
        ("GET", "/jobs?offset=99999999999999999999"),
        ("GET", "/jobs?limit=-1"),
    ],
)
def test_out_of_range_ids_and_pages_are_422_not_500(client: TestClient, method: str, url: str) -> None:
    response = client.request(method, url, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "received" in response.json()["detail"][0]["msg"]


def test_huge_numbers_in_hyperparameters_are_refused(client: TestClient) -> None:
    body = json.dumps(with_changes(schedule={"name": "exponential", "params": {"decay_steps": 1}}))
    body = body.replace('"decay_steps": 1', '"decay_steps": 1e400')
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422 and "decay_steps" in response.text


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_timeout_that_is_not_a_number_is_told_so(client: TestClient, value: str) -> None:
    """NaN had been told "should be less than or equal to 2147483647"."""
    body = json.dumps({**GOOD, "timeout_s": "VALUE"}).replace('"VALUE"', value)
    response = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "timeout_s"]
    assert problem["msg"].startswith("timeout_s: Input should be a finite number"), problem


def test_a_compressed_body_is_told_it_is_compressed(client: TestClient) -> None:
    """A gzip body was told it was "not valid UTF-8 (byte 0x8b at offset 1)"."""
    import gzip

    body = gzip.compress(json.dumps(GOOD).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    response = client.post("/jobs", content=body, headers=headers)
    assert response.status_code == 415, response.text
    assert response.json()["detail"] == (
        "Content-Encoding 'gzip' is not accepted: send the JSON body uncompressed"
    )
    assert client.get("/jobs").json()["total"] == 0


def test_a_group_glob_is_judged_only_at_the_workload_s_default_params(client: TestClient) -> None:
    """The catalogue lists the model's parameters at the workload's default params (GET /workloads);
    with others the model may have other parameters (char_lm's `layers`), so the job checks the
    recipe when it starts."""
    digits = next(w for w in client.get("/workloads").json()["items"] if w["name"] == "digits_mlp")
    assert {"name": "hidden_1.weight", "shape": [64, 64]} in digits["parameters"]
    recipe = [{"match": {"name": "hidden_3.*"}, "params": {"lr": 0.1}}]
    at_default = client.post("/jobs", json=with_changes(optimizer__param_groups=recipe))
    assert at_default.status_code == 422, at_default.text
    narrower = with_changes(optimizer__param_groups=recipe, workload__params={"hidden": 32})
    assert client.post("/jobs", json=narrower).status_code == 201


def test_a_session_the_store_dropped_after_the_answer_is_one_line_not_an_unhandled_error(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """pg_terminate_backend under load: the answer had been sent whole, then closing the request's
    session failed its rollback, logged as an unhandled error with two tracebacks."""
    from sqlalchemy.exc import OperationalError

    made = client.app.state.sessions  # type: ignore[attr-defined]

    def dropped_at_close() -> Any:
        session = made()
        real_close = session.close

        def close() -> None:
            real_close()
            raise OperationalError("ROLLBACK", {}, Exception("server closed the connection unexpectedly"))

        session.close = close
        return session

    client.app.state.sessions = dropped_at_close  # type: ignore[attr-defined]
    try:
        with caplog.at_level("WARNING"):
            answer = client.get("/jobs")
    finally:
        client.app.state.sessions = made  # type: ignore[attr-defined]
    assert answer.status_code == 200, answer.text
    said = [r for r in caplog.records if r.name.startswith("optlab")]
    assert [r.getMessage() for r in said] == [
        "could not close a store session after its request (the answer stands): "
        "(builtins.Exception) server closed the connection unexpectedly"
    ]
    assert said[0].exc_info is None
