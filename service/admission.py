"""What the API admits beyond a spec's own validation: a device some live worker offers."""

from __future__ import annotations

from sqlalchemy.orm import Session

from jobs.spec import SpecError
from service import store
from service.settings import Settings


def device_errors(device: str, *, session: Session, settings: Settings) -> list[SpecError]:
    """A device no live worker offers is refused (unless OPTLAB_QUEUE_FOR_ABSENT_DEVICES); with no
    live worker at all (a fresh start) the job is accepted and waits (`waiting_reason`)."""
    if not device.startswith("cuda") or settings.queue_for_absent_devices:
        return []  # every worker runs CPU jobs: no need to ask the store who is live
    kind = "cuda"
    offered = store.offered_devices(session=session, within_s=settings.lease_s)
    if offered is None or kind in offered:
        return []
    message = (
        f"no live worker offers device {device!r}; live workers offer: {', '.join(sorted(offered))} "
        "(OPTLAB_QUEUE_FOR_ABSENT_DEVICES=true queues such jobs for workers yet to come)"
    )
    return [SpecError(loc=["body", "device"], msg=message)]
