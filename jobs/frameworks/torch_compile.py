"""`torch.compile` for a torch job's model (`JobSpec.compile`), and what compiling cost it.

Compiling is lazy: Dynamo traces the forward at its first call and AOTAutograd compiles the
backward at its first backward, inside the job's first steps. `CompileClock` adds up the wall
time of those compiles from Dynamo's own start/end callbacks, so the cost is reported as such
rather than hidden in the first step's time. A module built again with the same shapes (the
checkpoint's reloaded objects) reuses the compiled graphs: Dynamo guards on the module's
structure, not its identity, so a checkpoint round trip costs no new compile.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn


class CompileClock:
    """Wall seconds spent compiling in this process, and how many compiles, since it was installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.compiles = 0
        self._started: float | None = None
        self._lock = threading.Lock()

    def since(self, mark: tuple[float, int]) -> dict[str, Any]:
        """What compiling cost since `mark` (`self.mark()`), as the result's fields."""
        return {"compile_seconds": self.seconds - mark[0], "compiles": self.compiles - mark[1]}

    def mark(self) -> tuple[float, int]:
        return self.seconds, self.compiles

    def install(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, _: Any) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _end(self, _: Any) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self.compiles += 1
                self._started = None


_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
    """The process's one clock (Dynamo's callbacks are process-wide), installed on first use."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CompileClock()
        _CLOCK.install()
    return _CLOCK


def compiled(module: nn.Module) -> nn.Module:
    """`module` compiled by inductor. The result wraps `module` (its state_dict keys carry
    `_orig_mod.`), so a caller keeps the plain module for checkpoints and forwards through this."""
    compile_clock()
    return torch.compile(module)  # type: ignore[return-value]  # an OptimizedModule, an nn.Module
