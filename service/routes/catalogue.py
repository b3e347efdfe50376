"""Read-only views of the catalogue a worker published; no framework is imported here."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException

from service.deps import CatalogueDep

router = APIRouter(tags=["catalogue"])


@router.get("/optimizers")
def list_optimizers(catalogue: CatalogueDep, framework: Literal["torch"] | None = None) -> dict[str, Any]:
    items = [o for o in catalogue.optimizers if framework is None or o["framework"] == framework]
    return {"items": items, "errors": catalogue.errors}


@router.get("/optimizers/{name}")
def get_optimizer(name: str, catalogue: CatalogueDep) -> dict[str, Any]:
    found = catalogue.optimizer(name)
    if found is None:
        known = ", ".join(sorted(o["name"] for o in catalogue.optimizers))
        raise HTTPException(status_code=404, detail=f"unknown optimizer {name!r}; known: {known}")
    return found


@router.get("/schedules")
def list_schedules(catalogue: CatalogueDep) -> dict[str, Any]:
    return {"items": catalogue.schedules}


@router.get("/workloads")
def list_workloads(catalogue: CatalogueDep) -> dict[str, Any]:
    return {"items": catalogue.workloads}
