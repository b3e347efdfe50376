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
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


async def refuse_unknown_query_parameters(request: Request) -> None:
    """422 naming each query parameter the route does not declare, and the ones it does."""
    # async: FastAPI would run a plain `def` dependency in the thread pool, one hop per request.
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return  # not a FastAPI route: nothing declares its parameters
    allowed = declared_query_parameters(route)
    unknown = [name for name in request.query_params if name not in allowed]
    if unknown:
        raise RequestValidationError([_unknown(name, allowed) for name in unknown])


def declared_query_parameters(route: APIRoute) -> tuple[str, ...]:
    """The query parameters `route` reads, by the name a client sends (an alias where one is set).
    Walked each request: a few dependencies deep, microseconds (a route is not hashable to cache by)."""
    return tuple(dict.fromkeys(_query_names(route.dependant)))


def _query_names(dependant: Dependant) -> Iterator[str]:
    """The query parameters of `dependant` and of every dependency under it."""
    yield from (field.alias for field in dependant.query_params)
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


KnownQueryOnly = Depends(refuse_unknown_query_parameters)
