"""`optlab check --remote URL NAME`: queue a check job on the service and show its report here."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from jobs.checks.report import CHECK_TIME_LIMIT_S, report_ending
from jobs.result import JobStatus
from jobs.spec import (
    default_style,
    framework_of_style,
    parse_base,
    parse_needs,
    parse_param_groups,
    parse_params,
    style_choice,
)
from service.client import ApiClient, ApiError, connect, error_of, result_of, status_of
from service.progress import follow_jobs


def check_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /checks body from `optlab check`'s arguments; ValueError says what is wrong."""
    if ":" in args.target:
        raise ValueError(
            f"--remote checks a registered optimizer by name; received the class reference {args.target}: "
            "register it (OPTLAB_PLUGIN_DIRS on the workers) or check it here without --remote"
        )
    if getattr(args, "check_timeout", None) is not None:
        raise ValueError(
            f"--check-timeout is for checks run here; a check job gives each check "
            f"{CHECK_TIME_LIMIT_S:g} s, and its spec's timeout_s bounds the whole: leave it out with --remote"
        )
    params = parse_params(args.params)  # ValueError says what is allowed
    _refuse_non_finite(params, "--params")  # as a local check does (NaN had failed in the encoder)
    framework = args.framework or (framework_of_style(args.style) if args.style else "torch")
    body: dict[str, Any] = {"framework": framework, "optimizer": {"name": args.target, "params": params}}
    # A spec names its style only where there is a choice (torch's only style goes without saying).
    if args.style and (style_choice(framework) or args.style != default_style(framework)):
        body["optimizer"]["style"] = args.style
    # Stated needs, a recipe and a base go where a check spec has them; the API validates them too.
    for key, parse, text in (
        ("needs", parse_needs, args.needs),
        ("param_groups", parse_param_groups, args.param_groups),
        ("base", parse_base, args.base),
    ):
        if text is not None:
            body["optimizer"][key] = parse(text)  # ValueError names the option
            _refuse_non_finite(body["optimizer"][key], "--" + key.replace("_", "-"))
    if args.only:
        body["checks"] = [check.strip() for check in args.only.split(",") if check.strip()]
    return body


def _refuse_non_finite(value: Any, option: str, where: str = "") -> None:
    """ValueError for a NaN or an infinity in an option's JSON (json.loads reads them; a request
    cannot carry them), naming where: `--params: betas.1 must be a finite number; received NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        received = "NaN" if math.isnan(value) else ("-" if value < 0 else "") + "Infinity"
        raise ValueError(f"{option}: {where or 'a value'} must be a finite number; received {received}")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _refuse_non_finite(item, option, f"{where}.{key}" if where else str(key))


# The hint on a refused check is worth a short wait, not the client's usual one.
HINT_TIMEOUT_S = 10.0


def other_framework_hint(client: ApiClient, body: dict[str, Any]) -> str | None:
    """For a refused check of a name the service holds only in another framework than the one asked for
    (torch unless --framework or --style said otherwise): where it is, and the option that checks it
    there. A local `optlab check NAME` looks in every style; the remote one had answered a name
    registered for TensorFlow only with a 422 and no word of --framework. None where the name is not
    registered, or is in the framework asked for (the refusal is about something else)."""
    name, framework = body["optimizer"]["name"], body["framework"]
    try:
        implementations = client.optimizer(name, timeout_s=HINT_TIMEOUT_S).get("implementations") or []
    except ApiError:  # not registered at all (the refusal said so), or no answer: nothing to add
        return None
    styles: dict[str, list[str]] = {}
    for implementation in implementations:
        styles.setdefault(str(implementation.get("framework")), []).append(str(implementation.get("style")))
    if not styles or framework in styles:
        return None
    ways = [
        # the framework's default style goes without saying; another must be named
        f"--framework {other}" if default_style(other) in found else f"--style {found[0]}"
        for other, found in sorted(styles.items())
        if other in ("torch", "tensorflow")
    ]
    where = "; ".join(f"{other} (style {', '.join(found)})" for other, found in sorted(styles.items()))
    if not ways:
        return None
    return f"{name!r} is registered for {where}, not for {framework}: check it there with {' or '.join(ways)}"


def run_remote_check(args: argparse.Namespace) -> int:
    try:
        body = check_body(args)
    except ValueError as exc:
        print(f"optlab check: {exc}", file=sys.stderr)
        return 2
    client = connect(args.remote, "optlab check")
    if client is None:  # an address that is not one
        return 2
    job: dict[str, Any] | None = None
    try:
        job = client.submit_check(body)
        print(f"check job {job['id']} {job['status']}: {client.base_url}/jobs/{job['id']}", file=sys.stderr)
        final = follow_jobs(client, {job["id"]: f"check {args.target}"})[job["id"]]
    except ApiError as exc:
        hint = other_framework_hint(client, body) if job is None and exc.status_code == 422 else None
        print(f"optlab check: {exc}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
        return 2 if exc.is_usage_error else 1
    except KeyboardInterrupt:  # as submit and study say it: the job goes on, and how to cancel it
        from service.cli import stopped_waiting

        what = None if job is None else (f"check job {job['id']}", f"{client.base_url}/jobs/{job['id']}")
        print(stopped_waiting("optlab check", what, f"{client.base_url}/jobs"), file=sys.stderr)
        return 130
    finally:
        client.close()
    status, result = status_of(final), result_of(final)
    if status is not JobStatus.SUCCEEDED:
        error = error_of(final)
        print(f"check job {final['id']} {status}: {error.message if error else ''}", file=sys.stderr)
        return 1
    if result is None or result.report is None:
        raise ValueError(f"check job {final['id']} succeeded without a report in its result: {result}")
    run = f"MLflow run: {final['mlflow']['run_url']}" if final.get("mlflow") else ""
    return report_ending(result.report, args.json_path, after_table=run)
