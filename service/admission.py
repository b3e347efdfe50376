"""What the API admits beyond a spec's own validation: a device some live worker offers."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from jobs.spec import SpecError
from service import store
from service.settings import Settings


def device_errors(device: str, *, session: Session, settings: Settings) -> list[SpecError]:
    """A device no live worker offers is refused (unless OPTLAB_QUEUE_FOR_ABSENT_DEVICES); with no
    live worker at all (a fresh start) the job is accepted and waits (`waiting_reason`)."""
    if not _asks_store(device, settings):
        return []
    kind = "cuda"
    offered = store.offered_devices(session=session, within_s=settings.lease_s)
    if offered is None or kind in offered:
        return []
    message = (
        f"no live worker offers device {device!r}; live workers offer: {', '.join(sorted(offered))} "
        "(OPTLAB_QUEUE_FOR_ABSENT_DEVICES=true queues such jobs for workers yet to come)"
    )
    return [SpecError(loc=["body", "device"], msg=message)]


def device_errors_asking(
    sessions: sessionmaker[Session], device: str, *, settings: Settings
) -> list[SpecError]:
    """`device_errors`, with a session of its own only when the answer needs the store."""
    if not _asks_store(device, settings):
        return []
    with sessions() as session:
        return device_errors(device, session=session, settings=settings)


def _asks_store(device: str, settings: Settings) -> bool:
    # Every worker runs CPU jobs: only a CUDA device needs to know who is live.
    return device.startswith("cuda") and not settings.queue_for_absent_devices
