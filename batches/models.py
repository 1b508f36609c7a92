"""Batches of audio items, and the progress counters operators see: schema and reads.

A Batch holds BatchItems; each item has exactly one jobs.Job that carries its
lease. Nothing here changes an item, a counter or a throughput bucket: the
transitions in ``jobs.transitions`` move the job, the item and these counters
in one transaction.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q, Sum
from django.urls import reverse
from django.utils import timezone

from .flags import FLAG_COLUMNS, flag_names
from .json_limits import StoredJSONDecoder

# Fair share (stride scheduling): each claim that a batch wins over another open
# batch of its priority adds VIRTUAL_TIME_STRIDE // weight to its virtual time,
# and claims go to the batch with the least. Weights run 1..MAX_WEIGHT.
VIRTUAL_TIME_STRIDE = 1_000_000_000
MAX_WEIGHT = 1000
# The largest in-flight cap accepted (a PositiveIntegerField holds more).
MAX_IN_FLIGHT = 1_000_000

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
# The counters of done items per quality flag (batches.flags), kept beside them.
FLAG_COUNTER_COLUMNS = tuple(FLAG_COLUMNS.values())


class BatchQuerySet(models.QuerySet):
    def open(self) -> BatchQuerySet:
        """Batches whose jobs may be claimed: not paused, cancelled or finished."""
        return self.filter(
            paused_at__isnull=True, cancelled_at__isnull=True, finished_at__isnull=True
        )


class Batch(models.Model):
    """A named set of items submitted together.

    ``paused_at`` and ``cancelled_at`` record operator intent; ``finished_at`` is
    set by the transition that leaves no item queued or in flight (or by the
    sweep, which heals a missed one), and cleared when items are queued again,
    so claims skip finished batches without counting them.
    Live state for display comes from the counters, never from these timestamps.
    """

    name = models.CharField(max_length=200)
    priority = models.SmallIntegerField(
        default=0,
        help_text="Higher runs first; equal priorities share the workers by weight.",
    )
    weight = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_WEIGHT)],
        help_text=f"This batch's share of the claims among open batches of its "
        f"priority, relative to theirs (1 to {MAX_WEIGHT}).",
    )
    max_in_flight = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_IN_FLIGHT)],
        help_text="At most this many of its items in flight at once (empty: no cap).",
    )
    # Worker labels a worker must declare to claim this batch's jobs
    # (``batches.labels``): {} lets every worker claim them.
    requires = models.JSONField(
        default=dict,
        blank=True,
        decoder=StoredJSONDecoder,
        help_text="Labels a worker must offer, each with exactly this value, to "
        "take this batch's jobs (none: any worker).",
    )
    # Stride scheduling's pass: how much of its share the batch has used.
    virtual_time = models.BigIntegerField(default=0)
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
    # How many times the batch has finished: each finish is one generation, and
    # writes exactly one ``batch.finished`` outbox event keyed (batch, generation).
    finishes = models.PositiveIntegerField(default=0)
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
            # Claims walk the open batches by priority, then virtual time.
            models.Index(
                F("priority").desc(),
                "virtual_time",
                "id",
                name="batch_open_by_share",
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
        constraints = [
            models.CheckConstraint(
                condition=Q(weight__gte=1, weight__lte=MAX_WEIGHT),
                name="batch_weight_in_range",
            ),
            models.CheckConstraint(
                condition=Q(max_in_flight__isnull=True) | Q(max_in_flight__gte=1),
                name="batch_max_in_flight_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("batch-detail", args=[self.pk])

    @property
    def stride(self) -> int:
        """Virtual time one claim costs this batch."""
        return VIRTUAL_TIME_STRIDE // self.weight

    def counts(self) -> dict[str, int]:
        """Items per status, from the counters (no scan of the items)."""
        return BatchCounter.objects.filter(batch=self).totals()


def flag_counts(totals: dict[str, int]) -> dict[str, int]:
    """``{"empty": N, "short": N, "language_mismatch": N}`` from counter totals."""
    return {flag: totals.get(column, 0) for flag, column in FLAG_COLUMNS.items()}


class BatchItem(models.Model):
    batch = models.ForeignKey(
        Batch, on_delete=models.CASCADE, related_name="items", db_index=False
    )
    source = models.TextField()
    params = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)
    # Whole milliseconds, so the counters' duration sums stay exact (no float drift).
    duration_ms = models.PositiveBigIntegerField(null=True, blank=True)
    status = models.CharField(
        max_length=16, choices=ItemStatus.choices, default=ItemStatus.QUEUED
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # Quality flags (batches.flags) of the item's latest completion, written by
    # the complete transition; all False while the item is not done.
    flag_empty = models.BooleanField(default=False, db_default=False)
    flag_short = models.BooleanField(default=False, db_default=False)
    flag_language_mismatch = models.BooleanField(default=False, db_default=False)

    class Meta:
        indexes = [
            models.Index(fields=["batch", "id"], name="item_batch_id"),
            # A batch's items with one flag, in id order (?flag=): few, so small.
            *(
                models.Index(
                    fields=["batch", "id"],
                    name=f"item_{column}",
                    condition=Q(**{column: True}),
                )
                for column in FLAG_COLUMNS.values()
            ),
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
    def flags(self) -> list[str]:
        """Sorted names of the item's quality flags ([] when none)."""
        return flag_names(self)

    @property
    def duration_seconds(self) -> float | None:
        return None if self.duration_ms is None else self.duration_ms / 1000


class BatchCounterQuerySet(models.QuerySet):
    def totals(self) -> dict[str, int]:
        """Sum the shards: item counts per status, plus ``<status>_ms`` durations,
        plus the ``flag_<flag>`` counts of flagged items."""
        columns = (*COUNTER_COLUMNS, *FLAG_COUNTER_COLUMNS)
        sums = self.aggregate(**{c: Sum(c) for c in columns})
        return {c: sums[c] or 0 for c in columns}


class BatchCounter(models.Model):
    """One shard of a batch's per-status item counts.

    Kept in the same transaction as every item status change (the transitions),
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
    # Items in this shard with each quality flag (batches.flags).
    flag_empty = models.IntegerField(default=0, db_default=0)
    flag_short = models.IntegerField(default=0, db_default=0)
    flag_language_mismatch = models.IntegerField(default=0, db_default=0)

    objects = BatchCounterQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "shard"], name="counter_shard_unique"
            )
        ]

    def __str__(self) -> str:
        return f"counters of batch {self.batch_id}, shard {self.shard}"


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

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "minute", "shard"], name="minute_shard_unique"
            )
        ]
        indexes = [models.Index(fields=["minute"], name="minute_time")]

    def __str__(self) -> str:
        return f"batch {self.batch_id} at {self.minute:%H:%M}, shard {self.shard}"
