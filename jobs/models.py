"""Jobs, workers, the lease ledger and the event log: schema and reads.

This module says what the rows are and which combinations are valid (check
constraints), and offers read-only QuerySets (``claimable(now)``,
``expired(now)``...). It never changes a job, an item, a ledger row, a counter
or an event: every such write is a transition in ``jobs.transitions``, which
moves the job, its item, its ledger row and the batch's counters together in
one transaction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import models
from django.db.models import F, Func, Min, Q, Value
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from batches.json_limits import StoredJSONDecoder
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

    # Don't write last_seen on every request: once a minute is enough. An idle
    # worker polls every 15 to 30 s; writing on each poll was a quarter of an
    # idle fleet's server CPU (BENCHMARKS.md, row 14).
    LAST_SEEN_RESOLUTION = timedelta(seconds=60)

    name = models.CharField(max_length=100, unique=True)
    token_prefix = models.CharField(max_length=TOKEN_PREFIX_LENGTH, db_index=True)
    token_hash = models.CharField(max_length=64)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(null=True, blank=True)
    # The labels the worker declared with its latest claim (``batches.labels``).
    labels = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)

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


class RequiresMet(Func):
    """True when a job's own requirement (``Job.requires``, a flat JSON object
    of label strings, ``{}`` for none: the common case) is satisfied by
    ``labels``: ``batches.labels.satisfies`` in SQL, so a claim filters the
    jobs it may take in the query. PostgreSQL: jsonb containment (``{}`` is
    contained in anything). SQLite: no key of the requirement whose value
    the labels lack (``json_each``; a key is quoted in the JSON path, so a
    dot in it is no path step)."""

    output_field = models.BooleanField()
    conditional = True

    def __init__(self, labels: Mapping[str, str], column: str = "requires") -> None:
        super().__init__(F(column), Value(json.dumps(dict(labels))))

    def as_sql(  # type: ignore[override]
        self, compiler: Any, connection: Any, **extra: Any
    ) -> tuple[str, tuple[Any, ...]]:
        column, labels = self.get_source_expressions()
        column_sql, column_params = compiler.compile(column)
        labels_sql, labels_params = compiler.compile(labels)
        if connection.vendor == "postgresql":
            return (
                f"({column_sql} <@ ({labels_sql})::jsonb)",
                (*column_params, *labels_params),
            )
        return (
            f"NOT EXISTS (SELECT 1 FROM json_each({column_sql}) AS need WHERE "
            f"json_extract({labels_sql}, '$.\"' || need.key || '\"') "
            f"IS NOT need.value)",
            (*column_params, *labels_params),
        )


class JobQuerySet(models.QuerySet):
    """Reads: chain freely, never write."""

    def claimable(self, now: datetime | Now) -> JobQuerySet:
        return self.filter(
            status=JobStatus.QUEUED,
            available_at__lte=now,
            attempts__lt=F("max_attempts"),
        )

    def serving(self, labels: Mapping[str, str]) -> JobQuerySet:
        """The jobs whose own requirement (a re-run's, ``Job.requires``)
        ``labels`` satisfy; their batch's requirement is checked apart."""
        return self.filter(RequiresMet(labels))

    def expired(self, now: datetime | Now) -> JobQuerySet:
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
    result = models.JSONField(null=True, blank=True, decoder=StoredJSONDecoder)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The worker labels this job needs on top of its batch's ``requires``: set
    # by a re-run (``transitions.rerun``) for the run it starts, {} otherwise
    # (a claim checks it with ``RequiresMet``).
    requires = models.JSONField(
        default=dict,
        db_default=Value({}, output_field=models.JSONField()),
        blank=True,
        decoder=StoredJSONDecoder,
    )
    # Which run of the job this is: 1, then one more per re-run (``JobRun``
    # keeps each earlier run).
    run = models.PositiveIntegerField(default=1, db_default=1)

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


# --- Earlier runs of a job -------------------------------------------------------


class JobRun(models.Model):
    """One earlier run of a job, kept when the job was re-run
    (``transitions.rerun``, in its transaction): how it ended, its result and
    quality flags, who ran it, and the requirement it had. The job's current
    run is the job itself (``Job.run``); its ledger rows (``Lease``) with an
    id up to ``last_lease_id`` belong to this run or an earlier one."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=JobStatus.choices)
    result = models.JSONField(null=True, blank=True, decoder=StoredJSONDecoder)
    error = models.TextField(blank=True, default="")
    flags = models.JSONField(default=list, blank=True, decoder=StoredJSONDecoder)
    attempts = models.PositiveIntegerField(default=0)
    requires = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)
    worker = models.ForeignKey(
        "Worker",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    finished_at = models.DateTimeField(null=True, blank=True)
    last_lease_id = models.BigIntegerField(null=True, blank=True)
    rerun_at = models.DateTimeField()
    rerun_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="job_run_unique")
        ]

    def __str__(self) -> str:
        return f"run {self.number} of job {self.job_id} ({self.status})"

    @property
    def item_status(self) -> str:
        """How the run left the item (done, failed)."""
        return item_status_for(self.status)


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
        RERUN = "rerun", "Re-run"

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
    ``last_finished_at``. ``engine.sweep`` owns its writes.
    """

    SINGLETON = 1

    locked_until = models.DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=100, blank=True, default="")
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_report = models.JSONField(default=dict, blank=True, decoder=StoredJSONDecoder)
    scan_cursor = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"sweep state (last finished {self.last_finished_at})"


