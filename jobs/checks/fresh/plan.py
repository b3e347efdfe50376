"""What the two fresh-process checks run and what each framework provides for them.

Nothing here imports a framework: `runs_for(style)` finds the style's code through its
driver (`Driver.fresh_module`), so the checks in `resume.py` and `distributed.py` are
written once and never ask which framework they are in.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from jobs.frameworks import driver_class

if TYPE_CHECKING:
    from jobs.checks.context import CheckContext
    from jobs.checks.fresh.results import Run
    from jobs.frameworks.base import StateDifference

SEED = 20240607
RESUME_STEPS = 6  # N steps straight ...
RESUME_SPLIT = 3  # ... against k steps, save, a fresh process runs the other N - k
DISTRIBUTED_STEPS = 3
REPLICAS = 2
GLOBAL_BATCH = 8  # each replica (DDP rank, MirroredStrategy replica) takes an equal share of the rows
# Replicas average their share's gradients, which rounds differently from one full-batch
# mean (a few float32 ulps). Over a few steps that moves parameters by about 1e-6 of their
# movement; a real distribution fault (a gradient summed twice, a norm over replicas,
# replicas drifting apart) changes the movement itself by a large fraction. So parameters
# must agree within 1e-3 of their movement, and optimizer state within 1e-3 of its own size.
RELATIVE_TOLERANCE = 1e-3
ABSOLUTE_FLOOR = 1e-7

# The runs a distributed request writes, one results file each: the model before the first
# step, one device on the full batch, and every replica on its share.
INITIAL, SINGLE = "initial", "single"
REPLICA_RUNS = tuple(f"replica{index}" for index in range(REPLICAS))


@dataclass(frozen=True)
class Wording:
    """A framework's words in the checks' sentences, so the sentences are written once."""

    checkpoint: str  # how the resume saves: "save", "tf.train.Checkpoint"
    state_home: str  # where state belongs, so the checkpoint has it
    saver: str  # what saves that state
    resume_child_fix: str  # the fix when the resumed run raises ('' for the generic one)
    setup: str  # the distributed setup: "DDP with 2 gloo ranks"
    replica: str  # one member of it: "rank", "replica"
    single: str  # what it is compared with: "one process", "one device"
    reference: str  # and fed what: "one process fed the ranks' averaged gradient"
    distributed_child_fix: str  # the fix when a distributed run raises ('' for the generic one)
    apart_fix: str  # replicas hold different values
    layout_fix: str  # the optimizer state is not what the single run has
    beyond_fix: str  # the replicas' result differs from the single run's beyond rounding
    evaluation: str = ""  # the switch to evaluation weights a resume saves after ('' where none)
    # The fix by the kind of error a distributed run raised, before `distributed_child_fix`: (a regular
    # expression searched in the error's line, its fix), the first that matches.
    distributed_child_fixes: tuple[tuple[str, str], ...] = ()


class FreshRuns(Protocol):
    """A framework's side of the fresh-process checks (`jobs/checks/fresh/<framework>_child.py`).

    `settings` and `run_and_save` run in the checking process; `import_framework` once in the
    fresh child; `prepare_run`, `resume` and `distributed` in a process forked from it, before
    any optimizer code has run there.
    """

    WORDING: Wording

    def settings(self) -> dict[str, Any]:
        """This process's settings that decide how sums are ordered; the fresh runs copy them."""

    def run_and_save(self, ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path) -> Run:
        """RESUME_STEPS steps straight (returned), then RESUME_SPLIT steps saved to `checkpoint`."""

    def load_difference(
        self, ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path
    ) -> StateDifference | None:
        """What loading `checkpoint` into freshly built objects changes in its saved state, where
        that names why a resume differs (torch casts state to its floating-point parameter's
        dtype); None otherwise. Runs in the checking process, after the resumed run differed."""

    def import_framework(self, style: str) -> None:
        """Import what every run needs, creating no framework runtime (it must survive a fork)."""

    def prepare_run(self, request: Mapping[str, Any]) -> None:
        """Threads, devices and determinism, before anything starts the framework's runtime."""

    def resume(self, request: Mapping[str, Any], ctx: CheckContext) -> None:
        """Load the checkpoint, run the remaining steps, write the results to `request["out"]`."""

    def distributed(self, request: Mapping[str, Any], ctx: CheckContext) -> None:
        """Write the INITIAL, SINGLE and REPLICA_RUNS results to `request["outs"]`."""


def runs_for(style: str) -> FreshRuns:
    """The style's fresh-process code, named by its driver; imports that framework."""
    return cast(FreshRuns, importlib.import_module(driver_class(style).fresh_module))
