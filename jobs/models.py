"""Jobs, workers, the lease ledger and the event log: schema and reads.

This module says what the rows are and which combinations are valid (check
constraints), and offers read-only QuerySets (``claimable(now)``,
``expired(now)``...). It never changes a job, an item, a ledger row, a counter
or an event: every such write is a transition in ``jobs.transitions``, which
moves the job, its item, its ledger row and the batch's counters together in
one transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from batches.models import Batch, BatchItem, ItemStatus

from .tokens import TOKEN_PREFIX_LENGTH


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_JOB_STATUSES = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)

# The item status is a pure function of its job's status. This is the only copy of
# that mapping: transitions (both backends), reconciliation, the checker and the
# tests all use it.
ITEM_STATUS_FOR_JOB = {
    JobStatus.QUEUED: ItemStatus.QUEUED,
    JobStatus.LEASED: ItemStatus.TRANSCRIBING,
    JobStatus.COMPLETED: ItemStatus.DONE,
    JobStatus.FAILED: ItemStatus.FAILED,
    JobStatus.CANCELLED: ItemStatus.CANCELLED,
}


def item_status_for(job_status: str) -> str:
    """The item status that agrees with ``job_status``."""
    return ITEM_STATUS_FOR_JOB[JobStatus(job_status)]


def agreeing_item_status() -> Q:
    """A filter on jobs: the job's item has the status that agrees with the job's."""
    q = Q(pk__in=[])
    for job_status, item_status in ITEM_STATUS_FOR_JOB.items():
        q |= Q(status=job_status, item__status=item_status)
    return q


class LeaseEnd(models.TextChoices):
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"
    EXPIRED = "expired"
    FORCED = "forced"


# --- Workers ------------------------------------------------------------------


class Worker(models.Model):
    """A remote transcription worker, authenticated by a bearer token.

    Only the token's SHA-256 is stored; the first characters are kept in clear so
    a token can be found without scanning every worker (``jobs.tokens``).
    """

    # Don't write last_seen on every request: once per this many seconds is enough.
    LAST_SEEN_RESOLUTION = timedelta(seconds=15)

    name = models.CharField(max_length=100, unique=True)
    token_prefix = models.CharField(max_length=TOKEN_PREFIX_LENGTH, db_index=True)
    token_hash = models.CharField(max_length=64)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(null=True, blank=True)

    class Meta:
        permissions = [
            ("disable_worker", "Can disable and re-enable a worker"),
            ("rotate_worker_token", "Can rotate a worker's token"),
        ]

    def __str__(self) -> str:
        return self.name

    # Set by the worker's authentication: the leases it holds right now.
    live_leases: int = 0

    def seen_long_ago(self, now: datetime) -> bool:
        """True when ``last_seen`` is worth writing again (see the resolution)."""
        return (
            self.last_seen is None or now - self.last_seen >= self.LAST_SEEN_RESOLUTION
        )


# --- Jobs ---------------------------------------------------------------------


class JobQuerySet(models.QuerySet):
    """Reads: chain freely, never write."""

    def claimable(self, now: datetime) -> JobQuerySet:
        return self.filter(
            status=JobStatus.QUEUED,
            available_at__lte=now,
            attempts__lt=F("max_attempts"),
        )

    def expired(self, now: datetime) -> JobQuerySet:
        return self.filter(status=JobStatus.LEASED, lease_expires_at__lt=now)

    def for_batch(self, batch: Batch | int) -> JobQuerySet:
        return self.filter(batch=batch)

    def locked(self, *, skip_locked: bool = False) -> JobQuerySet:
        """Lock the jobs and their items for the caller's transaction.

        The item is locked too so that its status is re-read under the lock
        (PostgreSQL re-fetches only the locked rows of a join).
        """
        return self.select_related("item").select_for_update(
            skip_locked=skip_locked, no_key=True, of=("self", "item")
        )


class Job(models.Model):
    """The unit of work for one batch item, and the lease that holds it.

    A retry reuses this row; every attempt is a row in the ``Lease`` ledger.
    """

    item = models.OneToOneField(BatchItem, on_delete=models.CASCADE, related_name="job")
    # Denormalised from the item (never changes) so claims and counters need no join.
    batch = models.ForeignKey(
        Batch, on_delete=models.CASCADE, related_name="jobs", db_index=False
    )
    status = models.CharField(
        max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED
    )
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField()
    # NULL, not "", when not leased: the check constraint below says "none".
    lease_token = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    leased_by = models.ForeignKey(
        Worker,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="current_jobs",
        db_index=False,
    )
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    available_at = models.DateTimeField(default=timezone.now)
    result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        permissions = [
            ("force_reclaim", "Can force-reclaim a leased job"),
            ("requeue_job", "Can queue failed jobs again"),
            ("cancel_job", "Can cancel queued jobs"),
            ("run_reconcile", "Can run reconciliation"),
        ]
        indexes = [
            # Claims: the oldest queued job of one batch, in (created_at, id)
            # order, which the primary key cannot give: so PostgreSQL never walks
            # the primary key past every finished job instead (statements.py).
            models.Index(
                fields=["batch", "created_at", "id"],
                name="job_claim",
                condition=Q(status=JobStatus.QUEUED),
            ),
            # Reclaim: expired leases, soonest first.
            models.Index(
                fields=["lease_expires_at"],
                name="job_lease_expiry",
                condition=Q(status=JobStatus.LEASED),
            ),
            models.Index(fields=["batch", "status"], name="job_batch_status"),
            models.Index(
                fields=["leased_by"],
                name="job_leased_by",
                condition=Q(leased_by__isnull=False),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=JobStatus.values), name="job_status_valid"
            ),
            # A leased job always has a token, an expiry and a holder; any other
            # job has none of them.
            models.CheckConstraint(
                condition=(
                    Q(
                        status=JobStatus.LEASED,
                        lease_token__isnull=False,
                        lease_expires_at__isnull=False,
                        leased_by__isnull=False,
                    )
                    | (
                        ~Q(status=JobStatus.LEASED)
                        & Q(
                            lease_token__isnull=True,
                            lease_expires_at__isnull=True,
                            leased_by__isnull=True,
                        )
                    )
                ),
                name="job_lease_fields_match_status",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1, attempts__lte=F("max_attempts")),
                name="job_attempts_within_max",
            ),
            models.CheckConstraint(
                condition=~Q(status=JobStatus.COMPLETED) | Q(result__isnull=False),
                name="job_completed_has_result",
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.status})"


# --- The lease ledger ---------------------------------------------------------


class Lease(models.Model):
    """One row per claim: who held the job, when, and how the lease ended."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="leases")
    worker = models.ForeignKey(Worker, on_delete=models.PROTECT, related_name="leases")
    token = models.CharField(max_length=64, unique=True)
    attempt = models.PositiveIntegerField()
    claimed_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # NULL while the lease is open (checked together with ended_at).
    end_reason = models.CharField(  # noqa: DJ001
        max_length=16, choices=LeaseEnd.choices, null=True, blank=True
    )
    error = models.TextField(blank=True, default="")

    class Meta:
        indexes = [
            models.Index(fields=["worker", "end_reason"], name="lease_worker_end"),
            # Leases that ended badly, by time (the overview's last hour and day).
            models.Index(
                fields=["end_reason", "ended_at"],
                name="lease_abnormal_end",
                condition=Q(end_reason__in=[LeaseEnd.EXPIRED, LeaseEnd.FORCED]),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["job"],
                condition=Q(ended_at__isnull=True),
                name="lease_one_open_per_job",
            ),
            models.CheckConstraint(
                condition=Q(ended_at__isnull=True, end_reason__isnull=True)
                | Q(ended_at__isnull=False, end_reason__in=LeaseEnd.values),
                name="lease_end_fields_together",
            ),
        ]

    def __str__(self) -> str:
        return f"lease {self.pk} of job {self.job_id} (attempt {self.attempt})"


