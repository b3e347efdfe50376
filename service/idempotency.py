"""`Idempotency-Key` on submissions (POST /jobs, /checks, /studies): a client that retries after a
timeout or a dropped connection gets the job or study its first request made, not a second one.

The key is the client's (a UUID, say), scoped by the token that sends it ('' on an open API). The
first request with it stores the key beside what it created, in the same transaction; a later one
with the same key and the same request gets that back (201, `Idempotent-Replayed: true`), whatever
the queue or the catalogue says by then; one with the same key and another request is refused
(422), as the IETF draft on the header asks. Submissions store under one lock
(`service.db.submission_lock`), so two racing requests with one key make one job.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Header, HTTPException, Request, Response
from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.models import IdempotencyKey, Job, Study

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255  # the column's width; a UUID is 36
# Printable ASCII, no space at either end: what every client library sends unchanged.
KEY_PATTERN = r"^[!-~]([ -~]*[!-~])?$"

KeyHeader = Annotated[
    str | None,
    Header(
        alias=KEY_HEADER,
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        pattern=KEY_PATTERN,
        description=(
            "a key of the client's choosing (a UUID) that makes retrying this request safe: the same key "
            "and request again answer with what the first made (201, with `Idempotent-Replayed: true`), "
            "not a second one; the same key with "
            "another request is refused (422). Printable ASCII, at most 255 characters; scoped to "
            "the token that sends it, and kept for good"
        ),
    ),
]


@dataclass(frozen=True)
class IdempotentRequest:
    """One submission's key, who sent it, and what it asks (the route and its validated body)."""

    scope: str
    key: str
    request_sha256: str

    @classmethod
    def of(
        cls, request: Request, key: str | None, *, route: str, body: BaseModel, submitted_by: str | None
    ) -> IdempotentRequest | None:
        """The request's key (None without one); a 422 for two keys, which a client or a proxy
        could send in either order: neither can be taken to be the one meant."""
        sent = request.headers.getlist(KEY_HEADER)
        if len(sent) > 1:
            raise HTTPException(
                status_code=422,
                detail=[
                    {
                        "loc": ["header", KEY_HEADER],
                        "msg": f"{len(sent)} {KEY_HEADER} headers were sent; send one",
                        "type": "idempotency_key_repeated",
                    }
                ],
            )
        if key is None:
            return None
        # The validated body, so a retry that orders its fields otherwise, or spells out a default
        # of the spec's own fields (not of a hyperparameter: the catalogue's), is the same request.
        canonical = json.dumps([route, body.model_dump(mode="json")], sort_keys=True, separators=(",", ":"))
        return cls(submitted_by or "", key, hashlib.sha256(canonical.encode()).hexdigest())

    def earlier(self, session: Session) -> IdempotencyKey | None:
        """The key as an earlier request stored it, or None; a 422 if that request was another one."""
        row = session.get(IdempotencyKey, (self.scope, self.key), populate_existing=True)
        if row is not None and row.request_sha256 != self.request_sha256:
            made = f"job {row.job_id}" if row.job_id is not None else f"study {row.study_id}"
            raise HTTPException(
                status_code=422,
                detail=[
                    {
                        "loc": ["header", KEY_HEADER],
                        "msg": f"{KEY_HEADER} {self.key!r} was sent before with another request, which made "
                        f"{made}: send a new key with each new request, and the same key only to retry "
                        "the very same one",
                        "type": "idempotency_key_reused",
                    }
                ],
            )
        return row

    def earlier_job(self, session: Session) -> Job | None:
        row = self.earlier(session)
        return (
            None
            if row is None or row.job_id is None
            else session.get(Job, row.job_id, populate_existing=True)
        )

    def earlier_study(self, session: Session) -> Study | None:
        row = self.earlier(session)
        if row is None or row.study_id is None:
            return None
        return session.get(Study, row.study_id, populate_existing=True)

    def remember(self, session: Session, *, job: Job | None = None, study: Study | None = None) -> None:
        """Store the key with what this request made, in the caller's transaction; flushed, so the
        next request of a batch with this key finds it."""
        session.flush()  # the job's or study's id
        session.add(
            IdempotencyKey(
                scope=self.scope,
                key=self.key,
                request_sha256=self.request_sha256,
                job_id=None if job is None else job.id,
                study_id=None if study is None else study.id,
            )
        )
        session.flush()


# The OpenAPI `responses` entry of a submission's 201: it may say that it replays an earlier one.
REPLAYED_ANSWER: dict[int | str, dict[str, Any]] = {
    201: {
        "description": "stored; or what an earlier request with the same Idempotency-Key and body made",
        "headers": {
            REPLAYED_HEADER: {
                "description": "`true` where this answer is what an earlier request with the same "
                "Idempotency-Key made (nothing new was stored); absent otherwise",
                "schema": {"type": "string", "enum": ["true"]},
            }
        },
    }
}


def mark_replayed(response: Response, replayed: bool) -> None:
    if replayed:
        response.headers[REPLAYED_HEADER] = "true"
