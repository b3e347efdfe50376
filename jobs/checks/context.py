"""What every check function gets: the target, the hyperparameters, a scratch folder."""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.checks.target import Target
from jobs.frameworks import driver_for
from jobs.frameworks.base import Driver
from optimizers.loop_needs import LoopNeeds

STATEFUL_MOMENTUM = 0.9


@dataclass
class CheckContext:
    target: Target
    # The user's hyperparameters in catalogue form (`lr`, not `learning_rate`), checked
    # against the class's declared ranges; defaults fill the rest when building.
    params: dict[str, Any]
    workdir: Path
    # Checks may leave notes for later ones (e.g. the variables that `dense_step` saw).
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def driver(self) -> Driver:
        """The style's driver: how the checks drive its framework (imported on first use)."""
        if "driver" not in self.notes:
            self.notes["driver"] = driver_for(self.target.style)
        driver: Driver = self.notes["driver"]
        return driver

    def build(
        self,
        model_params: Iterable[Any] | None = None,
        *,
        learning_rate: Any = None,
        **overrides: Any,
    ) -> Any:
        """A new optimizer with the user's params (and `overrides`, catalogue names)."""
        return self.target.entry.create(
            {**self.params, **overrides}, model_params=model_params, learning_rate=learning_rate
        )

    @property
    def needs(self) -> LoopNeeds:
        """How the class must be stepped (closure, create_graph): every step a check takes passes it."""
        return self.target.entry.needs

    @property
    def has_lr(self) -> bool:
        """Whether the class takes a learning rate at all (A2Grad and AliG compute their step)."""
        return "lr" in self.target.entry.params

    @property
    def lr(self) -> float:
        """The learning rate the optimizer is built with (the user's, else the class default)."""
        declared = self.target.entry.params.get("lr")
        given = self.params.get("lr", None if declared is None else declared.default)
        return 1e-3 if given is None else float(given)  # None: the class derives its rate (SaRA)

    def mark_unbuildable(self) -> None:
        """`construct` could not build the optimizer at all: the other checks cannot run.

        A construct fail for an invalid value it accepted does not count: the rest still runs.
        """
        self.notes["unbuildable"] = True

    @property
    def unbuildable(self) -> bool:
        return bool(self.notes.get("unbuildable"))

    def mark_step_raises(self) -> None:
        """`dense_step`'s first step on the standard variables raised: every later check would
        report the same error again, so they are not run (one cause, one flag)."""
        self.notes["step_raises"] = True

    @property
    def step_raises(self) -> bool:
        return bool(self.notes.get("step_raises"))

    def where(self, error: BaseException | None = None) -> str:
        """`file.py:line` in the user's class: the deepest frame of `error` inside its file, else
        the class statement."""
        source = self.target.source_file()
        if error is not None and source is not None:
            frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
            if frames:
                return f"{frames[-1].filename}:{frames[-1].lineno}"
        return self.target.class_location()

    def describe_error(self, error: BaseException) -> str:
        return one_line(error)

    def stateful_overrides(self) -> dict[str, Any]:
        """Settings that give a stateless configuration (SGD's default momentum=0) some state.

        Checks of state across a save or a process would be vacuous without it: momentum 0.9
        is used instead, only when the class declares a numeric `momentum` that allows it, and
        the pass detail says so (`overrides_note`).
        """
        declared = self.target.entry.params.get("momentum")
        if declared is None or declared.type not in ("float", "number"):
            return {}
        if self.params.get("momentum", declared.default) != 0:
            return {}
        try:
            return {"momentum": declared.check(STATEFUL_MOMENTUM)}
        except ValueError:
            return {}


def overrides_note(overrides: Mapping[str, Any]) -> str:
    """What a pass detail adds when `stateful_overrides` changed the build."""
    if not overrides:
        return ""
    settings = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return f" (built with {settings}: the given settings keep no state to check)"


def one_line(error: BaseException) -> str:
    """`TypeError: message` cut to one readable line."""
    message = " ".join(str(error).split())
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(error).__name__}: {message}"


def with_defaults(target: Target, params: Mapping[str, Any]) -> dict[str, Any]:
    """The full hyperparameter set a build with `params` uses: declared defaults, then `params`."""
    return {**{name: p.default for name, p in target.entry.params.items()}, **params}
