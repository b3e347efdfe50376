"""`python -m jobs.checks TARGET [--framework F] [--style S] [--params JSON] [--needs JSON]
[--param-groups JSON] [--base JSON] [--json FILE] [--only IDS] [--check-timeout SECONDS]`.

Exit status: 0 when no check fails, 1 when one does, 2 for a usage error, 130 for Ctrl-C, 141 when
stdout's reader closed the pipe.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from jobs.checks.context import LoopSetup
from jobs.checks.report import (
    CHECK_IDS,
    CHECK_TIME_LIMIT_S,
    CheckReport,
    CheckResult,
    add_check_timeout,
    report_ending,
)
from jobs.checks.target import (
    UsageError,
    candidate_styles,
    is_class_reference,
    needs_legacy_keras,
    parse_params,
    resolve_target,
)
from jobs.frameworks import needs_legacy_keras_process
from jobs.processes import in_legacy_keras_process, reexec_with_legacy_keras
from jobs.spec import parse_base, parse_needs, parse_param_groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="optlab check",
        description="Run the conformance checks on one optimizer class and print what each found.",
    )
    parser.add_argument(
        "target", help="a registered optimizer name, path/to/file.py:ClassName or package.module:ClassName"
    )
    parser.add_argument("--framework", choices=("torch", "tensorflow"), help="for a name registered in both")
    parser.add_argument(
        "--style",
        choices=("torch", "keras", "tf_legacy"),
        help="torch, keras or tf_legacy (where a name is registered in several)",
    )
    parser.add_argument("--params", default="{}", help="hyperparameters as JSON, e.g. '{\"lr\": 0.01}'")
    add_setup_arguments(parser)
    parser.add_argument("--json", type=Path, dest="json_path", help="also write the report here")
    parser.add_argument("--only", help=f"comma-separated check ids (default all: {', '.join(CHECK_IDS)})")
    add_check_timeout(parser)
    return parser.parse_args(argv)


# What a job spec's optimizer states beyond params, as options in the same JSON forms; shared with
# `optlab check`, which passes them through (or, with --remote, into the POST /checks body).
SETUP_OPTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "--needs",
        "needs",
        "what the loop must do that detection missed, as a job spec's optimizer.needs, e.g. "
        "'{\"closure\": true}' (keys: closure, create_graph, train_eval, base_optimizer, backward_in_step, "
        "model_argument)",
    ),
    (
        "--param-groups",
        "param_groups",
        "torch: a param-group recipe, as a job spec's optimizer.param_groups, applied to every build over "
        "the checks' variables (named p0, p1, ...; rules that match none of a check's are left out), e.g. "
        '\'[{"match": {"ndim": ">=2"}, "params": {"use_muon": true}}, {"match": "rest", "params": '
        '{"use_muon": false}}]\'',
    ),
    (
        "--base",
        "base",
        "torch wrappers: the optimizer they wrap, as a job spec's optimizer.base, e.g. "
        '\'{"name": "adamw", "params": {"lr": 0.001}}\' (a registered name; a class of your own '
        "registers from a file in OPTLAB_PLUGIN_DIRS)",
    ),
)


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    for option, dest, help_text in SETUP_OPTIONS:
        parser.add_argument(option, dest=dest, metavar="JSON", help=help_text)


def parse_setup(args: argparse.Namespace) -> LoopSetup:
    """The setup options as the checks take them; UsageError names the option and what is allowed."""
    try:
        return LoopSetup(
            needs=parse_needs(args.needs) if args.needs else {},
            param_groups=parse_param_groups(args.param_groups) if args.param_groups else (),
            base=parse_base(args.base) if args.base else None,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter hides the table
    try:
        params = parse_params(args.params)
        parse_setup(args)  # a bad option is a usage error before any framework loads
        report = check(args, params, argv if argv is not None else sys.argv[1:])
    except UsageError as exc:
        print(f"optlab check: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: where it stopped, not the frameworks' traceback
        print(f"\noptlab check: interrupted {_PROGRESS.where()}", file=sys.stderr)
        return 130
    return report_ending(report.to_json(), args.json_path)


def check(args: argparse.Namespace, params: dict[str, Any], argv: list[str]) -> CheckReport:
    from jobs.checks.runner import run_checks

    legacy_process = in_legacy_keras_process()
    if needs_legacy_keras(args.target, style=args.style) and not legacy_process:
        reexec_legacy(argv)
    try:
        target = resolve_target(args.target, framework=args.framework, style=args.style)
    except UsageError:
        legacy_left = any(map(needs_legacy_keras_process, candidate_styles(args.framework, args.style)))
        if not legacy_process and legacy_left and not is_class_reference(args.target):
            reexec_legacy(argv)  # a registered name not found yet may be a legacy one
        raise
    except Exception as exc:  # the user's module failed to import
        raise UsageError(f"importing {args.target} failed: {_import_error(exc)}") from None
    except SystemExit as exc:  # a training script's `sys.exit(main())`: it had exited 0, a false pass
        raise UsageError(_exited_on_import(args.target, exc)) from None
    if needs_legacy_keras_process(target.style) and not legacy_process:
        reexec_legacy(argv)
    only = [i.strip() for i in args.only.split(",")] if args.only else None
    print(f"Checking {target.name} ({target.style}, {target.qualname})", file=sys.stderr)
    _PROGRESS.ids = [i for i in CHECK_IDS if only is None or i in only]
    return run_checks(
        target,
        params,
        only=only,
        on_result=print_progress,
        setup=parse_setup(args),
        time_limit_s=args.check_timeout or CHECK_TIME_LIMIT_S,
    )


def reexec_legacy(argv: list[str]) -> NoReturn:
    """Legacy tf.keras needs TF_USE_LEGACY_KERAS=1 before TensorFlow is imported: start over with it."""
    reexec_with_legacy_keras("jobs.checks", argv)


def _import_error(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] or None
    where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _exited_on_import(target: str, exc: SystemExit) -> str:
    """A file (or module) that ends the process when imported, as a script's `sys.exit(main())` does:
    the checks import it to find the class, so its script code must not run on import."""
    where = target.rsplit(":", 1)[0] if ":" in target else target
    return (
        f"{where} exited when imported (SystemExit: {exc.code}), so its class cannot be checked: "
        f'put its script code under `if __name__ == "__main__":`'
    )


@dataclass
class _Progress:
    """Which check runs now, for the line an interruption prints."""

    ids: list[str] = field(default_factory=list)
    done: int = 0

    def where(self) -> str:
        if not self.ids:
            return "before the checks started (while loading the target)"
        if self.done >= len(self.ids):
            return "after the last check"
        return f"at check {self.ids[self.done]} ({self.done + 1}/{len(self.ids)})"


_PROGRESS = _Progress()


def print_progress(result: CheckResult, done: int, total: int) -> None:
    _PROGRESS.done = done
    line = f"  [{done:>2}/{total}] {result.id:<18} {result.status:<4} ({result.duration_s:.1f} s)"
    print(line, file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
