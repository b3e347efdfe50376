"""A job runs the optimizer class it was validated against, or fails at its start saying why.

The service records in a job's spec where the catalogue found each plugin optimizer it names
(`jobs.spec.with_sources`: the file, the class and the file's sha256). A plugin folder can change
while the job waits in the queue: a second file that claims the name, a class renamed away, the file
edited. The job process compares what its registry loads now with that record before it trains, and
fails with both places named rather than run another class under the name (which had failed on the
job's arguments, or trained a different optimizer without a word).
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.result import OptimizerSource
from jobs.spec import OptimizerChoice
from optimizers.registry import PLUGIN_SOURCE, Entry, Registry


class OptimizerSourceChanged(ValueError):
    """The job's optimizer now comes from another class or file than the one it was submitted for."""


def source_of(entry: Entry) -> OptimizerSource:
    """Where `entry`'s class came from, as a job records it."""
    return OptimizerSource(source=entry.source, class_name=entry.cls.__qualname__, sha256=entry.sha256)


def recorded_plugin_files(choices: Sequence[OptimizerChoice | None]) -> list[str]:
    """The plugin files the spec records for its optimizer and base: the job reads those first."""
    sources = [choice.source for choice in choices if choice is not None and choice.source is not None]
    return [s.source.removeprefix(PLUGIN_SOURCE) for s in sources if s.source.startswith(PLUGIN_SOURCE)]


def loaded_entry(registry: Registry, choice: OptimizerChoice, style: str) -> Entry:
    """`choice`'s entry in `registry`; OptimizerSourceChanged where the spec records a source (the
    service set it at submission) and the entry is not that class, as that file's text."""
    recorded = choice.source
    try:
        entry = registry.get(choice.name, style)
    except ValueError as exc:
        if recorded is None:
            raise
        raise OptimizerSourceChanged(
            f"optimizer {choice.name!r} was submitted for {recorded.where()} ({recorded.source}), which "
            f"does not register it now: {exc}. Fix the plugin folder (GET /optimizers lists its errors) "
            "and resubmit the job"
        ) from None
    held_to_record(choice, entry)
    return entry


def held_to_record(choice: OptimizerChoice, entry: Entry) -> None:
    """OptimizerSourceChanged where `choice` records a source and `entry` is another class or file,
    or that file's text changed; nothing where it records none (a spec written by hand)."""
    recorded = choice.source
    if recorded is None:
        return
    now = source_of(entry)
    # The same class in a file of the same text is the class validated, wherever this host keeps it
    # (plugin folders mounted at other paths on another GPU host).
    same_text = recorded.sha256 is not None and now.sha256 == recorded.sha256
    moved = now.source != recorded.source and not same_text
    if moved or now.class_name != recorded.class_name:
        raise OptimizerSourceChanged(
            f"optimizer {choice.name!r} now comes from {now.where()} ({now.source}); the job was submitted "
            f"for {recorded.where()} ({recorded.source}), and its hyperparameters were checked against "
            "that class: resubmit the job to train the one there now"
        )
    # A catalogue published before files were hashed records none: the file and class still hold.
    if recorded.sha256 is not None and now.sha256 != recorded.sha256:
        raise OptimizerSourceChanged(
            f"optimizer {choice.name!r} ({recorded.where()}) was edited after the job was submitted: its "
            f"file's sha256 is {_short(now.sha256)} now, {_short(recorded.sha256)} then, and the job's "
            "hyperparameters were checked against the code as it was: resubmit the job to train it as it is"
        )


def _short(sha256: str | None) -> str:
    return f"{sha256[:12]}…" if sha256 else "none"
