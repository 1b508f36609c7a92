"""Jobs, their leases, and every state transition Recall makes.

This module is the one place where job, item and lease-ledger rows change state.
Each transition runs in one transaction and moves, together:

* the job (``Job.status`` and its lease fields),
* its batch item (``BatchItem.status`` = ``item_status_for(job.status)``) and the
  batch's progress counters (``batches.models.move_items``),
* its lease-ledger row (``Lease``): opened by a claim, closed by everything else.

Rows are changed under a row lock taken inside the transaction
(``select_for_update``; on SQLite every transaction is ``BEGIN IMMEDIATE``, which
serialises writers) or by compare-and-set UPDATEs, never from a stale in-memory
copy. Time is a single ``now`` passed in (tests) or read once per call.

Row-level transitions are methods on ``Job``; table-level ones (claim, reclaim,
batch cancel, retry, and the admin's bulk cancel and force reclaim) live on
``JobQuerySet``. Reconciliation (``reconcile.py``)
decides what to heal and calls the repair methods at the bottom of ``Job``.

On PostgreSQL the clean case of the hot transitions, a claim's lease, a
completion and a chunk of reclaimed leases, is one hand-written statement each
(``pgsql.py``) instead of the ORM's many: the same rows, the same transaction,
far less CPU.
Whatever is not the clean case (drifted rows, a replayed completion, a lost
lease) falls through to the ORM code below, which is the reference.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, models, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from batches.models import Batch, BatchItem, ItemMove, ItemStatus, move_items

from .exceptions import LeaseLost

log = logging.getLogger("recall.jobs")

MAX_ERROR_CHARS = 10_000
# What an expired lease leaves in the ledger and, on the last attempt, the job
# ({n}: its max attempts).
LEASE_EXPIRED = "The lease expired: the worker stopped heartbeating."
GAVE_UP = (
    "Gave up: the lease expired on the last allowed attempt ({n} of {n}). If this "
    "repeats after a retry, the audio may be crashing workers."
)
# How many open batches one claim looks at before it reports "nothing claimable".
CLAIM_BATCH_CANDIDATES = 50


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_JOB_STATUSES = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)

# The item status is a pure function of its job's status. This is the only copy of
# that mapping: transitions, reconciliation, the checker and the tests all use it.
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


def truncate_error(error: str) -> str:
    """Errors are diagnostics: keep a long one, cut to MAX_ERROR_CHARS."""
    if len(error) <= MAX_ERROR_CHARS:
        return error
    marker = "\n[… truncated]"
    return error[: MAX_ERROR_CHARS - len(marker)] + marker


def retry_delay(attempts: int) -> timedelta:
    """Exponential backoff after a retryable failure of attempt number ``attempts``."""
    base = settings.RECALL_RETRY_BACKOFF_SECONDS
    seconds = min(
        base * 2 ** max(attempts - 1, 0), settings.RECALL_RETRY_BACKOFF_MAX_SECONDS
    )
    return timedelta(seconds=seconds)


def lease_duration() -> timedelta:
    return timedelta(seconds=settings.RECALL_LEASE_SECONDS)


# A caller's own record of a bulk transition (e.g. the admin's LogEntry rows): the
# table-level transitions call it inside each transaction with the jobs that moved,
# so the record commits or rolls back together with the change.
Audit = Callable[[Sequence["Job"]], None]


def heartbeat_interval() -> int:
    """Seconds between heartbeats we ask of workers: three chances per lease."""
    return max(1, settings.RECALL_LEASE_SECONDS // 3)


# --- Workers ------------------------------------------------------------------

TOKEN_PREFIX_LENGTH = 8


def new_lease_token() -> str:
    return secrets.token_urlsafe(24)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class WorkerQuerySet(models.QuerySet):
    def create_with_token(self, name: str) -> tuple[Worker, str]:
        """Create a worker; the token is returned here and never stored in clear."""
        worker = Worker(name=name)
        token = worker.set_new_token()
        worker.save()
        return worker, token

    def authenticate(self, token: str) -> Worker | None:
        """The worker holding ``token`` (active or not), or None."""
        if not (TOKEN_PREFIX_LENGTH < len(token) <= 256):
            return None
        digest, prefix = hash_token(token), token[:TOKEN_PREFIX_LENGTH]
        if connection.vendor == "postgresql" and not self.query.where:
            from . import pgsql

            candidates = pgsql.workers_with_prefix(prefix)  # every API request
        else:
            candidates = self.filter(token_prefix=prefix)
        for worker in candidates:
            if hmac.compare_digest(worker.token_hash, digest):
                return worker
        return None


class Worker(models.Model):
    """A remote transcription worker, authenticated by a bearer token.

    Only the token's SHA-256 is stored; the first characters are kept in clear so
    a token can be found without scanning every worker.
    """

    # Don't write last_seen on every request: once per this many seconds is enough.
    LAST_SEEN_RESOLUTION = timedelta(seconds=15)

    name = models.CharField(max_length=100, unique=True)
    token_prefix = models.CharField(max_length=TOKEN_PREFIX_LENGTH, db_index=True)
    token_hash = models.CharField(max_length=64)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(null=True, blank=True)

    objects = WorkerQuerySet.as_manager()

    class Meta:
        permissions = [
            ("disable_worker", "Can disable and re-enable a worker"),
            ("rotate_worker_token", "Can rotate a worker's token"),
        ]

    def __str__(self) -> str:
        return self.name

    def set_new_token(self) -> str:
        token = secrets.token_urlsafe(32)
        self.token_prefix = token[:TOKEN_PREFIX_LENGTH]
        self.token_hash = hash_token(token)
        return token

    def rotate_token(self) -> str:
        """Issue a new token; the old one stops working as soon as this commits."""
        token = self.set_new_token()
        self.save(update_fields=["token_prefix", "token_hash"])
        return token

    def set_active(self, active: bool) -> bool:
        """Disable or re-enable the worker; False if it already was so.

        A disabled worker's requests get 403 at once. Its live lease is left to
        run out (it can no longer heartbeat), then reclaimed like any other.
        """
        changed = Worker.objects.filter(pk=self.pk, is_active=not active).update(
            is_active=active
        )
        self.is_active = active
        return bool(changed)

    def touch(self, now: datetime) -> None:
        if self.last_seen is None or now - self.last_seen >= self.LAST_SEEN_RESOLUTION:
            Worker.objects.filter(pk=self.pk).update(last_seen=now)
            self.last_seen = now


# --- Jobs ---------------------------------------------------------------------


class JobQuerySet(models.QuerySet):
    # Reads: chain freely, never write.

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
        """Lock the jobs and their items for this transaction.

        The item is locked too so that its status is re-read under the lock
        (PostgreSQL re-fetches only the locked rows of a join).
        """
        return self.select_related("item").select_for_update(
            skip_locked=skip_locked, no_key=True, of=("self", "item")
        )

    # Table-level transitions.

    def claim_next(self, worker: Worker, *, now: datetime | None = None) -> Job | None:
        """Lease the next claimable job to ``worker``, or return None.

        First reclaims expired leases and heals what can be healed cheaply, so an
        expired lease is never left standing while new work is handed out. Then
        takes, by batch priority and age, the oldest claimable job of the first
        open batch that has one, skipping rows other claims hold (SKIP LOCKED).
        """
        from .reconcile import CANCEL_GRACE, reconcile_on_claim

        now = now or timezone.now()
        postgres = connection.vendor == "postgresql"
        if postgres:
            from . import pgsql

            # Most claims: nothing to do first, and the first batch with work has
            # a job free, or no batch has work. One statement (atomic by
            # itself), or nothing written.
            job, written = pgsql.claim_first(
                worker,
                token=new_lease_token(),
                now=now,
                cancelled_before=now - CANCEL_GRACE,
            )
            if written:
                return job
            # The long way: the chores and the candidates in one probe (each
            # chore probes again itself; on SQLite that is all they do).
            plan = (now, now - CANCEL_GRACE, CLAIM_BATCH_CANDIDATES)
            expired, cancelling, candidates = pgsql.claim_plan(*plan)
        else:
            expired = cancelling = True
        if expired:
            Job.objects.reclaim_expired(
                now=now, limit=settings.RECALL_RECLAIM_ON_CLAIM, wait=False
            )
        if cancelling:
            reconcile_on_claim(now=now)
        if not postgres:
            candidates = self._candidate_batches(now)
        elif expired or cancelling:
            candidates = pgsql.claim_plan(*plan)[2]  # the chores changed them
        for batch_id in candidates:
            job = self._claim_in_batch(batch_id, worker, now)
            if job is not None:
                return job
        return None

    def _candidate_batches(self, now: datetime):
        """Open batches with a claimable job, by priority (``pgsql.CLAIM_PLAN``
        on PostgreSQL)."""
        return (
            Batch.objects.open()
            .filter(Exists(Job.objects.claimable(now).filter(batch=OuterRef("pk"))))
            .order_by("-priority", "pk")
            .values_list("pk", flat=True)[:CLAIM_BATCH_CANDIDATES]
        )

    def _claim_in_batch(
        self, batch_id: int, worker: Worker, now: datetime
    ) -> Job | None:
        if connection.vendor == "postgresql":
            from . import pgsql

            # One statement, so atomic by itself. If the rows it found disagree it
            # wrote nothing, and the code below (which heals them) runs instead.
            job, written = pgsql.claim(
                batch_id, worker, token=new_lease_token(), now=now
            )
            if written:
                return job
        for attempt in (1, 2):
            job = None
            try:
                with transaction.atomic():
                    job = (
                        Job.objects.claimable(now)
                        .filter(
                            batch_id=batch_id,
                            batch__paused_at__isnull=True,
                            batch__cancelled_at__isnull=True,
                        )
                        .select_related("item", "batch")
                        .select_for_update(
                            skip_locked=True, no_key=True, of=("self", "item")
                        )
                        .order_by("created_at", "pk")
                        .first()
                    )
                    if job is not None:
                        job._start_lease(worker, now)
                    return job
            except IntegrityError:
                # Only an open ledger row left behind for a queued job can make the
                # lease insert fail (one open row per job is a constraint). Close
                # it as a repair and try once more.
                if job is None or attempt == 2:
                    raise
                job.close_stray_leases(now=now)
        return None

    def reclaim_expired(
        self,
        *,
        now: datetime | None = None,
        limit: int | None = None,
        wait: bool = True,
    ) -> dict:
        """Reclaim expired leases in bounded transactions; return what happened.

        Each chunk locks its jobs with SKIP LOCKED, so concurrent sweeps and claims
        share the work and never reclaim the same lease twice. A job that has used
        its last attempt is failed instead of queued (a poison file must not crash
        workers forever). On PostgreSQL one process reclaims at a time;
        ``wait=False`` (a claim) returns at once if another one is at it.
        """
        now = now or timezone.now()
        report = {"requeued": 0, "failed": 0}
        if not self.expired(now).exists():  # cheap probe, no transaction
            return report
        # On PostgreSQL, a chunk of the whole table is one statement (pgsql.py);
        # the rows it finds disagreeing are left to the ORM chunk below.
        in_sql = connection.vendor == "postgresql" and not self.query.where
        chunk = settings.RECALL_CHUNK_SIZE
        remaining = limit
        while remaining is None or remaining > 0:
            size = chunk if remaining is None else min(chunk, remaining)
            if in_sql:
                from . import pgsql

                looked, unclean, requeued, failed = pgsql.reclaim_chunk(
                    now, size, expired=LEASE_EXPIRED, gave_up=GAVE_UP, wait=wait
                )
                if unclean:
                    healed = Job.objects.filter(pk__in=unclean)._reclaim_chunk(
                        now, len(unclean)
                    )
                    requeued, failed = requeued + healed[1], failed + healed[2]
            else:
                looked, requeued, failed = self._reclaim_chunk(now, size)
            report["requeued"] += requeued
            report["failed"] += failed
            if remaining is not None:
                remaining -= looked
            if looked < size:
                break
        if report["requeued"] or report["failed"]:
            log.info(
                "reclaimed expired leases: %(requeued)d requeued, %(failed)d failed",
                report,
            )
        return report

    def _reclaim_chunk(self, now: datetime, size: int) -> tuple[int, int, int]:
        """One transaction of ``reclaim_expired``: (jobs, requeued, failed)."""
        with transaction.atomic():
            jobs = list(
                self.expired(now)
                .locked(skip_locked=True)
                .order_by("lease_expires_at")[:size]
            )
            requeue = [j for j in jobs if j.attempts < j.max_attempts]
            give_up = [j for j in jobs if j.attempts >= j.max_attempts]
            Job._move(
                requeue,
                to=JobStatus.QUEUED,
                now=now,
                lease_end=LeaseEnd.EXPIRED,
                error=LEASE_EXPIRED,
            )
            for max_attempts, group in _group_by(give_up, "max_attempts").items():
                message = GAVE_UP.replace("{n}", str(max_attempts))
                Job._move(
                    group,
                    to=JobStatus.FAILED,
                    now=now,
                    lease_end=LeaseEnd.EXPIRED,
                    error=message,
                    last_error=message,
                )
        return len(jobs), len(requeue), len(give_up)

    def cancel_batch(
        self,
        batch: Batch,
        *,
        now: datetime | None = None,
        actor=None,
        time_limit: float | None = None,
    ) -> int:
        """Cancel a batch: its queued and in-flight jobs become cancelled.

        The batch is marked cancelled first (claims skip it from then on), then
        its jobs are cancelled in bounded transactions. In-flight leases end at
        once (ledger reason ``forced``); their workers get 409 on the next call.
        After ``time_limit`` seconds no new chunk is started (a web request must
        answer in time); reconciliation finishes the rest, as it does when the
        process dies part-way. Returns how many jobs this call cancelled.
        """
        now = now or timezone.now()
        deadline = None if time_limit is None else time.monotonic() + time_limit
        with transaction.atomic():
            marked = Batch.objects.filter(
                pk=batch.pk, cancelled_at__isnull=True
            ).update(cancelled_at=now)
            if marked:
                Event.objects.create(
                    kind=Event.Kind.BATCH_CANCELLED,
                    batch_id=batch.pk,
                    actor=actor,
                    message="Batch cancelled.",
                )
        total = 0
        for wait in (False, True):  # then rows another transaction held a moment ago
            while deadline is None or time.monotonic() < deadline:
                n = self.cancel_batch_chunk(batch.pk, now=now, wait=wait)
                total += n
                if not n:
                    break
        # Mark it finished now, so claims stop checking it for an unfinished cancel.
        Batch.objects.filter(pk=batch.pk).settle(now=now)
        return total

    def cancel_batch_chunk(
        self, batch_id: int, *, now: datetime, wait: bool = False
    ) -> int:
        """Cancel up to one chunk of a cancelled batch's unfinished jobs."""
        with transaction.atomic():
            jobs = list(
                Job.objects.filter(
                    batch_id=batch_id,
                    batch__cancelled_at__isnull=False,
                    status__in=[JobStatus.QUEUED, JobStatus.LEASED],
                )
                .locked(skip_locked=not wait)
                .order_by("pk")[: settings.RECALL_CHUNK_SIZE]
            )
            groups = _group_by(jobs, "status")
            Job._move(groups.get(JobStatus.QUEUED, []), to=JobStatus.CANCELLED, now=now)
            Job._move(
                groups.get(JobStatus.LEASED, []),
                to=JobStatus.CANCELLED,
                now=now,
                lease_end=LeaseEnd.FORCED,
                error="The batch was cancelled.",
            )
        return len(jobs)

    def retry_failed(
        self, *, now: datetime | None = None, actor=None, audit: Audit | None = None
    ) -> int:
        """Queue the failed jobs of this queryset again, with fresh attempts.

        Works in bounded transactions; each reopens the batches it touches so
        claims find them again. Jobs of cancelled batches stay failed. Returns
        how many jobs were queued.
        """
        now = now or timezone.now()

        def retry(jobs: list[Job]) -> None:
            Batch.objects.filter(pk__in={j.batch_id for j in jobs}).update(
                finished_at=None
            )
            Job._move(jobs, to=JobStatus.QUEUED, now=now, attempts=0)
            Event.record_each(
                jobs, Event.Kind.RETRIED, "Queued again with fresh attempts.", actor
            )

        return self.filter(batch__cancelled_at__isnull=True)._in_chunks(
            JobStatus.FAILED, retry, audit
        )

    def cancel_queued(
        self, *, now: datetime | None = None, actor=None, audit: Audit | None = None
    ) -> int:
        """Cancel the queued jobs of this queryset, in bounded transactions.

        Each chunk locks its jobs with SKIP LOCKED: a job a claim holds right now
        is being leased, so it is no longer queued and is left alone. Jobs in any
        other status are left alone too. Returns how many jobs were cancelled.
        """
        now = now or timezone.now()

        def cancel(jobs: list[Job]) -> None:
            Job._move(jobs, to=JobStatus.CANCELLED, now=now)
            Event.record_each(jobs, Event.Kind.CANCELLED, "Job cancelled.", actor)

        return self._in_chunks(JobStatus.QUEUED, cancel, audit)

    def _in_chunks(
        self, status: str, change: Callable[[list[Job]], None], audit: Audit | None
    ) -> int:
        """Apply ``change`` to this queryset's jobs in ``status``, one locked chunk
        per transaction (keyset on id, SKIP LOCKED: rows a transition holds now
        are skipped); ``audit`` runs in the same transaction. Returns how many."""
        total, after = 0, 0
        while True:
            with transaction.atomic():
                jobs = list(
                    self.filter(status=status, pk__gt=after)
                    .locked(skip_locked=True)
                    .order_by("pk")[: settings.RECALL_CHUNK_SIZE]
                )
                if not jobs:
                    return total
                change(jobs)
                if audit is not None:
                    audit(jobs)
            total += len(jobs)
            after = jobs[-1].pk

    def force_reclaim(
        self, *, now: datetime | None = None, actor=None, audit: Audit | None = None
    ) -> int:
        """End the live leases of this queryset's leased jobs, each job in a
        transaction of its own (``Job.force_reclaim``), so a large selection
        never holds many locks at once. Jobs that are not leased (any more) are
        skipped. Returns how many leases were ended.
        """
        now = now or timezone.now()
        total, after = 0, 0
        leased = self.filter(status=JobStatus.LEASED).order_by("pk")
        while ids := list(
            leased.filter(pk__gt=after).values_list("pk", flat=True)[
                : settings.RECALL_CHUNK_SIZE
            ]
        ):
            for pk in ids:
                job = Job(pk=pk)
                with transaction.atomic():
                    reclaimed = job.force_reclaim(actor=actor, now=now)
                    if reclaimed and audit is not None:
                        audit([job])
                total += reclaimed
            after = ids[-1]
        return total


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
            # the primary key past every finished job instead (see pgsql.py).
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

    # --- Worker transitions -------------------------------------------------------
    # Each checks the caller's lease under a row lock, raises LeaseLost (changing
    # nothing) if it is not live, and otherwise moves job, item and ledger together.
    # A lease stays live until it is reclaimed: expiry only makes it reclaimable.

    def heartbeat(
        self, lease_token: str, *, worker: Worker, now: datetime | None = None
    ) -> datetime:
        """Extend the lease; return its new expiry."""
        now = now or timezone.now()
        expires = now + lease_duration()
        with transaction.atomic():
            extended = Job.objects.filter(
                pk=self.pk,
                status=JobStatus.LEASED,
                lease_token=lease_token,
                leased_by=worker,
            ).update(lease_expires_at=expires, heartbeat_at=now, updated_at=now)
            if not extended:
                raise LeaseLost(self._lost_detail())
            Lease.objects.filter(token=lease_token, ended_at__isnull=True).update(
                heartbeat_at=now, expires_at=expires
            )
        self.lease_expires_at, self.heartbeat_at = expires, now
        return expires

    def complete(
        self,
        lease_token: str,
        *,
        worker: Worker,
        result: dict,
        now: datetime | None = None,
    ) -> None:
        """Store the result and finish the job. Replaying the call with the token
        that completed it succeeds again (the worker may have lost the response)."""
        now = now or timezone.now()
        if connection.vendor == "postgresql":
            from . import pgsql

            # One statement, so atomic by itself; unless the lease is live and its
            # rows agree it writes nothing, and the code below decides.
            if pgsql.complete(self.pk, lease_token, worker, result=result, now=now):
                self._completed(result, now)
                return
        with transaction.atomic():
            job = self._lock_lease(lease_token, worker)
            if job is None:
                if Lease.objects.filter(
                    job_id=self.pk,
                    token=lease_token,
                    worker=worker,
                    end_reason=LeaseEnd.COMPLETED,
                ).exists():
                    return
                raise LeaseLost(self._lost_detail())
            Job._move(
                [job],
                to=JobStatus.COMPLETED,
                now=now,
                lease_end=LeaseEnd.COMPLETED,
                result=result,
            )
        self._copy_from(job)

    def fail(
        self,
        lease_token: str,
        *,
        worker: Worker,
        error: str,
        retryable: bool = True,
        now: datetime | None = None,
    ) -> str:
        """Record a failed attempt. Retry later (exponential backoff) if the error is
        retryable and attempts remain, else fail for good. Returns the new status."""
        now = now or timezone.now()
        error = truncate_error(error)
        with transaction.atomic():
            job = self._lock_lease(lease_token, worker)
            if job is None:
                raise LeaseLost(self._lost_detail())
            if retryable and job.attempts < job.max_attempts:
                Job._move(
                    [job],
                    to=JobStatus.QUEUED,
                    now=now,
                    lease_end=LeaseEnd.FAILED,
                    error=error,
                    last_error=error,
                    available_at=now + retry_delay(job.attempts),
                )
            else:
                Job._move(
                    [job],
                    to=JobStatus.FAILED,
                    now=now,
                    lease_end=LeaseEnd.FAILED,
                    error=error,
                    last_error=error,
                )
        self._copy_from(job)
        return job.status

    def release(
        self, lease_token: str, *, worker: Worker, now: datetime | None = None
    ) -> None:
        """Give the job back (clean worker shutdown): queued at once, and the
        attempt is not counted."""
        now = now or timezone.now()
        with transaction.atomic():
            job = self._lock_lease(lease_token, worker)
            if job is None:
                raise LeaseLost(self._lost_detail())
            Job._move(
                [job],
                to=JobStatus.QUEUED,
                now=now,
                lease_end=LeaseEnd.RELEASED,
                refund_attempt=True,
            )
        self._copy_from(job)

    # --- Operator and admin transitions -------------------------------------------

    def force_reclaim(self, *, actor=None, now: datetime | None = None) -> bool:
        """End a live lease now (admin action): job and item back to queued, the
        ledger row closed as ``forced``, the attempt not counted. The old worker
        is fenced out by its token. Returns False if the job was not leased."""
        now = now or timezone.now()
        with transaction.atomic():
            job = (
                Job.objects.filter(pk=self.pk, status=JobStatus.LEASED).locked().first()
            )
            if job is None:
                return False
            worker = job.leased_by_id
            Job._move(
                [job],
                to=JobStatus.QUEUED,
                now=now,
                lease_end=LeaseEnd.FORCED,
                error="The lease was ended by an administrator.",
                refund_attempt=True,
            )
            Event.objects.create(
                kind=Event.Kind.FORCE_RECLAIMED,
                job=job,
                batch_id=job.batch_id,
                actor=actor,
                message=f"Lease of worker {worker} ended by force; job queued again.",
            )
        self._copy_from(job)
        return True

    def cancel(self, *, actor=None, now: datetime | None = None) -> bool:
        """Cancel a queued job. Returns False if it was not queued."""
        now = now or timezone.now()
        with transaction.atomic():
            job = (
                Job.objects.filter(pk=self.pk, status=JobStatus.QUEUED).locked().first()
            )
            if job is None:
                return False
            Job._move([job], to=JobStatus.CANCELLED, now=now)
            Event.objects.create(
                kind=Event.Kind.CANCELLED,
                job=job,
                batch_id=job.batch_id,
                actor=actor,
                message="Job cancelled.",
            )
        self._copy_from(job)
        return True

    # --- Repairs (called by reconciliation; each one atomic) ----------------------

    def heal_item(self, *, now: datetime | None = None) -> bool:
        """Set the item's status to the one that agrees with the job's."""
        now = now or timezone.now()
        with transaction.atomic():
            job = Job.objects.filter(pk=self.pk).locked().first()
            if job is None or job.item.status == item_status_for(job.status):
                return False
            Job._move_items([job], was=job.status, to=job.status, now=now)
        return True

    def close_stray_leases(self, *, now: datetime | None = None) -> int:
        """Close open ledger rows of this job that no live lease stands behind."""
        now = now or timezone.now()
        with transaction.atomic():
            job = Job.objects.filter(pk=self.pk).locked().first()
            if job is None:
                return 0
            stray = Lease.objects.filter(job=job, ended_at__isnull=True)
            if job.status == JobStatus.LEASED:
                stray = stray.exclude(token=job.lease_token)
            stray = list(stray)
            for lease in stray:
                Lease.objects.filter(pk=lease.pk).update(
                    ended_at=now,
                    end_reason=LeaseEnd.EXPIRED,
                    error=f"Closed by reconciliation: the job is {job.status}.",
                )
                Event.repair(
                    job,
                    f"Closed lease-ledger row {lease.pk} (attempt {lease.attempt}) "
                    f"left open although the job is {job.status}.",
                )
        return len(stray)

    def restore_lease_row(self, *, now: datetime | None = None) -> bool:
        """Give a leased job the open ledger row it lacks."""
        now = now or timezone.now()
        with transaction.atomic():
            job = (
                Job.objects.filter(pk=self.pk, status=JobStatus.LEASED).locked().first()
            )
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
            Lease.objects.filter(
                token=job.lease_token
            ).delete()  # a closed row with a live token
            Lease.objects.create(
                job=job,
                worker_id=job.leased_by_id,
                token=job.lease_token,
                attempt=job.attempts,
                claimed_at=job.heartbeat_at or now,
                heartbeat_at=job.heartbeat_at,
                expires_at=job.lease_expires_at,
            )
            Event.repair(
                job, "Opened the missing lease-ledger row for the job's live lease."
            )
        return True

    def fail_exhausted(self, *, now: datetime | None = None) -> bool:
        """Fail a queued job that has no attempts left (it can never be claimed)."""
        now = now or timezone.now()
        with transaction.atomic():
            job = (
                Job.objects.filter(
                    pk=self.pk, status=JobStatus.QUEUED, attempts__gte=F("max_attempts")
                )
                .locked()
                .first()
            )
            if job is None:
                return False
            message = "Failed by reconciliation: queued with no attempts left."
            Job._move([job], to=JobStatus.FAILED, now=now, last_error=message)
            Event.repair(job, message)
        return True

    # --- Internals ----------------------------------------------------------------

    def _lock_lease(self, lease_token: str, worker: Worker) -> Job | None:
        """This job, locked, if ``worker`` holds its live lease under this token."""
        return (
            Job.objects.filter(
                pk=self.pk,
                status=JobStatus.LEASED,
                lease_token=lease_token,
                leased_by=worker,
            )
            .locked()
            .first()
        )

    def _completed(self, result: dict, now: datetime) -> None:
        """Bring this instance in line with a completion written in SQL."""
        self.status, self.result = JobStatus.COMPLETED, result
        self.lease_token = self.leased_by_id = self.lease_expires_at = None
        self.finished_at = self.updated_at = now

    def _lost_detail(self) -> str:
        return (
            f"Job {self.pk} is not leased to this worker under this token: the lease "
            f"ended (completed, failed, released, reclaimed or cancelled) or the token "
            f"is wrong."
        )

    def _copy_from(self, other: Job) -> None:
        for field in self._meta.concrete_fields:
            setattr(self, field.attname, getattr(other, field.attname))

    def _start_lease(self, worker: Worker, now: datetime) -> None:
        """queued -> leased for this locked job: job, item, new ledger row."""
        was = self.status
        self.status = JobStatus.LEASED
        self.lease_token = new_lease_token()
        self.leased_by = worker
        self.lease_expires_at = now + lease_duration()
        self.heartbeat_at = now
        self.attempts += 1
        self.updated_at = now
        self.save(
            update_fields=[
                "status",
                "lease_token",
                "leased_by",
                "lease_expires_at",
                "heartbeat_at",
                "attempts",
                "updated_at",
            ]
        )
        Job._move_items([self], was=was, to=self.status, now=now)
        Lease.objects.create(
            job=self,
            worker=worker,
            token=self.lease_token,
            attempt=self.attempts,
            claimed_at=now,
            heartbeat_at=now,
            expires_at=self.lease_expires_at,
        )

    @staticmethod
    def _move(
        jobs: Sequence[Job],
        *,
        to: str,
        now: datetime,
        lease_end: str | None = None,
        error: str = "",
        refund_attempt: bool = False,
        **fields,
    ) -> None:
        """Move locked ``jobs`` (all in the same status) to status ``to``.

        Writes the jobs, closes their ledger rows (if they were leased, with reason
        ``lease_end``), and moves their items and the counters: all inside the
        caller's transaction. ``fields`` are further job fields to set.
        """
        if not jobs:
            return
        was = jobs[0].status
        assert all(j.status == was for j in jobs), "one source status per move"
        if was == JobStatus.LEASED:
            Lease.close(jobs, reason=lease_end, now=now, error=error)
        values = {"status": to, "updated_at": now, **fields}
        if was == JobStatus.LEASED:
            values.update(lease_token=None, leased_by=None, lease_expires_at=None)
        if to == JobStatus.QUEUED:
            values.setdefault("available_at", now)
            values["finished_at"] = None
        elif to in TERMINAL_JOB_STATUSES:
            values["finished_at"] = now
        update = dict(values)
        if refund_attempt:
            update["attempts"] = F("attempts") - 1
        Job.objects.filter(pk__in=[j.pk for j in jobs]).update(**update)
        for job in jobs:
            for name, value in values.items():
                setattr(job, name, value)
            if refund_attempt:
                job.attempts -= 1
        Job._move_items(jobs, was=was, to=to, now=now)

    @staticmethod
    def _move_items(jobs: Sequence[Job], *, was: str, to: str, now: datetime) -> None:
        """Bring the items of ``jobs`` to the status that agrees with ``to``.

        ``was`` is the jobs' status before this transition; an item that did not
        agree with it had drifted, and the repair is logged.
        """
        expected, new = item_status_for(was), item_status_for(to)
        moves, drifted = [], set()
        for job in jobs:
            item = job.item
            if item.status != expected:
                Event.repair(
                    job,
                    f"Item was {item.status} while its job was {was}; set to {new}.",
                )
                drifted.add(job.batch_id)
            moves.append(
                ItemMove(item.pk, job.batch_id, item.status, new, item.duration_ms or 0)
            )
            item.status = new
        move_items(moves, now=now)
        if drifted:
            # Whatever changed the item may have bypassed the counters too.
            Batch.objects.filter(pk__in=drifted).update(recount_requested_at=now)


