"""A warm job process: `python -m jobs.warm STYLE`, started by the worker before its job is known.

It imports what a job of optimizer style STYLE needs (the framework, its driver, the training loop,
the checks, MLflow, data loading: seconds of a cold job's start-up), then waits for one order on
stdin (`jobs.processes.WarmOrder`: the arguments of `python -m jobs.run` and the job's log file)
and runs it in this process exactly as `python -m jobs.run ARGS` would: same code path
(`jobs.run.main`), same files, same MLflow run, same exit status. Then it exits: one job per
process, so no state carries from one job to the next.

The worker starts it with the job's environment (the slot's CUDA_VISIBLE_DEVICES, the thread
count, TF_USE_LEGACY_KERAS for `tf_legacy`), in its own session, and hands it a job only when
that environment is still the one the job would get (service/warm_pool.py). End of file instead
of an order means the worker is gone or no longer needs it: it exits at once, having run nothing.
"""

from __future__ import annotations

import importlib
import os
import stat
import sys
from collections.abc import Iterable

from jobs.processes import WarmOrder, exit_without_teardown

# Imported by every job (jobs.run's heavy imports happen only once a spec is read).
COMMON_IMPORTS = (
    "numpy",
    "mlflow",
    "mlflow.entities",
    "mlflow.tracking",
    "jobs.run",
    "jobs.tracking",
    "jobs.resume",
    "jobs.training.loop",
    "jobs.check_job",
    "jobs.workloads",
)
# Per style: its framework and driver (never the other framework: test_framework_isolation).
STYLE_IMPORTS = {
    "torch": ("torch", "torch._inductor.config", "jobs.frameworks.torch_driver"),
    "keras": ("tensorflow", "keras", "jobs.frameworks.keras_driver"),
    "tf_legacy": ("tensorflow", "tf_keras", "jobs.frameworks.keras_driver"),
}


def warm_up(style: str) -> None:
    """Import what a job of `style` will import, the style's built-in optimizers included.

    Best effort: a module that fails here is imported again by the job, which then fails exactly
    as a cold job would, with its error in result.json and its log.
    """
    from optimizers.optional_imports import KERAS_MODULE_OF_STYLE, keras_imports_hidden
    from optimizers.registry import BUILTIN_MODULES

    # The framework as a job process imports it: Keras without the libraries it imports just in
    # case (optimizers/optional_imports.py).
    with keras_imports_hidden(KERAS_MODULE_OF_STYLE.get(style)):
        _import_each(STYLE_IMPORTS.get(style, ()))
    _import_each((*COMMON_IMPORTS, *BUILTIN_MODULES.get(style, ())))


def _import_each(names: Iterable[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            continue


def take_over_output(log: str) -> None:
    """Send this process's output to the job's log (appended to, as the worker opens a cold job's
    log), what warming up printed first (TensorFlow's start-up notes, as in a cold job's log);
    stdin from /dev/null, as a cold job has it."""
    sys.stdout.flush()
    sys.stderr.flush()
    early = b""
    if stat.S_ISREG(os.fstat(1).st_mode):  # the worker's unnamed file: read it back by its fd
        with open(f"/proc/self/fd/{sys.stdout.fileno()}", "rb") as own:
            early = own.read()
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.write(target, early)
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)


def main(argv: list[str] | None = None) -> int:
    style = (sys.argv[1:] if argv is None else argv)[0]
    warm_up(style)
    line = sys.stdin.buffer.readline()
    if not line.strip():  # end of file: the worker died or stopped the pool
        return 0
    order = WarmOrder.from_line(line)
    take_over_output(order.log)
    from jobs import run

    sys.argv = [str(run.__file__), *order.argv]  # as `python -m jobs.run` has them
    return run.main(order.argv)


if __name__ == "__main__":
    exit_without_teardown(main())
