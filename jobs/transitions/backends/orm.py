"""The ORM backend: every hot transition through Django's ORM, the reference.

It runs everything on SQLite, and on PostgreSQL it is the healing path the
statement backend (``postgres.py``) falls back to when rows disagree (a drifted
item, a live lease without its ledger row, a stray open ledger row); with
``RECALL_TRANSITIONS_BACKEND=orm`` it runs everything on PostgreSQL too.

Each transition runs in one transaction and locks the rows it changes
(``select_for_update``; on SQLite every transaction is ``BEGIN IMMEDIATE``,
which serialises writers), or changes them by compare-and-set, never from a
stale in-memory copy. ``now`` arrives resolved (a test's fixed instant, or the
request's time from the database); ``None`` means "read this backend's clock".

The claim and the reclaim are written as a few hooks (``_claim_plan``,
``_claim_in_batch``, ``_reclaim_chunk``, ``_insert_items``) so that the
statement backend replaces exactly those and inherits the rest.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from batches.flags import flags_for
from batches.labels import Labels, satisfies
from batches.models import COUNTER_SHARDS, Batch, BatchCounter, BatchItem, ItemStatus
from jobs.exceptions import LeaseLost, TooManyLeases, WorkerDisabled
from jobs.models import Job, JobStatus, Lease, LeaseEnd, Worker
from jobs.tokens import hash_token, new_lease_token, plausible_worker_token
from jobs.tokens import token_prefix as prefix_of

from .. import workers
from ..outbox import finishing
from ..rows import (
    add_tally,
    charge_share,
    close_leases,
    group_by,
    log_lease,
    lost_detail,
    move_items,
    move_jobs,
    open_lease,
    rejoin_share,
)
from ..rules import (
    CLAIM_BATCH_CANDIDATES,
    LEASE_EXPIRED,
    LEASE_LOST,
    NOT_FOUND,
    gave_up,
    lease_duration,
    retry_delay,
    truncate_error,
)
from .base import Chores, ItemRow

log = logging.getLogger("recall.transitions")


@dataclass(frozen=True)
class Candidate:
    """An open batch a claim may take a job from, in claim order."""

    batch_id: int
    priority: int
    capped: bool  # has a max in flight: claims of it take turns on its row


def _servable(
    batches: QuerySet[Batch, tuple[Any, ...]], labels: Labels, *, page: int
) -> Iterator[Candidate]:
    """The batches of ``batches`` (``values_list`` of pk, priority,
    virtual_time, max_in_flight, requires, in claim order) whose requirements
    ``labels`` satisfy, read ``page`` rows at a time, each page after the last
    row of the one before (on the claim order's own columns)."""
    rows = batches
    while True:
        read = list(rows[:page])
        for pk, priority, _, cap, requires in read:
            if satisfies(labels, requires):
                yield Candidate(pk, priority, capped=cap is not None)
        if len(read) < page:
            return
        pk, priority, virtual_time = read[-1][:3]
        rows = batches.filter(
            Q(priority__lt=priority)
            | Q(priority=priority, virtual_time__gt=virtual_time)
            | Q(priority=priority, virtual_time=virtual_time, pk__gt=pk)
        )


# Rows per INSERT when the driver has no COPY (SQLite).
INSERT_CHUNK = 2_000
# One item to insert: (source, params, duration_ms or None).


class OrmBackend:
    """The portable transitions (see the module docstring)."""

    name = "orm"

    def __init__(self, connection: BaseDatabaseWrapper, chores: Chores) -> None:
        self.connection = connection
        self.chores = chores
        # Several machines share a PostgreSQL server: its clock is the only one
        # they agree on. SQLite is one machine: the process clock is the same.
        self.database_clock = connection.vendor == "postgresql"

    # --- Time -------------------------------------------------------------------

    def now(self) -> datetime:
        """This backend's clock: the database's on PostgreSQL."""
        if not self.database_clock:
            return timezone.now()
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")
            return cursor.fetchone()[0]

    def _resolve(self, now: datetime | None) -> datetime:
        return self.now() if now is None else now

    # --- Workers ----------------------------------------------------------------

    def authenticate(self, token: str) -> tuple[Worker | None, datetime | None]:
        """The worker holding ``token`` (active or not), or None; and the
        request's time, read with it (from the database on PostgreSQL). The
        worker comes with ``live_leases``, the leases it holds now."""
        if not plausible_worker_token(token):
            return None, None
        live = (
            # A job has a holder exactly while it is leased (a check
            # constraint): its own index, not every live lease's.
            Job.objects.filter(leased_by=OuterRef("pk"))
            .order_by()
            .values("leased_by")
            .annotate(n=Count("pk"))
            .values("n")
        )
        candidates = Worker.objects.filter(token_prefix=prefix_of(token)).annotate(
            leases_held=Coalesce(Subquery(live), 0)
        )
        if self.database_clock:
            candidates = candidates.annotate(db_now=Now())
        digest = hash_token(token)
        for worker in candidates:
            if hmac.compare_digest(worker.token_hash, digest):
                worker.live_leases = worker.leases_held
                now = getattr(worker, "db_now", None) or timezone.now()
                return worker, now
        return None, None

    def authenticate_many(
        self, tokens: Sequence[str]
    ) -> list[tuple[Worker | None, datetime | None]]:
        """``authenticate`` for each token, in order (one statement on
        PostgreSQL)."""
        return [self.authenticate(token) for token in tokens]

    def touch(self, worker: Worker, now: datetime) -> None:
        """Record that the worker was seen (``workers.touch``)."""
        workers.touch(worker, now)

    # --- Claim ------------------------------------------------------------------

    def claim_next(
        self,
        worker: Worker,
        *,
        labels: Labels,
        now: datetime | None,
        max_leases: int,
    ) -> Job | None:
        """Lease the next claimable job to ``worker``, or return None.

        First reclaims expired leases and finishes an interrupted batch cancel,
        so an expired lease is never left standing while new work is handed
        out. Then takes the oldest claimable job of the first open batch in
        claim order (priority, then fair share: least virtual time) whose
        requirements ``labels`` satisfy, skipping batches at their in-flight
        cap and rows other claims hold. TooManyLeases
        when the worker already holds ``max_leases``, WorkerDisabled when it was
        disabled meanwhile (``_claim_turn``).
        """
        now = self._resolve(now)
        expired, cancelling, candidates = self._claim_plan(now, labels)
        if expired:
            self.reclaim_expired(
                now=now, limit=settings.RECALL_RECLAIM_ON_CLAIM, wait=False
            )
        if cancelling:
            self.chores.finish_interrupted_cancel(now=now)
        if expired or cancelling:
            candidates = self._claim_plan(now, labels)[2]  # the chores changed them
        candidates = list(candidates)
        for candidate in candidates:
            # The claim is charged to the batch's share only when another open
            # batch of its priority has work too (alone, it owes nobody).
            rivals = any(
                other.priority == candidate.priority and other is not candidate
                for other in candidates
            )
            job = self._claim_in_batch(
                candidate,
                worker,
                now,
                labels=labels,
                charge=rivals,
                max_leases=max_leases,
            )
            if job is not None:
                return job
        return None

    def claim_many(
        self,
        worker: Worker,
        *,
        labels: Labels,
        max_jobs: int,
        now: datetime | None,
        max_leases: int,
    ) -> list[Job]:
        """Up to ``max_jobs`` jobs for ``worker``: ``claim_next`` that many
        times in a row, stopping at the first that finds nothing or at the
        lease cap (see ``transitions.claim_many``). The reference: each job is
        exactly a single claim, in a transaction of its own."""
        return self._claim_more(
            [],
            worker,
            labels=labels,
            max_jobs=max_jobs,
            now=now,
            max_leases=max_leases,
            held=worker.live_leases,
        )

    def _claim_more(
        self,
        jobs: list[Job],
        worker: Worker,
        *,
        labels: Labels,
        max_jobs: int,
        now: datetime | None,
        max_leases: int,
        held: int,
    ) -> list[Job]:
        """``jobs`` and single claims after them, up to ``max_jobs`` in all.
        TooManyLeases only when ``jobs`` is empty; after a job, the cap just
        ends the run. ``held``, the worker's live leases before ``jobs`` as
        last counted, saves the claim that would be refused (each claim's
        turn still counts for itself: a stale count never lets it over)."""
        while len(jobs) < max_jobs:
            if jobs and held + len(jobs) >= max_leases:
                break
            try:
                job = self.claim_next(
                    worker, labels=labels, now=now, max_leases=max_leases
                )
            except TooManyLeases:
                if not jobs:
                    raise
                break
            if job is None:
                break
            jobs.append(job)
        return jobs

    def _claim_plan(
        self, now: datetime, labels: Labels
    ) -> tuple[bool, bool, Iterable[Candidate]]:
        """(reclaim first?, finish a cancel first?, the first
        ``CLAIM_BATCH_CANDIDATES`` open batches with a claimable job whose own
        requirement (a re-run's, ``Job.requires``) ``labels`` satisfy, room
        under their cap and requirements ``labels`` satisfy, in claim order).
        Here each chore probes itself. A batch whose only claimable jobs need
        labels the worker lacks is no candidate: it never hides another's.

        The requirements are matched in Python (``satisfies``: SQLite has no
        JSON containment), page after page of the claim order, so batches the
        worker cannot serve never hide one it can behind them."""
        live = (
            Job.objects.filter(batch=OuterRef("pk"), status=JobStatus.LEASED)
            .order_by()
            .values("batch")
            .annotate(n=Count("pk"))
            .values("n")
        )
        candidates = (
            Batch.objects.open()
            .filter(
                Exists(
                    Job.objects.claimable(now)
                    .serving(labels)
                    .filter(batch=OuterRef("pk"))
                )
            )
            .filter(
                Q(max_in_flight__isnull=True)
                | Q(max_in_flight__gt=Coalesce(Subquery(live), 0))
            )
            .order_by("-priority", "virtual_time", "pk")
            .values_list("pk", "priority", "virtual_time", "max_in_flight", "requires")
        )
        servable = islice(
            _servable(candidates, labels, page=CLAIM_BATCH_CANDIDATES),
            CLAIM_BATCH_CANDIDATES,
        )
        return True, True, list(servable)

    def _claim_in_batch(
        self,
        candidate: Candidate,
        worker: Worker,
        now: datetime,
        *,
        labels: Labels,
        charge: bool,
        max_leases: int,
    ) -> Job | None:
        for attempt in (1, 2):
            job = None
            try:
                with transaction.atomic():
                    held = self._claim_turn(worker)
                    if held >= max_leases:
                        raise TooManyLeases(worker.name, held, max_leases)
                    if candidate.capped and not self._room_under_cap(candidate):
                        return None
                    job = (
                        Job.objects.claimable(now)
                        .serving(labels)  # a re-run's own requirement
                        .filter(
                            batch_id=candidate.batch_id,
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
                    if job is not None and not satisfies(labels, job.batch.requires):
                        # Its requirements changed since the plan: not this one.
                        return None
                    if job is not None:
                        open_lease(job, worker, token=new_lease_token(), now=now)
                        if charge:
                            charge_share(job.batch_id)
                    return job
            except IntegrityError:
                # Only an open ledger row left behind for a queued job can make the
                # lease insert fail (one open row per job is a constraint). Close
                # it as a repair and try once more.
                if job is None or attempt == 2:
                    raise
                self.chores.close_stray_leases(job.pk, now=now)
        return None

    def _claim_turn(self, worker: Worker) -> int:
        """Take the worker's turn to claim (a lock on its row, held until the
        claim's transaction ends), then count its live leases in a statement
        of their own, which sees every claim of the worker committed before
        the turn came: the count the cap is checked against is never stale.
        WorkerDisabled if the worker was disabled before the turn came (after
        its request was authenticated): ``disable_and_reclaim`` takes the same
        lock, so a disabled worker never gets a lease.
        (On SQLite every transaction is BEGIN IMMEDIATE: already one at a
        time.) The statement backend does the same inside its claim
        statement, through ``recall_claim_turn()`` (migrations 0013 and 0014)."""
        active = (
            Worker.objects.select_for_update(no_key=True)
            .filter(pk=worker.pk)
            .values_list("is_active", flat=True)
            .first()
        )
        if not active:
            raise WorkerDisabled(worker.name)
        return Job.objects.filter(leased_by=worker.pk).count()

    def _room_under_cap(self, candidate: Candidate) -> bool:
        """Lock the capped batch's row (claims of it take turns here), then
        count its live leases in a statement of their own, which sees every
        claim committed before the lock was granted: never over the cap."""
        cap = (
            Batch.objects.select_for_update()
            .filter(pk=candidate.batch_id)
            .values_list("max_in_flight", flat=True)
            .first()
        )
        if cap is None:
            return True
        live = Job.objects.filter(
            batch_id=candidate.batch_id, status=JobStatus.LEASED
        ).count()
        return live < cap

    # --- A live lease's own transitions -------------------------------------------

    def heartbeat(
        self, job_id: int, lease_token: str, *, worker: Worker, now: datetime | None
    ) -> datetime:
        now = self._resolve(now)
        expires = now + lease_duration()
        with transaction.atomic():
            extended = Job.objects.filter(
                pk=job_id,
                status=JobStatus.LEASED,
                lease_token=lease_token,
                leased_by=worker,
            ).update(lease_expires_at=expires, heartbeat_at=now, updated_at=now)
            if not extended:
                raise LeaseLost(lost_detail(job_id))
            Lease.objects.filter(token=lease_token, ended_at__isnull=True).update(
                heartbeat_at=now, expires_at=expires
            )
        return expires

    def heartbeat_many(
        self,
        leases: Sequence[tuple[int, str]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[datetime | str]:
        now = self._resolve(now)
        expires = now + lease_duration()
        tokens = dict(leases)
        with transaction.atomic():
            # The worker's leased jobs among them, locked in id order (as every
            # transition that locks many jobs takes them: no deadlock), then
            # each renewed if its token is the one asked with: the single
            # heartbeat's compare-and-set, entry by entry.
            held = (
                Job.objects.select_for_update(no_key=True)
                .filter(pk__in=tokens, status=JobStatus.LEASED, leased_by=worker)
                .order_by("pk")
                .values_list("pk", "lease_token")
            )
            renewed = {pk for pk, token in held if token == tokens[pk]}
            if renewed:
                Job.objects.filter(pk__in=renewed).update(
                    lease_expires_at=expires, heartbeat_at=now, updated_at=now
                )
                Lease.objects.filter(
                    token__in=[tokens[pk] for pk in renewed], ended_at__isnull=True
                ).update(heartbeat_at=now, expires_at=expires)
            unrenewed = [pk for pk in tokens if pk not in renewed]
            exist = (
                set(Job.objects.filter(pk__in=unrenewed).values_list("pk", flat=True))
                if unrenewed
                else set()
            )
        return [
            expires
            if job_id in renewed
            else LEASE_LOST
            if job_id in exist
            else NOT_FOUND
            for job_id, _ in leases
        ]

    def complete(
        self,
        job_id: int,
        lease_token: str,
        *,
        worker: Worker,
        result: dict[str, Any],
        now: datetime | None,
    ) -> Job | None:
        """The completed job, or None when this completion was already made
        with this token (a replay: the worker lost the first response). The
        item's quality flags are decided from the result and the locked item
        (``batches.flags``) and stored with the completion."""
        now = self._resolve(now)
        with finishing(now):
            job = self._lock_lease(job_id, lease_token, worker)
            if job is None:
                if Lease.objects.filter(
                    job_id=job_id,
                    token=lease_token,
                    worker=worker,
                    end_reason=LeaseEnd.COMPLETED,
                ).exists():
                    return None
                raise LeaseLost(lost_detail(job_id))
            move_jobs(
                [job],
                to=JobStatus.COMPLETED,
                now=now,
                lease_end=LeaseEnd.COMPLETED,
                result=result,
                flags=flags_for(
                    result,
                    duration_ms=job.item.duration_ms,
                    language=(job.item.params or {}).get("language")
                    if isinstance(job.item.params, dict)
                    else None,
                ),
            )
        return job

    def complete_many(
        self,
        completions: Sequence[tuple[int, str, dict[str, Any]]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[Job | str | None]:
        """Many completions of one worker in one transaction (a batched
        completion): ``completions`` are (job id, lease token, result), the
        job ids distinct. For each, in order: the completed job; None for a
        replay (already completed with this token by this worker: the single
        completion's success that changes nothing); or why not, ``LEASE_LOST``
        or ``NOT_FOUND``. Each is judged exactly as ``complete`` judges it
        alone, and one that is not live never stops the others.

        The worker's live leases among them are locked with their items in id
        order (as every transition that locks many jobs takes them), the
        counters and throughput minutes shift once per (batch, shard) in that
        order, and the finish checks of the batches they may finish run last
        (``finishing``): a batch finished by them gets its one
        ``batch.finished`` event exactly as the last of as many single
        completions would write it."""
        now = self._resolve(now)
        asked = {job_id: (token, result) for job_id, token, result in completions}
        with finishing(now):
            held = (
                Job.objects.filter(
                    pk__in=asked, status=JobStatus.LEASED, leased_by=worker
                )
                .locked()
                .order_by("pk")
            )
            live = [job for job in held if job.lease_token == asked[job.pk][0]]
            if live:
                close_leases(live, reason=LeaseEnd.COMPLETED, now=now)
                flags: dict[int, tuple[str, ...]] = {}
                for job in live:
                    result = asked[job.pk][1]
                    values: dict[str, Any] = {
                        "status": JobStatus.COMPLETED,
                        "result": result,
                        "lease_token": None,
                        "leased_by": None,
                        "lease_expires_at": None,
                        "finished_at": now,
                        "updated_at": now,
                    }
                    Job.objects.filter(pk=job.pk).update(**values)
                    for name, value in values.items():
                        setattr(job, name, value)
                    params = job.item.params
                    flags[job.pk] = flags_for(
                        result,
                        duration_ms=job.item.duration_ms,
                        language=params.get("language")
                        if isinstance(params, dict)
                        else None,
                    )
                move_items(
                    live,
                    was=JobStatus.LEASED,
                    to=JobStatus.COMPLETED,
                    now=now,
                    flags=flags,
                )
            done = {job.pk: job for job in live}
            rest = [job_id for job_id in asked if job_id not in done]
            replays = (
                {
                    job_id
                    for job_id, token in Lease.objects.filter(
                        job_id__in=rest, worker=worker, end_reason=LeaseEnd.COMPLETED
                    ).values_list("job_id", "token")
                    if token == asked[job_id][0]
                }
                if rest
                else set()
            )
            unreplayed = [job_id for job_id in rest if job_id not in replays]
            exist = (
                set(Job.objects.filter(pk__in=unreplayed).values_list("pk", flat=True))
                if unreplayed
                else set()
            )
        answers: list[Job | str | None] = []
        for job_id, _, _ in completions:
            if job_id in done:
                answers.append(done[job_id])
            elif job_id in replays:
                answers.append(None)
            else:
                answers.append(LEASE_LOST if job_id in exist else NOT_FOUND)
        return answers

    def fail(
        self,
        job_id: int,
        lease_token: str,
        *,
        worker: Worker,
        error: str,
        retryable: bool,
        now: datetime | None,
    ) -> Job:
        now = self._resolve(now)
        error = truncate_error(error)
        with finishing(now):
            job = self._lock_lease(job_id, lease_token, worker)
            if job is None:
                raise LeaseLost(lost_detail(job_id))
            if retryable and job.attempts < job.max_attempts:
                move_jobs(
                    [job],
                    to=JobStatus.QUEUED,
                    now=now,
                    lease_end=LeaseEnd.FAILED,
                    error=error,
                    last_error=error,
                    available_at=now + retry_delay(job.attempts),
                )
            else:
                move_jobs(
                    [job],
                    to=JobStatus.FAILED,
                    now=now,
                    lease_end=LeaseEnd.FAILED,
                    error=error,
                    last_error=error,
                )
        return job

    def release(
        self, job_id: int, lease_token: str, *, worker: Worker, now: datetime | None
    ) -> Job:
        now = self._resolve(now)
        with transaction.atomic():
            job = self._lock_lease(job_id, lease_token, worker)
            if job is None:
                raise LeaseLost(lost_detail(job_id))
            move_jobs(
                [job],
                to=JobStatus.QUEUED,
                now=now,
                lease_end=LeaseEnd.RELEASED,
                refund_attempt=True,
            )
        return job

    def _lock_lease(self, job_id: int, lease_token: str, worker: Worker) -> Job | None:
        """The job, locked, if ``worker`` holds its live lease under this token."""
        return (
            Job.objects.filter(
                pk=job_id,
                status=JobStatus.LEASED,
                lease_token=lease_token,
                leased_by=worker,
            )
            .locked()
            .first()
        )

    # --- Reclaim ----------------------------------------------------------------

    def reclaim_expired(
        self,
        *,
        now: datetime | None,
        limit: int | None = None,
        wait: bool = True,
        among: QuerySet[Job] | None = None,
    ) -> dict[str, int]:
        """Reclaim expired leases in bounded transactions; return what happened.

        Each chunk locks its jobs with SKIP LOCKED, so concurrent sweeps and
        claims share the work and never reclaim the same lease twice. A job
        that has used its last attempt is failed instead of queued (a poison
        file must not crash workers forever). ``among``: only these jobs.
        """
        now = self._resolve(now)
        report = {"requeued": 0, "failed": 0}
        expired = Job.objects.expired(now)
        if among is not None:
            expired = expired.filter(pk__in=among.values("pk"))
        if not expired.exists():  # cheap probe, no transaction
            return report
        chunk = settings.RECALL_CHUNK_SIZE
        remaining = limit
        while remaining is None or remaining > 0:
            size = chunk if remaining is None else min(chunk, remaining)
            looked, requeued, failed = self._reclaim_chunk(
                now, size, wait=wait, among=among
            )
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

    def _reclaim_chunk(
        self,
        now: datetime,
        size: int,
        *,
        wait: bool,
        among: QuerySet[Job] | None = None,
    ) -> tuple[int, int, int]:
        """One transaction of ``reclaim_expired``: (jobs, requeued, failed)."""
        with finishing(now):
            expired = Job.objects.expired(now)
            if among is not None:
                expired = expired.filter(pk__in=among.values("pk"))
            jobs = list(
                expired.locked(skip_locked=True).order_by("lease_expires_at")[:size]
            )
            requeue = [j for j in jobs if j.attempts < j.max_attempts]
            give_up = [j for j in jobs if j.attempts >= j.max_attempts]
            for job in jobs:
                log_lease("reclaimed", job, worker_id=job.leased_by_id)
            move_jobs(
                requeue,
                to=JobStatus.QUEUED,
                now=now,
                lease_end=LeaseEnd.EXPIRED,
                error=LEASE_EXPIRED,
            )
            for max_attempts, group in group_by(give_up, "max_attempts").items():
                message = gave_up(max_attempts)
                move_jobs(
                    group,
                    to=JobStatus.FAILED,
                    now=now,
                    lease_end=LeaseEnd.EXPIRED,
                    error=message,
                    last_error=message,
                )
            add_tally("leases_expired", len(jobs))
        return len(jobs), len(requeue), len(give_up)

    # --- Intake -----------------------------------------------------------------

    def create_batch(
        self,
        *,
        name: str,
        items: Iterable[ItemRow],
        priority: int,
        weight: int,
        max_in_flight: int | None,
        created_by: Any,
        now: datetime,
        on_created: Callable[[Batch], None] | None = None,
        requires: dict[str, str] | None = None,
    ) -> Batch:
        """The batch (with the worker labels it requires), its items, their
        jobs and the counters, in one transaction: a batch is never visible
        half-created, nor claimable before its requirements are stored.
        ``items`` may raise to abandon it."""
        with transaction.atomic():
            batch = Batch.objects.create(
                name=name,
                priority=priority,
                weight=weight,
                max_in_flight=max_in_flight,
                requires=requires or {},
                created_by=created_by,
                created_at=now,
            )
            self._insert_items(batch, items, now=now)
            self._insert_jobs(batch, now=now)
            # Per shard: (items, their duration sum in ms, items with a duration).
            shards: dict[int, tuple[int, int, int]] = {
                shard: (n, ms, timed)
                for shard, n, ms, timed in BatchItem.objects.filter(batch=batch)
                .annotate(shard=F("id") % COUNTER_SHARDS)
                .values("shard")
                .annotate(
                    n=Count("id"),
                    ms=Coalesce(Sum("duration_ms"), 0),
                    timed=Count("duration_ms"),
                )
                .values_list("shard", "n", "ms", "timed")
                .order_by()
            }
            BatchCounter.objects.bulk_create(
                BatchCounter(
                    batch=batch,
                    shard=shard,
                    queued=shards.get(shard, (0, 0, 0))[0],
                    queued_ms=shards.get(shard, (0, 0, 0))[1],
                )
                for shard in range(COUNTER_SHARDS)
            )
            batch.total = sum(n for n, _, _ in shards.values())
            batch.total_ms = sum(ms for _, ms, _ in shards.values())
            batch.durations_known = batch.total > 0 and batch.total == sum(
                timed for _, _, timed in shards.values()
            )
            batch.save(update_fields=["total", "total_ms", "durations_known"])
            rejoin_share([batch.pk])  # joins the rotation where the others are
            batch.refresh_from_db(fields=["virtual_time"])
            if on_created is not None:
                on_created(batch)
        return batch

    ITEM_COLUMNS = (
        "batch_id",
        "source",
        "params",
        "duration_ms",
        "status",
        "created_at",
        "updated_at",
    )

    def _item_rows(
        self, batch: Batch, items: Iterable[ItemRow], now: datetime
    ) -> Iterator[tuple[Any, ...]]:
        at = self.connection.ops.adapt_datetimefield_value(now)
        for source, params, duration_ms in items:
            yield (
                batch.pk,
                source,
                json.dumps(params, ensure_ascii=False),
                duration_ms,
                ItemStatus.QUEUED,
                at,
                at,
            )

    def _insert_items(
        self, batch: Batch, items: Iterable[ItemRow], *, now: datetime
    ) -> None:
        """Insert the items in chunks of plain INSERTs (the ORM's bulk_create
        builds a model instance per row: too slow for a million items)."""
        table = BatchItem._meta.db_table
        placeholders = ", ".join(["%s"] * len(self.ITEM_COLUMNS))
        sql = (
            f"INSERT INTO {table} ({', '.join(self.ITEM_COLUMNS)}) "
            f"VALUES ({placeholders})"
        )
        rows = self._item_rows(batch, items, now)
        with self.connection.cursor() as cursor:
            while chunk := list(islice(rows, INSERT_CHUNK)):
                cursor.executemany(sql, chunk)

    def _insert_jobs(self, batch: Batch, *, now: datetime) -> None:
        """One job per item of the batch, in a single INSERT ... SELECT, in
        the items' order: claims within a batch follow job ids (its jobs share
        one created_at), so the manifest's first line is handed out first
        whatever order the table happens to return the items in."""
        at = self.connection.ops.adapt_datetimefield_value(now)
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {Job._meta.db_table} (item_id, batch_id, status, "
                f"attempts, max_attempts, available_at, last_error, created_at, "
                f"updated_at) "
                f"SELECT id, batch_id, %s, 0, %s, %s, '', %s, %s "
                f"FROM {BatchItem._meta.db_table} WHERE batch_id = %s ORDER BY id",
                [JobStatus.QUEUED, settings.RECALL_MAX_ATTEMPTS, at, at, at, batch.pk],
            )
