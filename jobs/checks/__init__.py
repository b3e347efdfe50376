"""Conformance checks: run a user's optimizer class through the known custom-optimizer pitfalls.

`python -m jobs.checks TARGET` (or `optlab check TARGET`) prints one row per check;
`jobs.checks.runner.run_checks` is the library entry the job runner uses too.
"""
