"""Retention: deleting a finished batch and everything it owns, a chunk at a time.

One transition, ``purge_chunk``: in one transaction it deletes up to ``limit``
of a finished batch's jobs with their items, ledger rows, events and
``item.failed`` outbox rows, and takes them off the batch's counters and
total, so every invariant ``recall_check`` checks holds after each chunk. The
chunk that finds no job left deletes the batch's own rows (its events,
outbox, throughput buckets, counters) and then the batch. A purge killed
between chunks therefore leaves a smaller, consistent batch that the next run
finishes.

Locks follow the order every transition takes (jobs, then counters, then the
batch), and the batch is re-read under its lock: a *retry failed* that
reopened it, or is reopening it right now, makes the chunk delete nothing.
What the deleted jobs had finished as is added to tallies
(``jobs_completed_purged``...), so the metrics' totals never go backwards.
Portable ORM code (the deletes are plain statements on ``_meta`` names), the
same on every backend.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.db.models import F
from django.db.models.base import ModelBase

from batches.models import (
    COUNTER_SHARDS,
    Batch,
    BatchCounter,
    BatchItem,
    BatchMinute,
)
from jobs.models import (
    TERMINAL_JOB_STATUSES,
    Event,
    Job,
    JobRun,
    JobStatus,
    Lease,
    WebhookEvent,
)

from .rows import add_tally

# What the deleted jobs had finished as: tallied so the totals only ever grow.
PURGED_TALLIES = {
    JobStatus.COMPLETED: "jobs_completed_purged",
    JobStatus.FAILED: "jobs_failed_purged",
    JobStatus.CANCELLED: "jobs_cancelled_purged",
}
BATCHES_PURGED = "batches_purged"


@dataclass(frozen=True)
class Purged:
    """What one chunk did: ``jobs`` deleted (with their items), whether the
    batch row went too, or why nothing was deleted (``refused``)."""

    batch_id: int
    jobs: int = 0
    batch_deleted: bool = False
    refused: str = ""


def purge_chunk(batch_id: int, *, finished_before: datetime, limit: int) -> Purged:
    """Delete up to ``limit`` jobs of the batch (and the batch, once none is
    left), if it is finished and finished before ``finished_before``."""
    if limit < 1:
        raise ValueError("a purge chunk deletes at least one job")
    with transaction.atomic():
        jobs = list(
            Job.objects.filter(batch_id=batch_id)
            .order_by("pk")
            .select_for_update()
            .values_list("pk", "status", "item_id")[:limit]
        )
        list(
            BatchCounter.objects.filter(batch_id=batch_id)
            .order_by("shard")
            .select_for_update()
            .values_list("pk", flat=True)
        )
        batch = list(
            Batch.objects.filter(pk=batch_id)
            .select_for_update()
            .values_list("finished_at", flat=True)
        )
        if not batch:
            return Purged(batch_id, refused="no such batch")
        finished_at = batch[0]
        if finished_at is None:
            return Purged(batch_id, refused="not finished")
        if finished_at >= finished_before:
            return Purged(batch_id, refused="finished after the cutoff")
        if any(status not in TERMINAL_JOB_STATUSES for _, status, _ in jobs):
            # A finished batch with work left is drift: reconciliation reopens it.
            return Purged(batch_id, refused="has queued or leased jobs")
        if jobs:
            _delete_jobs(batch_id, jobs)
        # Fewer than asked can also mean a concurrent purge deleted some of
        # the rows this one waited for: the batch goes only once none is left.
        if len(jobs) < limit and not Job.objects.filter(batch_id=batch_id).exists():
            _delete_batch(batch_id)
            return Purged(batch_id, jobs=len(jobs), batch_deleted=True)
        return Purged(batch_id, jobs=len(jobs))


def _delete_jobs(batch_id: int, jobs: Sequence[tuple[int, str, int]]) -> None:
    """Delete these locked jobs of the batch, their items and everything that
    points at them; take the items off the counters and the batch's total."""
    job_ids = [pk for pk, _, _ in jobs]
    item_ids = [item for _, _, item in jobs]
    items = list(
        BatchItem.objects.filter(pk__in=item_ids).values_list(
            "pk", "status", "duration_ms"
        )
    )
    # The outbox rows of failed items, found through the batch's index.
    WebhookEvent.objects.filter(batch_id=batch_id, item_id__in=item_ids).delete()
    _delete(Event, "job_id", job_ids)
    _delete(Lease, "job_id", job_ids)
    _delete(JobRun, "job_id", job_ids)
    _delete(Job, "id", job_ids)
    _delete(BatchItem, "id", item_ids)
    _drop_from_counters(batch_id, items)
    for status, n in Counter(status for _, status, _ in jobs).items():
        add_tally(PURGED_TALLIES[JobStatus(status)], n)


def _drop_from_counters(
    batch_id: int, items: Sequence[tuple[int, str, int | None]]
) -> None:
    """The deleted items leave the counters (shard by shard, in order) and the
    batch's total, so both still equal a fresh count of what is left."""
    deltas: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total_ms = 0
    for pk, status, ms in items:
        delta = deltas[pk % COUNTER_SHARDS]
        delta[status] += 1
        delta[f"{status}_ms"] += ms or 0
        total_ms += ms or 0
    for shard, delta in sorted(deltas.items()):
        BatchCounter.objects.filter(batch_id=batch_id, shard=shard).update(
            **{column: F(column) - n for column, n in delta.items() if n}
        )
    Batch.objects.filter(pk=batch_id).update(
        total=F("total") - len(items), total_ms=F("total_ms") - total_ms
    )


def _delete_batch(batch_id: int) -> None:
    """The batch's own rows, then the batch (no job or item is left)."""
    WebhookEvent.objects.filter(batch_id=batch_id).delete()
    Event.objects.filter(batch_id=batch_id).delete()
    BatchMinute.objects.filter(batch_id=batch_id).delete()
    BatchCounter.objects.filter(batch_id=batch_id).delete()
    # Items no job stands behind (none, unless rows drifted) go with the batch.
    BatchItem.objects.filter(batch_id=batch_id).delete()
    Batch.objects.filter(pk=batch_id).delete()
    add_tally(BATCHES_PURGED, 1)


def _delete(model: ModelBase, column: str, ids: Sequence[int]) -> None:
    """``DELETE ... WHERE column IN ids``, as one statement: Django's cascade
    collector would first look up every model that may point at these rows,
    some through columns without an index."""
    if not ids:
        return
    table = model._meta.db_table  # type: ignore[attr-defined]
    marks = ", ".join(["%s"] * len(ids))
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", list(ids))