def _group_by(jobs: Iterable[Job], attribute: str) -> dict:
    groups: dict = defaultdict(list)
    for job in jobs:
        groups[getattr(job, attribute)].append(job)
    return groups


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

    @staticmethod
    def close(
        jobs: Sequence[Job], *, reason: str, now: datetime, error: str = ""
    ) -> None:
        """Close the open ledger rows of the live leases of ``jobs``.

        Call it before the jobs' lease fields are cleared. A live lease whose row
        is missing or already closed is drift: the row is written (closed) or left
        as it is, and the repair logged, so the history shows every attempt.
        """
        assert reason in LeaseEnd.values
        tokens = [job.lease_token for job in jobs]
        closed = Lease.objects.filter(token__in=tokens, ended_at__isnull=True).update(
            ended_at=now, end_reason=reason, error=error
        )
        if closed == len(tokens):
            return
        rows = dict(
            Lease.objects.filter(token__in=tokens).values_list("token", "ended_at")
        )
        for job in jobs:
            if job.lease_token not in rows:
                Lease.objects.create(
                    job=job,
                    worker_id=job.leased_by_id,
                    token=job.lease_token,
                    attempt=job.attempts,
                    claimed_at=job.heartbeat_at or now,
                    ended_at=now,
                    end_reason=reason,
                    error=error,
                )
                Event.repair(job, "The live lease had no ledger row; wrote it, closed.")
            elif rows[job.lease_token] != now:
                Event.repair(job, "The live lease's ledger row was already closed.")


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

    @classmethod
    def record_each(cls, jobs: Sequence[Job], kind: str, message: str, actor) -> None:
        """One event per job (an operator's or admin's action on each)."""
        cls.objects.bulk_create(
            cls(kind=kind, job=job, batch_id=job.batch_id, actor=actor, message=message)
            for job in jobs
        )

    @classmethod
    def repair(
        cls, job: Job | None, message: str, *, batch_id: int | None = None
    ) -> Event:
        """Log a reconciliation repair (database row and WARNING log line)."""
        if batch_id is None and job is not None:
            batch_id = job.batch_id
        log.warning(
            "repair: job=%s batch=%s: %s", job.pk if job else "-", batch_id, message
        )
        return cls.objects.create(
            kind=cls.Kind.REPAIR, job=job, batch_id=batch_id, message=message
        )


# --- Sweeper state ------------------------------------------------------------


class SweepState(models.Model):
    """A single row: the sweep's lock and what its last pass did.

    The lock is itself a lease (``locked_until``), so a sweeper killed mid-pass
    cannot block the next one for long. /readyz reads ``last_finished_at``.
    """

    locked_until = models.DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=100, blank=True, default="")
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_report = models.JSONField(default=dict, blank=True)
    scan_cursor = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"sweep state (last finished {self.last_finished_at})"

    SINGLETON = 1

    @classmethod
    def get(cls) -> SweepState:
        state, _ = cls.objects.get_or_create(pk=cls.SINGLETON)
        return state

    @classmethod
    def acquire(cls, owner: str, *, now: datetime, ttl: timedelta) -> bool:
        cls.get()
        return bool(
            cls.objects.filter(pk=cls.SINGLETON)
            .filter(
                Q(locked_until__isnull=True)
                | Q(locked_until__lt=now)
                | Q(locked_by=owner)
            )
            .update(locked_until=now + ttl, locked_by=owner)
        )

    @classmethod
    def release(cls, owner: str) -> None:
        cls.objects.filter(pk=cls.SINGLETON, locked_by=owner).update(
            locked_until=None, locked_by=""
        )