# --- Event log ----------------------------------------------------------------


class EventQuerySet(models.QuerySet):
    def repairs(self) -> EventQuerySet:
        return self.filter(kind=Event.Kind.REPAIR)


class Event(models.Model):
    """Recall's event log: reconciliation repairs, and operator and admin actions."""

    class Kind(models.TextChoices):
        REPAIR = "repair"
        FORCE_RECLAIMED = "force_reclaimed"
        RETRIED = "retried"
        CANCELLED = "cancelled"
        BATCH_CANCELLED = "batch_cancelled"
        BATCH_PAUSED = "batch_paused"
        BATCH_RESUMED = "batch_resumed"
        BATCH_CHANGED = "batch_changed"

    created_at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=32, choices=Kind.choices)
    job = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    batch = models.ForeignKey(
        Batch, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    message = models.TextField()

    objects = EventQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["kind", "created_at"], name="event_kind_time")]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


# --- Tallies --------------------------------------------------------------------


class Tally(models.Model):
    """A count that only grows: what the transitions did since the beginning.

    Metrics that must survive restarts and agree across processes and nodes
    (expired and forced leases, repairs by kind) are read from here. Each row
    is added to by the transition that does the thing, in its transaction, once
    per chunk, never per job on the hot path.
    """

    name = models.CharField(max_length=64, unique=True)
    count = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}: {self.count}"


class RepairKind(StrEnum):
    """What a repair healed (reconciliation, or a transition healing rows it
    touched). Each is tallied as ``repairs:<kind>``: the metric
    ``recall_reconcile_repairs_total{kind}``."""

    ITEM_DRIFT = "item_drift"
    LEASE_CLOSED = "lease_closed"
    LEASE_RESTORED = "lease_restored"
    LEDGER_ROW_WRITTEN = "ledger_row_written"
    LEDGER_ROW_CLOSED_EARLY = "ledger_row_closed_early"
    EXHAUSTED_FAILED = "exhausted_failed"
    BATCH_REOPENED = "batch_reopened"
    COUNTERS_FIXED = "counters_fixed"

    @property
    def tally(self) -> str:
        return f"repairs:{self.value}"


# --- Sweeper state ------------------------------------------------------------


class SweepState(models.Model):
    """A single row: the sweep's lock and what its last pass did.

    The lock is itself a lease (``locked_until``, on the database's clock), so a
    sweeper killed mid-pass cannot block the next one for long. /readyz reads
    ``last_finished_at``. ``jobs.sweep`` owns its writes.
    """

    SINGLETON = 1

    locked_until = models.DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=100, blank=True, default="")
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_report = models.JSONField(default=dict, blank=True)
    scan_cursor = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"sweep state (last finished {self.last_finished_at})"
