"""Run every check on one target, in the stable order of `CHECK_IDS`, and collect the report.

Each style has one table, `{check id: function(CheckContext) -> Outcome}`, written once
and applied to any class of that style (the idea of torch's `optim_db`).
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from jobs.checks.context import CheckContext, LoopSetup, RecipeNotHonoured, one_line
from jobs.checks.report import CHECK_IDS, ONLY_FOR_STYLES, CheckReport, CheckResult, Outcome, failed, skipped
from jobs.checks.target import Target, UsageError
from jobs.checks.tools import (
    CheckFunction,
    fix_for_raised,
    method_location,
    reached_user_code,
    wrong_signature,
)
from jobs.errors import EXIT_FIX, exit_message
from jobs.frameworks.base import AdvisedError, known_fix
from optimizers.hyperparams import check_all
from optimizers.loop_needs import LoopNeeds, unserved

# The checks only one framework has, per style: imported on demand, so only one framework
# is ever loaded.
FRAMEWORK_CHECKS: dict[str, str] = {
    "torch": "jobs.checks.torch_only",
    "keras": "jobs.checks.keras_only",
    "tf_legacy": "jobs.checks.keras_only",
}


# optlab's own code (jobs/, optimizers/, ...): an error raised there, with no line of the class on
# the way, is optlab's to fix.
OPTLAB_ROOT = Path(__file__).resolve().parents[2]
OPTLAB_PACKAGES = ("jobs", "optimizers", "service", "tests", "benchmarks")

# The skip of every check after a construct that could not build the optimizer at all.
UNBUILDABLE = "not run: the optimizer cannot be constructed"
STEP_RAISES = "not run: a step on the checks' variables raises"
ONLY_SPARSE = "not run: the class takes only sparse gradients, which only `sparse` gives it"
# The checks that step with sparse gradients only: what can judge a class that refuses dense ones.
SPARSE_CHECKS = frozenset({"sparse"})


def checks_for_style(style: str) -> Mapping[str, CheckFunction]:
    """The style's check table: the checks written once for every style, plus its framework's own."""
    from jobs.checks.common import CHECKS as COMMON

    framework: Mapping[str, CheckFunction] = importlib.import_module(FRAMEWORK_CHECKS[style]).CHECKS
    return {**framework, **COMMON}


def validated_params(target: Target, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` checked against the class's hyperparameters; UsageError names the bad one."""
    base_argument = target.entry.needs.base_optimizer
    if base_argument in params:  # an optimizer object (LossScaleOptimizer's inner_optimizer): no JSON value
        wrapped = (
            f"--params: {base_argument!r} takes the optimizer {target.name!r} wraps, not a hyperparameter"
        )
        refused = unserved(target.name, target.entry.needs, target.framework)
        raise UsageError(f"{wrapped}: {refused}" if refused else f"{wrapped}; name it with --base")
    try:
        return check_all(params, target.entry.params, owner=f"optimizer {target.name!r} ({target.style})")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--params: {exc}") from None


def validated_setup(target: Target, setup: LoopSetup) -> None:
    """Stated needs, a recipe and a base that apply to `target`; UsageError names the option."""
    try:
        stated = LoopNeeds().with_overrides(setup.needs, owner="--needs")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    refused = unserved(target.name, stated, target.framework)
    if refused:  # as a check spec with these needs is refused at submission
        raise UsageError(f"--needs: {refused}")
    if setup.param_groups:
        if target.style != "torch":
            raise UsageError(
                f"--param-groups: param groups are served for torch optimizers; {target.name!r} is "
                f"{target.style}: leave --param-groups out"
            )
        try:
            rules = setup.rules()
        except ValueError as exc:
            raise UsageError(f"--param-groups: {exc}") from None
        for index, (_, params) in enumerate(rules):
            # Each group's params as a job's recipe has them judged at submission: a misspelt
            # hyperparameter is the option's error here too, not a check left unrun.
            owner = f"--param-groups[{index}]"
            try:
                target.entry.group_kwargs(params, owner=owner)
            except ValueError as exc:
                said = str(exc)
                raise UsageError(said if said.startswith(owner) else f"{owner}: {said}") from None


