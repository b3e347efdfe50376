"""Outcomes a job reports as its own status rather than as a crash. No heavy imports."""

from __future__ import annotations


class Diverged(Exception):
    """The loss became NaN or infinite.

    `step` counts the updates applied to the parameters the loss was measured on.
    """

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"{what} became {value} at step {step}")
        self.step = step


class Cancelled(BaseException):
    """SIGTERM from the worker: cancelled, or the worker is shutting down.

    A BaseException, like KeyboardInterrupt, so user code's `except Exception` cannot
    swallow it and carry on training.
    """
