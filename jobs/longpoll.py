"""The long-poll waker's probe: how many parked claims may find work now.

Each server process holding parked claims (``jobs/waiter.py``,
``recall_site/gunicorn_worker.py``) runs this every
``RECALL_LONG_POLL_PROBE_SECONDS`` and wakes that many of them.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Count, Exists, F, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce

from batches.models import Batch

from . import transitions
from .models import Job, JobStatus

# Open batches one probe counts jobs in: beyond them it answers a lower bound,
# which the next probe raises once the woken claims have emptied the first ones.
PROBE_BATCHES = 20


def claimable_jobs(limit: int, *, now: datetime | None = None) -> int:
    """How many jobs claims could take now, at most ``limit``: expired leases
    (a claim reclaims them first) plus, per open batch with a claimable job,
    its claimable jobs up to the room under its in-flight cap (in the first
    ``PROBE_BATCHES`` such batches). A read, on the database's clock: the
    waker's probe, a few index probes."""
    if limit < 1:
        return 0
    now = transitions.now() if now is None else now
    found = Job.objects.expired(now)[:limit].count()
    if found >= limit:
        return limit
    live = (
        Job.objects.filter(batch=OuterRef("pk"), status=JobStatus.LEASED)
        .order_by()
        .values("batch")
        .annotate(n=Count("pk"))
        .values("n")
    )
    batches = (
        Batch.objects.open()
        .filter(Exists(Job.objects.claimable(now).filter(batch=OuterRef("pk"))))
        .annotate(room=F("max_in_flight") - Coalesce(Subquery(live), 0))
        .filter(Q(max_in_flight__isnull=True) | Q(room__gt=0))
        .values_list("pk", "room")[:PROBE_BATCHES]
    )
    for batch_id, room in batches:
        want = limit - found if room is None else min(room, limit - found)
        found += Job.objects.claimable(now).filter(batch_id=batch_id)[:want].count()
        if found >= limit:
            return limit
    return found