def run_checks(
    target: Target,
    params: Mapping[str, Any],
    *,
    only: Iterable[str] | None = None,
    workdir: Path | None = None,
    on_result: Callable[[CheckResult, int, int], None] | None = None,
    setup: LoopSetup | None = None,
    time_limit_s: float | None = None,
) -> CheckReport:
    """All checks (or `only` those) on `target`; `on_result(result, done, total)` after each.

    `setup`: what a job's spec would state beyond params (needs, a param-group recipe, the base a
    wrapper wraps), applied to every build and step the checks take. `time_limit_s`: how long one
    check may run (the main thread only; None: no limit); the checks after one that ran past it are
    not run, so a hanging class costs one limit, not one per check."""
    checked = validated_params(target, params)
    setup = setup or LoopSetup()
    validated_setup(target, setup)
    ids = [i for i in CHECK_IDS if only is None or i in set(only)]
    unknown = sorted(set(only or ()) - set(CHECK_IDS))
    if unknown:
        raise UsageError(f"unknown check {unknown[0]!r}; known: {', '.join(CHECK_IDS)}")
    table = checks_for_style(target.style)
    report = CheckReport(
        optimizer=target.name,
        framework=target.framework,
        style=target.style,
        target=target.text,
        cls=target.qualname,
        params=dict(params),
        setup={key: value for key, value in setup.to_json().items() if value},
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="optlab-check-", dir=workdir) as scratch:
        context = CheckContext(target=target, params=checked, workdir=Path(scratch), setup=setup)
        context.base  # noqa: B018 - resolved now: a bad --base is a usage error, not a failed check
        hung: CheckResult | None = None
        for number, check_id in enumerate(ids, start=1):
            if hung is None:
                result, ran_past_limit = _run_one(check_id, table, context, time_limit_s)
                hung = result if ran_past_limit else None
            else:
                result = CheckResult(id=check_id, status="skip", detail=_after_hang(hung, time_limit_s))
            report.checks.append(result)
            if on_result is not None:
                on_result(result, number, len(ids))
    report.duration_s = round(time.perf_counter() - started, 2)
    return report


def _run_one(
    check_id: str, table: Mapping[str, CheckFunction], context: CheckContext, time_limit_s: float | None
) -> tuple[CheckResult, bool]:
    """The check's result, and whether it ran past `time_limit_s` (and was stopped)."""
    started = time.perf_counter()
    ran_past_limit = False
    try:
        with _time_limit(time_limit_s):
            outcome = _outcome(check_id, table, context)
    except RanPastLimit as stopped:
        ran_past_limit = True
        outcome = _past_limit(context, stopped, time_limit_s or 0.0)
    return CheckResult(
        id=check_id,
        status=outcome.status,
        detail=outcome.detail,
        figure=outcome.figure,
        where=outcome.where,
        duration_s=round(time.perf_counter() - started, 3),
    ), ran_past_limit


def _outcome(check_id: str, table: Mapping[str, CheckFunction], context: CheckContext) -> Outcome:
    style = context.target.style
    if style not in ONLY_FOR_STYLES.get(check_id, (style,)):
        return skipped(f"applies to {' and '.join(ONLY_FOR_STYLES[check_id])} optimizers only")
    if check_id not in table:
        return skipped(f"not available for {style} optimizers")
    if context.unbuildable:
        return skipped(f"{UNBUILDABLE} (see construct)")
    if context.takes_only_sparse and check_id not in SPARSE_CHECKS:
        return skipped(f"{ONLY_SPARSE} (see dense_step)")
    if context.step_raises and not context.takes_only_sparse:
        return skipped(f"{STEP_RAISES} (see dense_step)")
    try:
        return table[check_id](context)
    except RecipeNotHonoured as exc:
        return skipped(f"inconclusive: {exc}")
    except Exception as exc:  # the user's code raised somewhere the check did not expect
        if not _raised_through_user_code(context, exc):
            return skipped(_internal_error(exc))
        wrong = wrong_signature(context, exc)  # the class's method never ran: no line of it to show
        if wrong is not None:
            return wrong.failed(context.describe_error(exc))
        skipped_init = context.driver.base_init_skipped(exc)
        if skipped_init is not None:  # one cause behind every check's AttributeError: said at __init__
            said, fix = skipped_init
            return failed(
                f"raised {context.describe_error(exc)}: {said}",
                where=method_location(context, "__init__"),
                fix=fix,
            )
        where = context.where(exc)
        return failed(
            f"raised {context.describe_error(exc)}",
            where=where,
            fix=exc.fix if isinstance(exc, AdvisedError) else fix_for_raised(exc),
        )
    except SystemExit as exc:  # sys.exit() in the user's code would end these checks without a word
        return failed(exit_message(exc), where=context.where(exc), fix=EXIT_FIX)


