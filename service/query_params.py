"""A query parameter a route does not declare is refused with a 422, not ignored.

`GET /jobs?stat=failed` (a typo of `status`) had answered with every job, as if filtered. One
dependency, read off each route's own declared query parameters (its dependencies' included), so a
route added later is covered without a list to keep. It runs after `authorize` where a route has
it: a token sent in the query string is told so by `authorize` (401), not taken for a typo.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import Depends, Request
from fastapi._compat import field_annotation_is_sequence
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


async def refuse_unknown_query_parameters(request: Request) -> None:
    """422 naming each query parameter the route does not declare, and the ones it does."""
    # async: FastAPI would run a plain `def` dependency in the thread pool, one hop per request.
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return  # not a FastAPI route: nothing declares its parameters
    declared = declared_query_parameters(route)
    allowed = tuple(declared)
    unknown = [name for name in request.query_params if name not in declared]
    # FastAPI reads the last of a repeated single-valued parameter: `?limit=1&limit=2` had listed 2.
    repeated = [
        name
        for name in request.query_params
        if declared.get(name) is False and len(request.query_params.getlist(name)) > 1
    ]
    if unknown or repeated:
        raise RequestValidationError(
            [_unknown(name, allowed) for name in unknown] + [_repeated(name) for name in repeated]
        )


def declared_query_parameters(route: APIRoute) -> dict[str, bool]:
    """The query parameters `route` reads, by the name a client sends (an alias where one is set),
    each with whether it takes a list (may be repeated). Walked each request: a few dependencies
    deep, microseconds (a route is not hashable to cache by)."""
    return dict(_query_names(route.dependant))


def _query_names(dependant: Dependant) -> Iterator[tuple[str, bool]]:
    """The query parameters of `dependant` and of every dependency under it, each with whether it
    takes a list, as FastAPI itself decides it."""
    for field in dependant.query_params:
        yield field.alias, field_annotation_is_sequence(field.field_info.annotation)
    for dependency in dependant.dependencies:
        yield from _query_names(dependency)


def _unknown(name: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """One error in pydantic's shape, which the app's 422 handler words (service.app)."""
    return {
        "loc": ("query", name),
        "type": "extra_forbidden",
        "msg": f"unknown query parameter {name!r}; "
        + (f"allowed: {', '.join(allowed)}" if allowed else "this endpoint takes none"),
    }


def _repeated(name: str) -> dict[str, Any]:
    return {
        "loc": ("query", name),
        "type": "repeated_query_parameter",
        "msg": f"query parameter {name!r} is given more than once; it takes one value",
    }


KnownQueryOnly = Depends(refuse_unknown_query_parameters)