# --- Webhooks: endpoints, the outbox, deliveries and their attempts -------------


class WebhookEventType(models.TextChoices):
    BATCH_FINISHED = "batch.finished"
    ITEM_FAILED = "item.failed"
    TEST = "webhook.test"  # sent from the admin to one endpoint, on request


# What an endpoint can subscribe to, and what it gets when it does not say.
SUBSCRIBABLE_EVENTS = (WebhookEventType.BATCH_FINISHED, WebhookEventType.ITEM_FAILED)
DEFAULT_EVENTS = (WebhookEventType.BATCH_FINISHED,)


def url_origin(url: str) -> str:
    """A URL's scheme, host and port, nothing else: how an endpoint is shown to
    people without ``jobs.view_webhookendpoint``. Receivers often take their
    credentials in the path or the query string (``/hooks/T0K3N``,
    ``?key=...``), so the rest of the URL is as secret as the signing key."""
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme, parts.hostname, parts.port
    except ValueError:
        scheme, host, port = "", None, None
    if not host or scheme not in ("http", "https"):
        return "(a URL that cannot be shown)"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" + (f":{port}" if port else "")


class WebhookEndpointQuerySet(models.QuerySet["WebhookEndpoint"]):
    def subscribed_to(self, event_type: str) -> list[WebhookEndpoint]:
        """The active endpoints that take ``event_type`` (endpoints are few: the
        subscription list is filtered here rather than by a JSON query)."""
        return [e for e in self.filter(is_active=True) if e.subscribes(event_type)]