class RanPastLimit(BaseException):
    """Raised in a check that runs past its time limit: a BaseException, so that neither a class's
    `except Exception` nor a check's own handling takes it for the class's error."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """RanPastLimit in this thread once `seconds` have passed, and every second after (a class that
    swallows it with a bare `except:` is stopped again); SIGALRM, so a sleep or a blocking wait in
    Python is interrupted too (compiled code is not: the handler runs once it returns). A caller's
    deadline that comes first (pytest-timeout's) is left alone; a later one is given back, its time
    spent here counted."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer and outer <= seconds:
        yield
        return
    armed = True

    def expired(signum: int, frame: Any) -> None:
        if armed:
            raise RanPastLimit

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    started = time.monotonic()
    try:
        yield
    finally:
        while True:  # the alarm may come while it is disarmed: disarm again, never leave it running
            try:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
                break
            except RanPastLimit:
                continue
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))


def _past_limit(context: CheckContext, stopped: RanPastLimit, limit_s: float) -> Outcome:
    """A fail where the class's code was running when the limit came (its step hangs, or as good as);
    a skip where only optlab's or a framework's was (a machine too busy to judge the class)."""
    # Its own frames only: an error optlab was handling when the limit came may hold the class's.
    files = context.user_files()
    if any(frame.filename in files for frame in traceback.extract_tb(stopped.__traceback__)):
        return failed(
            f"did not end within {limit_s:g} s: the class's code was still running when it was stopped",
            where=context.where(stopped),
            fix="a step must return: look for a wait that nothing ends (a lock, a queue, an event) or a "
            "loop whose exit condition never comes true",
        )
    return skipped(
        f"not judged: did not end within {limit_s:g} s, stopped in optlab's or a framework's code (or "
        "waiting for a check's own process), not the class's; on a busy machine give the checks more "
        "time (--check-timeout)"
    )


def _after_hang(hung: CheckResult, limit_s: float | None) -> str:
    return (
        f"not run: check {hung.id} did not end within {limit_s or 0:g} s, so the rest were not started "
        "(each could take as long); once it ends, run them with --only"
    )


def _raised_through_user_code(context: CheckContext, error: Exception) -> bool:
    """Whether `error` is the class's to answer for: a line of its code was on the way (torch or Keras
    raising inside the user's step is still the user's); its message names a known fault of a class (a
    legacy Keras update that returns None fails in Keras's code, after the class's has returned); a
    driver said it about the class (AdvisedError); or a framework's code raised it on the class's
    objects. Only an error raised in optlab's own code, with no line of the class on the way, is not
    (Lookahead's missing `defaults`, read by a check). A class without a source file cannot be told
    apart, and is judged as before."""
    if context.target.source_file() is None or known_fix(error) is not None:
        return True
    if isinstance(error, AdvisedError):  # a driver's own words about the class (what it cannot save)
        return True
    # Raised in a framework's code that optlab called with the class's objects (torch.save pickling a
    # lambda the class keeps in its state): the class's, as before. Only a line of optlab's own raising
    # it, with none of the class's on the way, is optlab's.
    return reached_user_code(context, error) or not _raised_in_optlab(error)


def _in_optlab(filename: str) -> bool:
    """Whether `filename` is optlab's own code (its packages and tests, not its virtual environment)."""
    path = Path(filename)
    return path.is_relative_to(OPTLAB_ROOT) and path.relative_to(OPTLAB_ROOT).parts[0] in OPTLAB_PACKAGES


def _raised_in_optlab(error: Exception) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and _in_optlab(frames[-1].filename)


def _internal_error(error: Exception) -> str:
    """The skip of a check that failed in optlab's own code: what, where, and whom to tell."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if _in_optlab(frame.filename)]
    where = _frame_text(frames[-1]) if frames else "an unknown line"
    if ours and frames and ours[-1] is not frames[-1]:
        where += f", called from {_frame_text(ours[-1])}"
    return (
        f"inconclusive: optlab's check failed: {one_line(error)} (at {where}), with no line of the class "
        "on the way, so this is not the class's fault and it was not judged here; please report it to "
        "optlab's maintainers with this line"
    )


def _frame_text(frame: traceback.FrameSummary) -> str:
    """`path:line in function`, optlab's own paths relative to its root."""
    path = Path(frame.filename)
    shown = path.relative_to(OPTLAB_ROOT) if path.is_relative_to(OPTLAB_ROOT) else path
    return f"{shown}:{frame.lineno} in {frame.name}"
