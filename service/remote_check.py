"""`optlab check --remote URL NAME`: queue a check job on the service and show its report here."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jobs.checks.report import print_report_table
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
from service.client import ApiClient, ApiError, error_of, result_of, status_of
from service.progress import follow_jobs


def check_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /checks body from `optlab check`'s arguments; ValueError says what is wrong."""
    if ":" in args.target:
        raise ValueError(
            f"--remote checks a registered optimizer by name; received the class reference {args.target}: "
            "register it (OPTLAB_PLUGIN_DIRS on the workers) or check it here without --remote"
        )
    params = parse_params(args.params)  # ValueError says what is allowed
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
    if args.only:
        body["checks"] = [check.strip() for check in args.only.split(",") if check.strip()]
    return body


def run_remote_check(args: argparse.Namespace) -> int:
    try:
        body = check_body(args)
    except ValueError as exc:
        print(f"optlab check: {exc}", file=sys.stderr)
        return 2
    client = ApiClient(args.remote)
    try:
        job = client.submit_check(body)
        print(f"check job {job['id']} {job['status']}: {client.base_url}/jobs/{job['id']}", file=sys.stderr)
        final = follow_jobs(client, {job["id"]: f"check {args.target}"})[job["id"]]
    except ApiError as exc:
        print(f"optlab check: {exc}", file=sys.stderr)
        return 2 if exc.is_usage_error else 1
    finally:
        client.close()
    status, result = status_of(final), result_of(final)
    if status is not JobStatus.SUCCEEDED:
        error = error_of(final)
        print(f"check job {final['id']} {status}: {error.message if error else ''}", file=sys.stderr)
        return 1
    if result is None or result.report is None:
        raise ValueError(f"check job {final['id']} succeeded without a report in its result: {result}")
    report: dict[str, Any] = result.report
    print_report_table(report)
    if final.get("mlflow"):
        print(f"MLflow run: {final['mlflow']['run_url']}")
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["summary"]["fail"] == 0 else 1