class WebhookEndpoint(models.Model):
    """A URL that is sent Recall's events, signed with its own secret.

    The secret is stored encrypted (``jobs.webhook_keys``): it must be usable
    to sign, so a hash would not do. During a rotation the previous secret
    stays valid (signed with too) until ``previous_secret_expires_at``.
    """

    url = models.CharField(max_length=2000)
    # Comma-separated event types (SUBSCRIBABLE_EVENTS).
    events = models.CharField(max_length=200, default=",".join(DEFAULT_EVENTS))
    description = models.CharField(max_length=200, blank=True, default="")
    is_active = models.BooleanField(default=True)
    disabled_reason = models.TextField(blank=True, default="")
    secret_encrypted = models.TextField()
    previous_secret_encrypted = models.TextField(blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = WebhookEndpointQuerySet.as_manager()

    class Meta:
        permissions = [
            ("rotate_webhook_secret", "Can rotate a webhook endpoint's secret"),
            ("send_test_webhook", "Can send a test event to a webhook endpoint"),
        ]

    def __str__(self) -> str:
        # Only the origin: this is what the admin's inlines, links and log
        # show, also to people who may not see the endpoint (see url_origin).
        return f"endpoint {self.pk}: {self.origin}"

    @property
    def origin(self) -> str:
        """The URL's scheme, host and port, without its path and query."""
        return url_origin(self.url)

    def event_types(self) -> list[str]:
        return [e for e in self.events.split(",") if e]

    def subscribes(self, event_type: str) -> bool:
        return event_type in self.event_types()


class WebhookEventQuerySet(models.QuerySet):
    def for_batch(self, batch: Batch | int) -> WebhookEventQuerySet:
        return self.filter(batch=batch)


class WebhookEvent(models.Model):
    """The outbox: one row per event, written by the transition that caused it,
    in its transaction. ``body`` is the exact JSON sent on every attempt, and
    ``webhook_id`` the ``webhook-id`` header (the receiver's idempotency key).

    A batch's n-th finish is the ``batch.finished`` event of generation n
    (``Batch.finishes``); a unique constraint makes a second one impossible.
    """

    webhook_id = models.CharField(max_length=64, unique=True)
    type = models.CharField(max_length=32, choices=WebhookEventType.choices)
    batch = models.ForeignKey(
        Batch,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="webhook_events",
    )
    generation = models.PositiveIntegerField(null=True, blank=True)
    item = models.ForeignKey(
        BatchItem,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
    )
    created_at = models.DateTimeField()
    body = models.TextField()

    objects = WebhookEventQuerySet.as_manager()

    class Meta:
        permissions = [("redeliver_webhookevent", "Can redeliver webhook events")]
        indexes = [
            models.Index(fields=["batch", "id"], name="webhook_event_batch"),
            # Deleting items (a purge) checks that no event points at them.
            models.Index(
                fields=["item"],
                name="webhook_event_item",
                condition=Q(item__isnull=False),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(type__in=WebhookEventType.values),
                name="webhook_event_type_valid",
            ),
            models.CheckConstraint(
                condition=~Q(type=WebhookEventType.BATCH_FINISHED)
                | Q(batch__isnull=False, generation__isnull=False),
                name="webhook_finish_has_generation",
            ),
            models.UniqueConstraint(
                fields=["batch", "generation"],
                condition=Q(type=WebhookEventType.BATCH_FINISHED),
                name="webhook_one_event_per_finish",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.webhook_id}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # due at next_attempt_at (or in flight, under a lease)
    DELIVERED = "delivered"  # a 2xx answered
    FAILED = "failed"  # gave up: out of attempts, or the endpoint answered 410


class WebhookDeliveryQuerySet(models.QuerySet):
    """Reads: chain freely, never write."""

    def due(self, now: datetime) -> WebhookDeliveryQuerySet:
        """Pending deliveries to active endpoints whose next attempt is due and
        not in flight (or in flight under a lease that ran out: its process
        died)."""
        return self.filter(
            status=DeliveryStatus.PENDING,
            next_attempt_at__lte=now,
            endpoint__is_active=True,
        ).filter(Q(leased_until__isnull=True) | Q(leased_until__lt=now))

    def next_due_at(self) -> datetime | None:
        """When the next attempt to an active endpoint falls due (an attempt in
        flight: when its lease runs out), or None if nothing is pending."""
        due: datetime | None = self.filter(
            status=DeliveryStatus.PENDING, endpoint__is_active=True
        ).aggregate(at=Min(Coalesce("leased_until", "next_attempt_at")))["at"]
        return due


class WebhookDelivery(models.Model):
    """One event for one endpoint: its state, and the lease of the attempt in
    flight (claimed by compare-and-set, so two clusters never send the same
    attempt at once; a killed cluster's lease runs out and the attempt is
    made again, with the same ``webhook-id``)."""

    event = models.ForeignKey(
        WebhookEvent, on_delete=models.CASCADE, related_name="deliveries"
    )
    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    status = models.CharField(
        max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_token = models.CharField(  # noqa: DJ001 (NULL: no attempt in flight)
        max_length=64, null=True, blank=True
    )
    leased_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")

    objects = WebhookDeliveryQuerySet.as_manager()

    class Meta:
        verbose_name_plural = "webhook deliveries"
        indexes = [
            # The dispatcher's question: what is due next?
            models.Index(
                fields=["next_attempt_at"],
                name="webhook_delivery_due",
                condition=Q(status=DeliveryStatus.PENDING),
            ),
            models.Index(fields=["endpoint", "status"], name="webhook_delivery_ep"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["event", "endpoint"], name="webhook_one_delivery_per_endpoint"
            ),
            models.CheckConstraint(
                condition=Q(status__in=DeliveryStatus.values),
                name="webhook_delivery_status_valid",
            ),
            models.CheckConstraint(
                condition=Q(
                    status=DeliveryStatus.PENDING, next_attempt_at__isnull=False
                )
                | (
                    ~Q(status=DeliveryStatus.PENDING)
                    & Q(
                        next_attempt_at__isnull=True,
                        lease_token__isnull=True,
                        finished_at__isnull=False,
                    )
                ),
                name="webhook_delivery_fields_match_status",
            ),
            models.CheckConstraint(
                condition=Q(lease_token__isnull=True, leased_until__isnull=True)
                | Q(lease_token__isnull=False, leased_until__isnull=False),
                name="webhook_delivery_lease_fields_together",
            ),
        ]

    def __str__(self) -> str:
        return f"delivery {self.pk} of event {self.event_id} to {self.endpoint_id}"

    def summary(self) -> str:
        """One line for people: "delivered 12:04, 3 attempts"."""
        tries = f"{self.attempts} attempt{'s' * (self.attempts != 1)}"
        if self.status == DeliveryStatus.DELIVERED and self.finished_at:
            return f"delivered {_clock(self.finished_at)}, {tries}"
        if self.status == DeliveryStatus.FAILED and self.finished_at:
            return (
                f"gave up {_clock(self.finished_at)} after {tries}: {self.last_error}"
            )
        if self.lease_token is not None:
            return f"sending now (attempt {self.attempts})"
        if self.attempts == 0:
            return "pending: first attempt due now"
        due = _clock(self.next_attempt_at) if self.next_attempt_at else "?"
        return f"retrying at {due}; {tries} so far, last: {self.last_error}"


def _clock(moment: datetime) -> str:
    return timezone.localtime(moment).strftime("%H:%M")


class WebhookAttempt(models.Model):
    """One HTTP attempt of a delivery: when, what came back, how long it took.

    Written when the attempt is claimed; an attempt whose process was killed
    keeps ``finished_at`` empty (and is marked interrupted when the delivery
    is claimed again)."""

    delivery = models.ForeignKey(
        WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log"
    )
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response_excerpt = models.TextField(blank=True, default="")
    error = models.TextField(blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["delivery", "number"], name="webhook_attempt_number_unique"
            )
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of delivery {self.delivery_id}"


class WebhookDispatch(models.Model):
    """A single row: the lease of the one dispatcher polling for due retries
    (``engine.webhooks.delivery``), on the database's clock, so a killed one does not
    block the next for long; and the token of the successor a dispatcher
    queued when its time ran out (``handover``), which only that successor
    may take (or anyone, once it is stale)."""

    SINGLETON = 1

    locked_until = models.DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=100, blank=True, default="")
    handover = models.CharField(max_length=64, blank=True, default="")
    handover_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"webhook dispatcher (locked until {self.locked_until})"
