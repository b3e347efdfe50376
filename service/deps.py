"""FastAPI dependencies as `Annotated` aliases; tests override `get_session` and friends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from jobs.spec import Catalogue
from service import store
from service.settings import Settings


async def get_settings(request: Request) -> Settings:
    # async: FastAPI runs a plain `def` dependency in the thread pool, one hop per dependency.
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


def get_catalogue(request: Request, session: SessionDep) -> Catalogue:
    return published_catalogue(request, session)


def published_catalogue(request: Request, session: Session) -> Catalogue:
    """The latest catalogue (from the app's cache), or 503 while no worker has published one."""
    catalogues: store.CatalogueCache = request.app.state.catalogues
    found = catalogues.latest(session=session)
    if found is None:
        raise HTTPException(
            status_code=503,
            detail="the optimizer catalogue has not been published yet: "
            "start a worker (`optlab worker`, or `optlab serve`) and retry in a few seconds",
        )
    return found[0]


CatalogueDep = Annotated[Catalogue, Depends(get_catalogue)]
