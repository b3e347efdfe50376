"""The checks that need fresh processes, written once for every style: `resume_exact`, `distributed`.

`spawner.py` is the checking process's side (one child per context, requests, timeouts),
`child.py` the child's (one framework import, a fresh fork per run), `results.py` the
framework-neutral results and comparisons; `torch_child.py` and `keras_child.py` hold each
framework's runs, reached through its driver (`plan.runs_for`). No module here imports a
framework at import time.
"""

from jobs.checks.fresh.distributed import distributed
from jobs.checks.fresh.resume import resume_exact

__all__ = ["distributed", "resume_exact"]
