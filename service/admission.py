"""What the API admits beyond a spec's own validation: a device, and as many slots, as some live
worker offers; and no `cuda:N` (N >= 1), which only a job run by hand may name."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from jobs.spec import SpecError
from service import store
from service.capabilities import JobNeeds, gpu_index_refusal
from service.settings import Settings

# How a refusal ends: the setting that turns it into a wait.
_OR_QUEUE = "(OPTLAB_QUEUE_FOR_ABSENT_DEVICES=true queues such jobs for workers yet to come)"


def device_errors(needs: JobNeeds, device: str, *, session: Session, settings: Settings) -> list[SpecError]:
    """A device no live worker offers, or more slots (`distribution.devices`) than any live worker of
    the job's framework has, is refused (unless OPTLAB_QUEUE_FOR_ABSENT_DEVICES): such a job waited
    for good, counted against the queue's quotas. With no live worker at all (a fresh start) the job
    is accepted and waits (`waiting_reason`). A `cuda:N` device (N >= 1) is refused whatever the
    workers: a worker picks each job's GPUs (`gpu_index_refusal`)."""
    refused = _index_errors(device)
    if refused or not _asks_store(needs, settings):
        return refused
    workers = store.live_workers(session=session, within_s=settings.lease_s)
    if not workers:
        return []
    if needs.gpu and not any("cuda" in w.devices for w in workers):
        offered = sorted({d for w in workers for d in w.devices})
        message = (
            f"no live worker offers device {device!r}; live workers offer: {', '.join(offered)} {_OR_QUEUE}"
        )
        return [SpecError(loc=["body", "device"], msg=message)]
    largest = store.largest_offer(workers, needs)
    if largest and needs.slots > largest:
        kind = "GPUs" if needs.gpu else "slots"
        if not needs.gpu and not needs.mixes and any(0 < w.gpus < w.slots for w in workers):
            kind = "slots of one kind (device 'auto' takes GPU or CPU-only slots, never both; 'cpu' may)"
        message = (
            f"distribution.devices must be at most {largest}, the most {kind} a live worker running "
            f"{needs.framework} jobs has; received {needs.slots} {_OR_QUEUE}"
        )
        return [SpecError(loc=["body", "distribution", "devices"], msg=message)]
    return []


def device_errors_asking(
    sessions: sessionmaker[Session], needs: JobNeeds, device: str, *, settings: Settings
) -> list[SpecError]:
    """`device_errors`, with a session of its own only when the answer needs the store."""
    refused = _index_errors(device)
    if refused or not _asks_store(needs, settings):
        return refused
    with sessions() as session:
        return device_errors(needs, device, session=session, settings=settings)


def _index_errors(device: str) -> list[SpecError]:
    refusal = gpu_index_refusal(device)
    return [] if refusal is None else [SpecError(loc=["body", "device"], msg=refusal)]


def _asks_store(needs: JobNeeds, settings: Settings) -> bool:
    # Every worker runs one-slot CPU jobs: only a CUDA device or several slots need to know who is live.
    return (needs.gpu or needs.slots > 1) and not settings.queue_for_absent_devices
