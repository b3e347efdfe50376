"""Bearer tokens: who may read, who may submit and cancel. Applied to every router but /healthz.

Tokens are compared as SHA-256 digests with `hmac.compare_digest`, against every configured
token (no early exit), so neither the comparison nor the loop tells an attacker how close a
guess came. No token, and no part of one, is ever logged or put in a response.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.secrets import SECRET_QUERY
from service.settings import ApiToken, Settings

# Methods that change nothing; everything else needs a token that may write.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

bearer = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <token>`, one of OPTLAB_API_TOKENS (`NAME:TOKEN:read` tokens "
    "may only read). Without OPTLAB_API_TOKENS the API is open and listens on localhost only.",
)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def match_token(tokens: list[ApiToken], presented: str) -> ApiToken | None:
    """The configured token equal to `presented`, compared in constant time over all of them."""
    wanted = _digest(presented)
    found: ApiToken | None = None
    for token in tokens:
        if hmac.compare_digest(_digest(token.secret), wanted):
            found = token
    return found


def _unauthorized(message: str, error: str | None = None) -> HTTPException:
    challenge = 'Bearer realm="optlab"' + (f', error="{error}"' if error else "")
    return HTTPException(status_code=401, detail=message, headers={"WWW-Authenticate": challenge})


async def authorize(  # async: no I/O here, so no hop through the thread pool
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> ApiToken | None:
    """The caller's token (None when the API is open); 401 without a valid one, 403 when a
    read-only token tries to submit or cancel."""
    settings: Settings = request.app.state.settings
    if not settings.tokens:
        return None
    if len(request.headers.getlist("authorization")) > 1:  # which one counts must not be a guess
        raise _unauthorized("the request has more than one Authorization header; send one")
    if credentials is None:
        in_query = [name for name in request.query_params if SECRET_QUERY.search(name)]
        raise _unauthorized(
            "this API needs a token: send `Authorization: Bearer <token>` "
            "(the optlab CLI sends $OPTLAB_TOKEN)"
            + (
                f"; a token in the query string ({', '.join(in_query)}) is not read: URLs end up in "
                "logs and histories"
                if in_query
                else ""
            )
        )
    token = match_token(settings.tokens, credentials.credentials)
    if token is None:
        raise _unauthorized("the bearer token is not one this API knows", error="invalid_token")
    if request.method not in READ_METHODS and not token.can_write:
        raise HTTPException(
            status_code=403,
            detail=f"token {token.name!r} is read-only (configured as NAME:TOKEN:read); "
            "submitting and cancelling need a token without ':read'",
        )
    return token


CallerDep = Annotated[ApiToken | None, Depends(authorize)]


def submitter(caller: ApiToken | None) -> str | None:
    """What a job records as `submitted_by`: the token's name (None on an open API)."""
    return caller.name if caller is not None else None
