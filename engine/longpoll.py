"""The long-poll waker's probe: how many parked claims may find work now, and
which labels they need to take it.

While claims are parked (``api/waiter.py``, ``recall_site/gunicorn_worker.py``),
one process of the server runs this every ``RECALL_LONG_POLL_PROBE_SECONDS``
and shares the answer; each process then claims for that many of its own
(``api.worker_views.claims_for_waiting``).
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Count, Exists, F, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce, Now

from batches.labels import Labels
from batches.models import Batch
from jobs.models import Job, JobStatus

# Open batches one probe counts jobs in: beyond them it answers a lower bound,
# which the next probe raises once the woken claims have emptied the first ones.
PROBE_BATCHES = 20


def claimable_jobs(limit: int, *, now: datetime | None = None) -> int:
    """How many jobs claims could take now, at most ``limit`` (``claimable_work``'s
    count)."""
    return claimable_work(limit, now=now)[0]


def claimable_work(
    limit: int, *, now: datetime | None = None
) -> tuple[int, list[Labels]]:
    """How many jobs claims could take now, at most ``limit``: expired leases
    (a claim reclaims them first) plus, per open batch with a claimable job,
    its claimable jobs up to the room under its in-flight cap (in the first
    ``PROBE_BATCHES`` such batches); and the distinct requirements of those
    jobs (their batch's and, for a re-run's, their own, together: ``combined``),
    so that the server wakes only the waiting claims whose labels can serve
    one of them. A read, on the database's
    clock (each statement's own, unless ``now`` is given): the waker's probe.
    With nothing to find, which is what it finds nearly every time, it is
    two index probes.
    """
    if limit < 1:
        return 0, []
    at: datetime | Now = Now() if now is None else now
    live = (
        Job.objects.filter(batch=OuterRef("pk"), status=JobStatus.LEASED)
        .order_by()
        .values("batch")
        .annotate(n=Count("pk"))
        .values("n")
    )
    batches = (
        Batch.objects.open()
        .filter(Exists(Job.objects.claimable(at).filter(batch=OuterRef("pk"))))
        .annotate(room=F("max_in_flight") - Coalesce(Subquery(live), 0))
        .filter(Q(max_in_flight__isnull=True) | Q(room__gt=0))
        .values_list("pk", "room", "requires")
    )
    expired = Job.objects.expired(at)
    if not expired.exists() and not batches.exists():
        return 0, []
    requires: list[Labels] = []

    def needs(required: Labels) -> None:
        if required not in requires:
            requires.append(required)

    found = 0
    for required, own in expired.order_by("lease_expires_at").values_list(
        "batch__requires", "requires"
    )[:limit]:
        both = combined(required, own)
        if both is not None:
            found += 1
            needs(both)
    for batch_id, room, required in batches[:PROBE_BATCHES]:
        if found >= limit:
            break
        want = limit - found if room is None else min(room, limit - found)
        # Each job's own requirement (a re-run's; {} for nearly all) adds to
        # its batch's: a claim is woken only for a job it can take.
        owns = Job.objects.claimable(at).filter(batch_id=batch_id)
        for own in owns.values_list("requires", flat=True)[:want]:
            both = combined(required, own)
            if both is not None:
                found += 1
                needs(both)
    return min(found, limit), requires


def combined(batch: object, job: object) -> Labels | None:
    """What a worker must offer to take a job: its batch's requirement and
    its own together; None when they ask one key for different values (no
    worker can take it)."""
    need: Labels = dict(batch) if isinstance(batch, dict) else {}
    for key, value in (job if isinstance(job, dict) else {}).items():
        if need.setdefault(key, value) != value:
            return None
    return need
