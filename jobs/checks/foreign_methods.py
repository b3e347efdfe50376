"""`dense_step`'s side of methods of another optimizer API (jobs/frameworks/foreign.py): the
class's steps are the evidence that they were never called, counted while they run."""

from __future__ import annotations

from collections.abc import Sequence

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome, failed
from jobs.frameworks.foreign import Foreign, never_called, told


def suspects(ctx: CheckContext) -> list[Foreign]:
    return never_called(ctx.target.cls, ctx.driver.foreign_methods)


def never_ran(ctx: CheckContext, uncalled: Sequence[Foreign], outcome: Outcome) -> Outcome:
    """`dense_step`'s outcome, told by the methods of another API its steps never called: a fail at
    the first that held the class's own work; a note on a fail where only setup was left out."""
    cls, api = ctx.target.cls, ctx.driver.api_name
    own_work = [f for f in uncalled if f.method.own_work]
    if own_work:
        first = own_work[0]
        return failed(told(cls, first, api, also=own_work[1:]), where=first.where, fix=first.method.fix)
    if outcome.status != "fail" or not uncalled:
        return outcome
    observed, _, fix = outcome.detail.partition(". Fix: ")
    note = told(cls, uncalled[0], api)
    detail = f"{observed}; {note}. Fix: {fix or uncalled[0].method.fix}"
    return Outcome("fail", detail, outcome.figure, outcome.where)
