"""Batches of audio items, and the progress counters operators see.

A Batch holds BatchItems; each item has exactly one jobs.Job that carries its
lease. An item's status is never set here on its own: jobs.models owns every
transition and moves the job, the item and these counters in one transaction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

# Progress counters are split over this many rows per batch so that concurrent
# transitions in one batch rarely wait for each other (no hot row). An item
# always lands in shard ``item_id % COUNTER_SHARDS``.
COUNTER_SHARDS = 16


class ItemStatus(models.TextChoices):
    QUEUED = "queued"
    TRANSCRIBING = "transcribing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_ITEM_STATUSES = (ItemStatus.DONE, ItemStatus.FAILED, ItemStatus.CANCELLED)
# The counter columns: an item count and a duration sum (ms) per status.
COUNTER_COLUMNS = (*ItemStatus.values, *(f"{s}_ms" for s in ItemStatus.values))


class BatchQuerySet(models.QuerySet):
    def open(self) -> BatchQuerySet:
        """Batches whose jobs may be claimed: not paused, cancelled or finished."""
        return self.filter(
            paused_at__isnull=True, cancelled_at__isnull=True, finished_at__isnull=True
        )

    def settle(self, *, now) -> int:
        """Mark finished the batches of this queryset with nothing queued or in
        flight; return how many.

        The batch row is locked before the counters are read. Everything that
        queues items in a finished batch again (retry) clears ``finished_at``
        under the same lock, so a batch is never marked finished while it has
        work to hand out.
        """
        settled = 0
        for batch_id in self.filter(finished_at__isnull=True).values_list(
            "pk", flat=True
        ):
            with transaction.atomic():
                batch = (
                    Batch.objects.select_for_update()
                    .filter(pk=batch_id, finished_at__isnull=True)
                    .first()
                )
                if batch is None:
                    continue
                counts = BatchCounter.objects.filter(batch_id=batch_id).totals()
                if counts[ItemStatus.QUEUED] or counts[ItemStatus.TRANSCRIBING]:
                    continue
                batch.finished_at = now
                batch.save(update_fields=["finished_at"])
                settled += 1
        return settled


class Batch(models.Model):
    """A named set of items submitted together.

    ``paused_at`` and ``cancelled_at`` record operator intent; ``finished_at`` is
    set by the sweep once no item is queued or in flight (and cleared when items
    are queued again), so claims skip finished batches without counting them.
    Live state for display comes from the counters, never from these timestamps.
    """

    name = models.CharField(max_length=200)
    priority = models.SmallIntegerField(
        default=0, help_text="Higher runs first; equal priorities run oldest first."
    )
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    total = models.PositiveIntegerField(default=0)
    total_ms = models.BigIntegerField(
        default=0,
        help_text="Sum of the items' durations (ms), where the manifest gave them.",
    )
    durations_known = models.BooleanField(
        default=False, help_text="Every item has a duration: ETA is weighted by it."
    )
    paused_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Set when a repair found an item in an unexpected status: the counters may be
    # off by that item until the next sweep recounts the batch.
    recount_requested_at = models.DateTimeField(null=True, blank=True)

    objects = BatchQuerySet.as_manager()

    class Meta:
        verbose_name_plural = "batches"
        permissions = [
            ("operate_batch", "Can pause, resume, cancel and retry batches"),
            ("export_batch", "Can export a batch's results"),
        ]
        indexes = [
            # Claims walk the open batches in priority order.
            models.Index(
                F("priority").desc(),
                "id",
                name="batch_open_by_priority",
                condition=Q(
                    paused_at__isnull=True,
                    cancelled_at__isnull=True,
                    finished_at__isnull=True,
                ),
            ),
            models.Index(
                fields=["id"],
                name="batch_unfinished_cancel",
                condition=Q(cancelled_at__isnull=False, finished_at__isnull=True),
            ),
            models.Index(
                fields=["id"],
                name="batch_recount_requested",
                condition=Q(recount_requested_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def counts(self) -> dict[str, int]:
        """Items per status, from the counters (no scan of the items)."""
        return BatchCounter.objects.filter(batch=self).totals()

    def pause(self, *, now=None) -> bool:
        """Stop handing out this batch's jobs; leases in flight run to their end."""
        now = now or timezone.now()
        paused = Batch.objects.filter(pk=self.pk, paused_at__isnull=True).update(
            paused_at=now
        )
        self.refresh_from_db(fields=["paused_at"])
        return bool(paused)

    def resume(self) -> bool:
        resumed = Batch.objects.filter(pk=self.pk, paused_at__isnull=False).update(
            paused_at=None
        )
        self.refresh_from_db(fields=["paused_at"])
        return bool(resumed)


