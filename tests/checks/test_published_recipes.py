"""Published pytorch-optimizer classes that can only be built over a param-group recipe, checked with
it (`python -m jobs.checks TARGET --param-groups ...`): the Muon family requires a `use_muon` key on
every group (orthogonalised momentum for matrices, AdamW for the rest). With the recipe no check
may fail; what cannot honour it is an inconclusive skip, never a fail. A fault a check finds is
named here with its evidence instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.checks.context import CheckContext, LoopSetup
from jobs.checks.report import CHECK_IDS
from jobs.checks.runner import run_checks
from tests.checks.tables import target_of

pytest.importorskip("pytorch_optimizer")

MUON_FAMILY = "pytorch_optimizer.optimizer.muon"
# The hybrid the family's docstrings show: Muon for >=2-d weights, AdamW for biases and gains.
HYBRID = LoopSetup(
    param_groups=[
        {"match": {"ndim": ">=2"}, "params": {"use_muon": True}},
        {"match": "rest", "params": {"use_muon": False}},
    ]
)
# What a recipe cannot be held to, and why it is no fault of the class (see jobs/checks/runner.py).
INCONCLUSIVE = {"param_groups"}
# Without a device or outside torch, as for every torch class here.
NOT_APPLICABLE = {"save_load_model", "device_placement"}
# Timing- and compile-heavy checks run on Muon itself only.
SUBSET = [c for c in CHECK_IDS if c not in ("graph_mode", "step_cost", "deprecations", *NOT_APPLICABLE)]


def test_muon_with_the_hybrid_recipe_fails_no_check(tmp_path: Path) -> None:
    report = run_checks(target_of(f"{MUON_FAMILY}.muon:Muon"), {}, setup=HYBRID, workdir=tmp_path)
    outcomes = {r.id: (r.status, r.detail) for r in report.checks}
    assert not {check: detail for check, (status, detail) in outcomes.items() if status == "fail"}
    skipped = {check for check, (status, _) in outcomes.items() if status == "skip"}
    assert skipped == INCONCLUSIVE | NOT_APPLICABLE, outcomes
    assert all(outcomes[check][1].startswith("inconclusive") for check in INCONCLUSIVE)
    # The fresh processes (resume_exact, distributed) built it over the recipe too.
    assert outcomes["resume_exact"][0] == outcomes["distributed"][0] == "pass"
    assert report.to_json()["setup"] == {"param_groups": list(HYBRID.param_groups)}


@pytest.mark.parametrize(
    "text",
    [
        f"{MUON_FAMILY}.adamuon:AdaMuon",
        f"{MUON_FAMILY}.normuon:NorMuon",
        f"{MUON_FAMILY}.muon_clip:MuonClip",
        # Floors its step size at eps (adago.py `clamp_min_(group['eps'])`), so a zero-rate step still
        # moves: `schedule` judges it on every step's rate changing the result, which holds.
        f"{MUON_FAMILY}.adago:AdaGO",
    ],
)
def test_the_rest_of_the_family_fails_no_check(text: str, tmp_path: Path) -> None:
    report = run_checks(target_of(text), {}, only=SUBSET, setup=HYBRID, workdir=tmp_path)
    assert not {r.id: r.detail for r in report.checks if r.status == "fail"}
    assert {r.id for r in report.checks if r.status == "skip"} == INCONCLUSIVE


def test_without_the_recipe_muon_cannot_be_built(tmp_path: Path) -> None:
    """The evidence that the recipe is what the checks above ran with: over a flat parameter list
    Muon cannot be built (torch refuses the plain tensors where it expects group dicts): `construct`
    says what it needs, and every other check is skipped."""
    report = run_checks(
        target_of(f"{MUON_FAMILY}.muon:Muon"), {}, only=["construct", "dense_step"], workdir=tmp_path
    )
    construct, dense_step = report.checks
    assert construct.status == "skip" and "param-group recipe" in construct.detail, construct.detail
    assert dense_step.status == "skip"


def test_the_checks_build_applies_the_recipe_to_their_flat_variables(tmp_path: Path) -> None:
    import numpy as np

    context = CheckContext(
        target=target_of(f"{MUON_FAMILY}.muon:Muon"), params={}, workdir=tmp_path, setup=HYBRID
    )
    variables = context.driver.variables([np.ones(shape, np.float32) for shape in ((4, 3), (3,), (5,))])
    groups = context.build(variables).param_groups
    assert [(g["use_muon"], [tuple(p.shape) for p in g["params"]]) for g in groups] == [
        (True, [(4, 3)]),
        (False, [(3,), (5,)]),
    ]
    # A check with only 1-d variables: the >=2-d rule matches none of them and is left out.
    (only,) = context.build(variables[1:]).param_groups
    assert only["use_muon"] is False
    # Name globs see the variables' positions.
    named = LoopSetup(
        param_groups=[
            {"match": {"name": "p0"}, "params": {"use_muon": True}},
            {"match": "rest", "params": {"use_muon": False}},
        ]
    )
    by_name = CheckContext(target=context.target, params={}, workdir=tmp_path, setup=named).build(variables)
    assert [len(g["params"]) for g in by_name.param_groups] == [1, 2]
