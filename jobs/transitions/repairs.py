"""The repairs reconciliation applies, each a transition of its own.

``engine.reconcile`` decides what to heal; these functions heal one thing each,
in a short transaction, and log every repair (an event row, a WARNING line and
the repairs tally). The job row is the authority: a repair brings items,
ledger rows, counters and batch flags in line with it, and never changes a
job's status, except to fail a queued job that has no attempts left and so
could never run. Portable ORM code, the same on every backend.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from functools import reduce
from operator import or_

from django.db import transaction
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce

from batches.models import (
    COUNTER_COLUMNS,
    COUNTER_SHARDS,
    FLAG_COUNTER_COLUMNS,
    Batch,
    BatchCounter,
    BatchItem,
    BatchMinute,
)
from jobs.models import Job, JobStatus, Lease, LeaseEnd, RepairKind, item_status_for

from .outbox import finishing
from .rows import move_items, move_jobs, record_repair, rejoin_share
from .rules import EXHAUSTED


def heal_item(job_id: int, *, now: datetime) -> bool:
    """Set the item's status to the one that agrees with the job's."""
    with finishing(now):
        job = Job.objects.filter(pk=job_id).locked().first()
        if job is None or job.item.status == item_status_for(job.status):
            return False
        move_items([job], was=job.status, to=job.status, now=now)
    return True


def close_stray_leases(job_id: int, *, now: datetime) -> int:
    """Close open ledger rows of this job that no live lease stands behind."""
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id).locked().first()
        if job is None:
            return 0
        stray = Lease.objects.filter(job=job, ended_at__isnull=True)
        if job.status == JobStatus.LEASED:
            stray = stray.exclude(token=job.lease_token)
        rows = list(stray)
        for lease in rows:
            Lease.objects.filter(pk=lease.pk).update(
                ended_at=now,
                end_reason=LeaseEnd.EXPIRED,
                error=f"Closed by reconciliation: the job is {job.status}.",
            )
            record_repair(
                job,
                f"Closed lease-ledger row {lease.pk} (attempt {lease.attempt}) "
                f"left open although the job is {job.status}.",
                kind=RepairKind.LEASE_CLOSED,
                at=now,
            )
    return len(rows)


def restore_lease_row(job_id: int, *, now: datetime) -> bool:
    """Give a leased job the open ledger row it lacks."""
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id, status=JobStatus.LEASED).locked().first()
        if (
            job is None
            or Lease.objects.filter(
                token=job.lease_token, ended_at__isnull=True
            ).exists()
        ):
            return False
        Lease.objects.filter(job=job, ended_at__isnull=True).update(
            ended_at=now,
            end_reason=LeaseEnd.EXPIRED,
            error="Closed by reconciliation: superseded by the job's live lease.",
        )
        # A closed row with the live token would collide with the new one.
        Lease.objects.filter(token=job.lease_token).delete()
        Lease.objects.create(
            job=job,
            worker_id=job.leased_by_id,
            token=job.lease_token,
            attempt=job.attempts,
            claimed_at=job.heartbeat_at or now,
            heartbeat_at=job.heartbeat_at,
            expires_at=job.lease_expires_at,
        )
        record_repair(
            job,
            "Opened the missing lease-ledger row for the job's live lease.",
            kind=RepairKind.LEASE_RESTORED,
            at=now,
        )
    return True


def fail_exhausted(job_id: int, *, now: datetime) -> bool:
    """Fail a queued job that has no attempts left (it can never be claimed)."""
    with finishing(now):
        job = (
            Job.objects.filter(
                pk=job_id, status=JobStatus.QUEUED, attempts__gte=F("max_attempts")
            )
            .locked()
            .first()
        )
        if job is None:
            return False
        move_jobs([job], to=JobStatus.FAILED, now=now, last_error=EXHAUSTED)
        record_repair(job, EXHAUSTED, kind=RepairKind.EXHAUSTED_FAILED, at=now)
    return True


def reopen_batch_of(job_id: int, *, now: datetime) -> bool:
    """Clear ``finished_at`` of the batch of an unfinished job: a batch marked
    finished while it had work would never be claimed from again."""
    with transaction.atomic():
        job = (
            Job.objects.filter(
                pk=job_id,
                status__in=[JobStatus.QUEUED, JobStatus.LEASED],
                batch__finished_at__isnull=False,
            )
            .locked()
            .first()
        )
        if job is None:
            return False
        Batch.objects.filter(pk=job.batch_id).update(finished_at=None)
        rejoin_share([job.batch_id])
        record_repair(
            job,
            "The batch was marked finished but this job was not; reopened it.",
            kind=RepairKind.BATCH_REOPENED,
            at=now,
        )
    return True


def flagged_per_shard(batch_id: int) -> QuerySet:
    """Per counter shard of the batch, its items with each quality flag (only
    the shards that have flagged items; each flag through its partial index)."""
    return (
        BatchItem.objects.filter(batch_id=batch_id)
        .filter(reduce(or_, (Q(**{c: True}) for c in FLAG_COUNTER_COLUMNS)))
        .annotate(shard=F("id") % COUNTER_SHARDS)
        .values("shard")
        .annotate(
            **{c: Count("id", filter=Q(**{c: True})) for c in FLAG_COUNTER_COLUMNS}
        )
        .order_by()
    )


def recount(
    batch_id: int, *, now: datetime, requested_at: datetime | None = None
) -> bool:
    """Make a batch's counters equal a fresh count of its items; True if they
    were wrong (a repair, logged). Clears the batch's recount request if it is
    still ``requested_at`` (another repair may have asked again meanwhile).

    The batch's counter rows are locked first: a transition that moves an item
    in this batch waits for the recount (it updates the counters last), so the
    count and the write agree.
    """
    with transaction.atomic():
        rows = {
            c.shard: c
            for c in BatchCounter.objects.select_for_update()
            .filter(batch_id=batch_id)
            .order_by("shard")
        }
        actual: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        counted = (
            BatchItem.objects.filter(batch_id=batch_id)
            .annotate(shard=F("id") % COUNTER_SHARDS)
            .values("shard", "status")
            .annotate(n=Count("id"), ms=Coalesce(Sum("duration_ms"), 0))
            .order_by()
        )
        for row in counted:
            actual[row["shard"]][row["status"]] += row["n"]
            actual[row["shard"]][f"{row['status']}_ms"] += row["ms"]
        for row in flagged_per_shard(batch_id):
            for column in FLAG_COUNTER_COLUMNS:
                actual[row["shard"]][column] += row[column]
        changed = False
        for shard in range(COUNTER_SHARDS):
            want = {
                c: actual[shard][c] for c in (*COUNTER_COLUMNS, *FLAG_COUNTER_COLUMNS)
            }
            kept = rows.get(shard)
            if kept is None:
                BatchCounter.objects.create(batch_id=batch_id, shard=shard, **want)
                changed = True
            elif any(getattr(kept, c) != v for c, v in want.items()):
                BatchCounter.objects.filter(pk=kept.pk).update(**want)
                changed = True
        stray, _ = BatchCounter.objects.filter(
            batch_id=batch_id, shard__gte=COUNTER_SHARDS
        ).delete()
        wrong = changed or bool(stray)
        if wrong:
            record_repair(
                None,
                "Progress counters differed from a recount of the items; fixed.",
                kind=RepairKind.COUNTERS_FIXED,
                at=now,
                batch_id=batch_id,
            )
        if requested_at is not None:
            Batch.objects.filter(pk=batch_id, recount_requested_at=requested_at).update(
                recount_requested_at=None
            )
    return wrong


def drop_throughput(*, before: datetime) -> int:
    """Forget the per-minute finish buckets older than ``before`` (retention)."""
    deleted, _ = BatchMinute.objects.filter(minute__lt=before).delete()
    return deleted