class BatchItem(models.Model):
    batch = models.ForeignKey(
        Batch, on_delete=models.CASCADE, related_name="items", db_index=False
    )
    source = models.TextField()
    params = models.JSONField(default=dict, blank=True)
    # Whole milliseconds, so the counters' duration sums stay exact (no float drift).
    duration_ms = models.PositiveBigIntegerField(null=True, blank=True)
    status = models.CharField(
        max_length=16, choices=ItemStatus.choices, default=ItemStatus.QUEUED
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["batch", "id"], name="item_batch_id"),
            models.Index(fields=["batch", "status", "id"], name="item_batch_status"),
            # "No item is transcribing without a live lease" is checked every sweep.
            models.Index(
                fields=["id"],
                name="item_transcribing",
                condition=Q(status=ItemStatus.TRANSCRIBING),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=ItemStatus.values), name="item_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.source

    @property
    def duration_seconds(self) -> float | None:
        return None if self.duration_ms is None else self.duration_ms / 1000


@dataclass(frozen=True)
class ItemMove:
    """One item changing status; the counters shift by one item and its duration."""

    item_id: int
    batch_id: int
    old: str
    new: str
    ms: int = 0


def move_items(moves: Iterable[ItemMove], *, now) -> None:
    """Write the items' new statuses and shift the counters to match.

    Must run inside the caller's transaction, after the caller has locked the
    items' jobs (every item write happens under its job's lock), so the ``old``
    statuses it read are current.
    """
    moves = [m for m in moves if m.old != m.new]
    by_new: dict[str, list[int]] = defaultdict(list)
    for move in moves:
        by_new[move.new].append(move.item_id)
    for status, ids in by_new.items():
        BatchItem.objects.filter(pk__in=ids).update(status=status, updated_at=now)
    BatchCounter.objects.shift(moves)
    BatchMinute.objects.record(moves, now=now)


class BatchCounterQuerySet(models.QuerySet):
    def recount(self, batch_id: int) -> bool:
        """Make a batch's counters equal a fresh count of its items.

        Locks the batch's counter rows first: a transition that moves an item in
        this batch waits for the recount (it updates the counters last), so the
        count and the write agree. Returns True if anything was wrong.
        """
        with transaction.atomic():
            rows = {
                c.shard: c
                for c in self.select_for_update()
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
            changed = False
            for shard in range(COUNTER_SHARDS):
                want = {c: actual[shard][c] for c in COUNTER_COLUMNS}
                row = rows.get(shard)
                if row is None:
                    BatchCounter.objects.create(batch_id=batch_id, shard=shard, **want)
                    changed = True
                elif any(getattr(row, c) != v for c, v in want.items()):
                    BatchCounter.objects.filter(pk=row.pk).update(**want)
                    changed = True
            stray = self.filter(batch_id=batch_id, shard__gte=COUNTER_SHARDS).delete()[
                0
            ]
            return changed or bool(stray)

    def totals(self) -> dict[str, int]:
        """Sum the shards: item counts per status, plus ``<status>_ms`` durations."""
        sums = self.aggregate(**{c: Sum(c) for c in COUNTER_COLUMNS})
        return {c: sums[c] or 0 for c in COUNTER_COLUMNS}

    def shift(self, moves: Iterable[ItemMove]) -> None:
        """Apply the moves to the counters, one UPDATE per (batch, shard).

        Rows are updated in (batch, shard) order so that two transactions that
        touch several shards cannot deadlock.
        """
        deltas: dict[tuple[int, int], dict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        for m in moves:
            delta = deltas[(m.batch_id, m.item_id % COUNTER_SHARDS)]
            delta[m.old] -= 1
            delta[m.new] += 1
            delta[f"{m.old}_ms"] -= m.ms
            delta[f"{m.new}_ms"] += m.ms
        for (batch_id, shard), delta in sorted(deltas.items()):
            changes = {column: F(column) + d for column, d in delta.items() if d}
            if changes:
                self.filter(batch_id=batch_id, shard=shard).update(**changes)


class BatchCounter(models.Model):
    """One shard of a batch's per-status item counts.

    Kept in the same transaction as every item status change (see move_items),
    so the sum over a batch's shards always equals a fresh count of its items.
    """

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="counters")
    shard = models.PositiveSmallIntegerField()
    queued = models.IntegerField(default=0)
    transcribing = models.IntegerField(default=0)
    done = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    cancelled = models.IntegerField(default=0)
    queued_ms = models.BigIntegerField(default=0)
    transcribing_ms = models.BigIntegerField(default=0)
    done_ms = models.BigIntegerField(default=0)
    failed_ms = models.BigIntegerField(default=0)
    cancelled_ms = models.BigIntegerField(default=0)

    objects = BatchCounterQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "shard"], name="counter_shard_unique"
            )
        ]

    def __str__(self) -> str:
        return f"counters of batch {self.batch_id}, shard {self.shard}"


