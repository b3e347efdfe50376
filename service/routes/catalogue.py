"""Read-only views of the catalogue a worker published; no framework is imported here."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, HTTPException

from service import store
from service.deps import CatalogueDep, SessionDep
from service.schemas import COMMON, CatalogueItems, CheckSummary, OptimizerDetail, OptimizerList, responses

router = APIRouter(tags=["catalogue"])


@router.get("/optimizers", responses=responses(*COMMON, 503))
def list_optimizers(
    catalogue: CatalogueDep, framework: Literal["torch", "tensorflow"] | None = None
) -> OptimizerList:
    """Every implementation (one per name and style), with hyperparameters and their ranges."""
    items = [o for o in catalogue.optimizers if framework is None or o["framework"] == framework]
    return OptimizerList(items=items, errors=catalogue.errors)


@router.get("/optimizers/{name}", responses=responses(*COMMON, 404, 503))
def get_optimizer(name: str, catalogue: CatalogueDep, session: SessionDep) -> OptimizerDetail:
    """One optimizer name and its implementations in each style it exists in, each with the
    summary of its latest finished conformance check (`latest_check`, null when never checked)."""
    implementations = [o for o in catalogue.optimizers if o["name"] == name]
    if not implementations:
        known = ", ".join(catalogue.optimizer_names())
        raise HTTPException(status_code=404, detail=f"unknown optimizer {name!r}; known: {known}")
    latest = store.latest_checks(session=session, name=name, styles=[o["style"] for o in implementations])
    summaries = {style: job and CheckSummary.from_row(job).to_json() for style, job in latest.items()}
    items = [{**o, "latest_check": summaries[o["style"]]} for o in implementations]
    return OptimizerDetail(name=name, implementations=items)


@router.get("/schedules", responses=responses(*COMMON, 503))
def list_schedules(catalogue: CatalogueDep) -> CatalogueItems:
    return CatalogueItems(items=catalogue.schedules)


@router.get("/workloads", responses=responses(*COMMON, 503))
def list_workloads(catalogue: CatalogueDep) -> CatalogueItems:
    return CatalogueItems(items=catalogue.workloads)
