"""The OpenAPI document says what the server enforces, including what only the catalogue knows.

The catalogue is published by workers at run time (plugins come and go), so the document is the
static one FastAPI builds from the routes, with the catalogue's names put in as enums each time it
is served: a client (or a fuzzer) that keeps to the schema no longer meets "unknown optimizer".
Each name also brings its parameters: their names, types and allowed ranges (`anyOf`, one branch
per name), so the schema refuses what the server refuses. What JSON Schema cannot say stays a 422
at the field: rules between fields (a cadence at most `steps`, `batch_size` at most the workload's
training set, the optimizer's implementation for the job's framework when the frameworks' parameter
names differ, a schedule that cannot be built over `steps`).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from sqlalchemy.exc import SQLAlchemyError

from jobs.spec import MAX_LIST_LENGTH, MAX_PARAM_MAGNITUDE, MAX_STRING_LENGTH, OPTION_TEXT_PATTERN, Catalogue
from service.auth import authorize
from service.query_params import KnownQueryOnly

log = logging.getLogger("optlab.api")


def drop_security(document: dict[str, Any]) -> None:
    """An open API (no OPTLAB_API_TOKENS) asks for no token: the bearer scheme it declared made a
    client, or a fuzzer, expect a 401 without one."""
    document.get("components", {}).pop("securitySchemes", None)
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if isinstance(operation, dict):
                operation.pop("security", None)


def install(app: FastAPI) -> None:
    """Serve the document with the latest catalogue's names (the static one when none is published)."""
    static: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not static:
            static.update(
                get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            )
            bound_hyperparameters(static)
            if not app.state.settings.tokens:
                drop_security(static)
        try:
            with app.state.sessions() as session:
                found = app.state.catalogues.latest(session=session)
        except SQLAlchemyError:  # the document must not fail with the database: serve it without names
            log.warning("OpenAPI served without the catalogue's names: the job store did not answer")
            found = None
        return with_catalogue(static, found.catalogue) if found else static

    app.openapi = openapi  # type: ignore[method-assign]

    # The document names every registered optimizer: it needs a token like the catalogue does.
    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorize), KnownQueryOnly])
    def openapi_document() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False, response_class=HTMLResponse, dependencies=[KnownQueryOnly])
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(needs_token=bool(app.state.settings.tokens)), headers=DOCS_HEADERS)


