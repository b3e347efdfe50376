"""The OpenAPI document says what the server enforces, including what only the catalogue knows.

The catalogue is published by workers at run time (plugins come and go), so the document is the
static one FastAPI builds from the routes, with the catalogue's names put in as enums each time it
is served: a client (or a fuzzer) that keeps to the schema no longer meets "unknown optimizer".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy.exc import SQLAlchemyError

from jobs.spec import MAX_PARAM_MAGNITUDE, Catalogue
from service import store

log = logging.getLogger("optlab.api")


def install(app: FastAPI) -> None:
    """Serve the document with the latest catalogue's names (the static one when none is published)."""
    static: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not static:
            static.update(
                get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            )
            bound_hyperparameters(static)
        try:
            with app.state.sessions() as session:
                found = store.latest_catalogue(session=session)
        except SQLAlchemyError:  # the document must not fail with the database: serve it without names
            log.warning("OpenAPI served without the catalogue's names: the job store did not answer")
            found = None
        return with_catalogue(static, found[0]) if found else static

    app.openapi = openapi  # type: ignore[method-assign]


def bound_hyperparameters(document: dict[str, Any]) -> None:
    """Every number in a `params` object is within +-MAX_PARAM_MAGNITUDE (jobs.spec refuses more)."""

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("title") == "Params":
                _walk_numbers(node, _bounded)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(document)


def _bounded(schema: dict[str, Any]) -> None:
    schema["minimum"], schema["maximum"] = -MAX_PARAM_MAGNITUDE, MAX_PARAM_MAGNITUDE


def _walk_numbers(node: Any, apply: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(node, dict):
        if node.get("type") in ("number", "integer"):
            apply(node)
        for value in node.values():
            _walk_numbers(value, apply)
    elif isinstance(node, list):
        for value in node:
            _walk_numbers(value, apply)


def with_catalogue(static: dict[str, Any], catalogue: Catalogue) -> dict[str, Any]:
    """A copy of `static` whose optimizer, workload and schedule names are the catalogue's."""
    document = copy.deepcopy(static)
    schemas = document["components"]["schemas"]
    _name_enum(schemas["OptimizerChoice"], catalogue.optimizer_names())
    for field, component, names in (
        ("workload", "WorkloadChoice", [w["name"] for w in catalogue.workloads]),
        ("schedule", "ScheduleChoice", [s["name"] for s in catalogue.schedules]),
    ):
        schemas[component] = copy.deepcopy(schemas["Component"])
        schemas[component]["title"] = component
        _name_enum(schemas[component], names)
        for body in ("JobSpec", "StudySpec"):
            prop = schemas[body]["properties"][field]
            prop.pop("$ref", None)
            prop["allOf"] = [{"$ref": f"#/components/schemas/{component}"}]
    _name_enum(schemas["StudyOptimizer"], catalogue.optimizer_names())
    for parameter in document["paths"]["/optimizers/{name}"]["get"]["parameters"]:
        if parameter["name"] == "name":
            parameter["schema"] = {"type": "string", "enum": catalogue.optimizer_names()}
    return document


def _name_enum(schema: dict[str, Any], names: list[str]) -> None:
    name = schema["properties"]["name"]
    for key in ("pattern", "minLength", "maxLength"):
        name.pop(key, None)
    name["enum"] = sorted(names)