class BatchMinuteQuerySet(models.QuerySet):
    def record(self, moves: Iterable[ItemMove], *, now) -> None:
        """Count the moves that finish items (done or failed) in ``now``'s minute.

        One upsert per (batch, shard), in the caller's transaction, after the
        counters (same lock order everywhere: no deadlock).
        """
        minute = now.replace(second=0, microsecond=0)
        rows: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for m in moves:
            if m.new == ItemStatus.DONE:
                row = rows[(m.batch_id, m.item_id % COUNTER_SHARDS)]
                row[0] += 1
                row[1] += m.ms
            elif m.new == ItemStatus.FAILED:
                row = rows[(m.batch_id, m.item_id % COUNTER_SHARDS)]
                row[2] += 1
                row[3] += m.ms
        if not rows:
            return
        table = BatchMinute._meta.db_table
        # INSERT ... ON CONFLICT DO UPDATE adds to an existing row atomically, on
        # both PostgreSQL and SQLite; the ORM cannot express the increment.
        sql = (
            f"INSERT INTO {table} "
            f"(batch_id, minute, shard, done, done_ms, failed, failed_ms) "
            f"VALUES (%s, %s, %s, %s, %s, %s, %s) "
            f"ON CONFLICT (batch_id, minute, shard) DO UPDATE SET "
            f"done = {table}.done + excluded.done, "
            f"done_ms = {table}.done_ms + excluded.done_ms, "
            f"failed = {table}.failed + excluded.failed, "
            f"failed_ms = {table}.failed_ms + excluded.failed_ms"
        )
        at = connection.ops.adapt_datetimefield_value(minute)
        with connection.cursor() as cursor:
            cursor.executemany(
                sql,
                [
                    (batch, at, shard, *counts)
                    for (batch, shard), counts in sorted(rows.items())
                ],
            )


class BatchMinute(models.Model):
    """Items of a batch that finished (done or failed) in one minute, per shard.

    Written in the same transaction as the counters; the throughput chart and
    the ETA's recent rate are sums over these rows. The sweep drops old ones.
    """

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="minutes")
    minute = models.DateTimeField()
    shard = models.PositiveSmallIntegerField()
    done = models.IntegerField(default=0)
    done_ms = models.BigIntegerField(default=0)
    failed = models.IntegerField(default=0)
    failed_ms = models.BigIntegerField(default=0)

    objects = BatchMinuteQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "minute", "shard"], name="minute_shard_unique"
            )
        ]
        indexes = [models.Index(fields=["minute"], name="minute_time")]

    def __str__(self) -> str:
        return f"batch {self.batch_id} at {self.minute:%H:%M}, shard {self.shard}"
