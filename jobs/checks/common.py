"""The checks that mean the same in every framework, written once over the drivers: one table.

Their contracts read in `build_checks`, `rate_checks`, `state_checks`, `cost_checks` and, for
the checks that need a fresh process, `jobs.checks.fresh`;
what only one framework has is in `torch_only` and `keras_only`.
"""

from __future__ import annotations

from collections.abc import Mapping

from jobs.checks import build_checks, cost_checks, rate_checks, state_checks
from jobs.checks.fresh import distributed, resume_exact
from jobs.checks.tools import CheckFunction

CHECKS: Mapping[str, CheckFunction] = {
    **build_checks.CHECKS,
    **rate_checks.CHECKS,
    **state_checks.CHECKS,
    **cost_checks.CHECKS,
    "resume_exact": resume_exact,
    "distributed": distributed,
}