# One exact version, each file with its subresource integrity hash, so the CDN can serve nothing
# else to a page the token is typed into: `npm pack swagger-ui-dist@VERSION`, then
# `openssl dgst -sha384 -binary package/FILE | base64` for each file.
SWAGGER_UI_VERSION = "5.35.0"
SWAGGER_UI = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
SWAGGER_UI_CSS_SRI = "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I"
SWAGGER_UI_JS_SRI = "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9"
# No other site may frame the page (a framed page can be made to take a pasted token), and the
# page's address is not sent on. Scripts and styles are not restricted further: Swagger UI's needs
# could not be checked in a browser here (no CDN to load it from).
DOCS_HEADERS = {
    "Content-Security-Policy": (
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'; object-src 'none'"
    ),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


# What the page shows until Swagger UI replaces it: all it shows where the browser cannot reach the
# CDN (a host without internet), which would otherwise be a blank page.
DOCS_FALLBACK = (
    '<p id="docs-fallback" style="font-family:sans-serif;margin:2em">Loading Swagger UI from '
    "cdn.jsdelivr.net&hellip; If this text stays, this browser cannot reach it. The API's document is "
    '<a href="/openapi.json">/openapi.json</a>; where the API has tokens, fetch it with yours: '
    "<code>curl -H &quot;Authorization: Bearer $OPTLAB_TOKEN&quot; http://HOST:8000/openapi.json</code>."
    "</p>"
)


def docs_page(*, needs_token: bool) -> str:
    """Swagger UI that sends the user's token with every request, the document's fetch included
    (a browser cannot add a bearer header to a page it opens). The page holds no data itself; the
    token stays in this tab's sessionStorage."""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>optlab API</title>
<link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css" integrity="{SWAGGER_UI_CSS_SRI}"
 crossorigin="anonymous"></head>
<body><div id="swagger-ui">{DOCS_FALLBACK}</div>
<script src="{SWAGGER_UI}/swagger-ui-bundle.js" integrity="{SWAGGER_UI_JS_SRI}" crossorigin="anonymous">
</script>
<script>
const needsToken = {json.dumps(needs_token)};
let token = sessionStorage.getItem("optlab-token");
// Without Swagger UI (no CDN) the text above stays, and no token is asked for nothing.
if (typeof SwaggerUIBundle === "function" && needsToken && !token) {{
  token = window.prompt("This API needs a token (one of OPTLAB_API_TOKENS). Paste yours:");
  if (token) sessionStorage.setItem("optlab-token", token);
}}
if (typeof SwaggerUIBundle === "function") SwaggerUIBundle({{
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  requestInterceptor: (request) => {{
    if (token) request.headers["Authorization"] = "Bearer " + token;
    return request;
  }},
  // A token the API does not know is forgotten: reloading the page asks for it again.
  responseInterceptor: (response) => {{
    if (response.status === 401) sessionStorage.removeItem("optlab-token");
    return response;
  }},
}});
</script></body></html>
"""


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
    schemas["OptimizerChoice"]["anyOf"] = _params_by_name(catalogue.optimizers)
    for field, component, items in (
        ("workload", "WorkloadChoice", catalogue.workloads),
        ("schedule", "ScheduleChoice", catalogue.schedules),
    ):
        schemas[component] = copy.deepcopy(schemas["Component"])
        schemas[component]["title"] = component
        _name_enum(schemas[component], [item["name"] for item in items])
        schemas[component]["anyOf"] = _params_by_name(items)
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


def _params_by_name(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One `anyOf` branch per catalogue name: its parameters' names, types and ranges, nothing else.

    A name with several implementations (torch, Keras, legacy tf.keras) accepts what any of them
    declares; which one applies depends on the job's framework, a rule between fields.
    """
    declared: dict[str, list[list[dict[str, Any]]]] = {}
    for item in items:
        declared.setdefault(item["name"], []).append(item["params"])
    return [
        {"properties": {"name": {"const": name}, "params": _params_schema(implementations)}}
        for name, implementations in sorted(declared.items())
    ]


def _params_schema(implementations: list[list[dict[str, Any]]]) -> dict[str, Any]:
    values: dict[str, list[dict[str, Any]]] = {}
    for params in implementations:
        for param in params:
            value = _nullable(param, _value_schema(param))
            if value not in values.setdefault(param["name"], []):
                values[param["name"]].append(value)
    required = [
        name
        for name in values
        if all(any(p["name"] == name and p["required"] for p in params) for params in implementations)
    ]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            name: alike[0] if len(alike) == 1 else {"anyOf": alike} for name, alike in values.items()
        },
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _nullable(param: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter that takes null (`clip: float | None = 1.0`), or whose default is null (`beta3:
    float | None = None`: the class decides; the default itself is always valid), as the server does."""
    if param.get("nullable") or (param["default"] is None and not param.get("required")):
        return {"anyOf": [schema, {"type": "null"}]}
    return schema


def _value_schema(param: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for one declared parameter (optimizers.hyperparams.Param, as published)."""
    kind = param["type"]
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "choice":
        return {"type": "string", "enum": list(param["choices"])}
    option_text = {"type": "string", "maxLength": MAX_STRING_LENGTH, "pattern": OPTION_TEXT_PATTERN}
    if kind == "str":
        return option_text
    if kind == "path":  # a file under OPTLAB_DATA_ROOTS: only the server can tell which are
        text = {"type": "string", "maxLength": 1000, "pattern": "^[^\\u0000]*$"}
        return {**text, "minLength": 1} if param.get("required") else text  # "" is "none"
    number: dict[str, Any] = {"type": "integer" if kind in ("int", "int_list") else "number"}
    low, high = param.get("low"), param.get("high")
    if low is None or low < -MAX_PARAM_MAGNITUDE:
        number["minimum"] = -MAX_PARAM_MAGNITUDE
    else:
        number["minimum" if param.get("low_inclusive", True) else "exclusiveMinimum"] = low
    if high is None or high > MAX_PARAM_MAGNITUDE:
        number["maximum"] = MAX_PARAM_MAGNITUDE
    else:
        number["maximum" if param.get("high_inclusive", True) else "exclusiveMaximum"] = high
    if kind == "float_pair":
        return {"type": "array", "items": number, "minItems": 2, "maxItems": 2}
    if kind == "any":
        scalar = [{"type": "boolean"}, number, option_text]
        listed = {"type": "array", "items": {"anyOf": scalar}, "maxItems": MAX_LIST_LENGTH}
        return {"anyOf": [*scalar, listed]}
    if kind == "float_tuple":
        return {"type": "array", "items": number, "minItems": 1, "maxItems": MAX_LIST_LENGTH}
    if kind in ("int_list", "float_list"):
        return {"type": "array", "items": number, "maxItems": MAX_LIST_LENGTH}
    return number
