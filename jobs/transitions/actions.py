"""Operator and admin transitions: pause, resume, cancel, retry, force reclaim,
and marking batches finished. Portable ORM code, the same on every backend.

Bulk actions work in bounded transactions (``RECALL_CHUNK_SIZE`` jobs each,
locked with SKIP LOCKED so rows a worker's transition holds right now are left
alone), so a million-job selection never holds many locks for long. Each
records what it did in the event log, in the transaction that does it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Max, QuerySet

from batches.flags import FLAG_COLUMNS
from batches.labels import LabelError, format_pairs
from batches.models import Batch, BatchItem
from jobs.exceptions import BatchClosed, RerunRefused
from jobs.models import (
    Event,
    Job,
    JobQuerySet,
    JobRun,
    JobStatus,
    Lease,
    LeaseEnd,
    Worker,
)

from .outbox import finish_if_done, finishing
from .rows import (
    add_tally,
    group_by,
    log_lease,
    move_jobs,
    record_event,
    record_events,
    rejoin_share,
)
from .rules import BATCH_CANCELLED, CANCEL_GRACE, FORCED_BY_ADMIN

log = logging.getLogger("recall.transitions")

# A caller's own record of a bulk transition (e.g. the admin's LogEntry rows): it
# is called inside each transaction with the jobs that moved, so the record
# commits or rolls back together with the change.
Audit = Callable[[Sequence[Job]], None]


# --- Batches ---------------------------------------------------------------------


def pause_batch(batch: Batch, *, now: datetime, actor: Any = None) -> bool:
    """Stop handing out the batch's jobs; leases in flight run to their end.
    False if it was already paused."""
    with transaction.atomic():
        paused = Batch.objects.filter(pk=batch.pk, paused_at__isnull=True).update(
            paused_at=now
        )
        if paused:
            record_event(
                Event.Kind.BATCH_PAUSED,
                "Batch paused.",
                at=now,
                batch_id=batch.pk,
                actor=actor,
            )
    batch.refresh_from_db(fields=["paused_at"])
    return bool(paused)


def resume_batch(batch: Batch, *, now: datetime, actor: Any = None) -> bool:
    """Hand out the batch's jobs again, sharing from where the other batches of
    its priority are now (it does not catch up on its paused time). False if
    it was not paused."""
    with transaction.atomic():
        resumed = Batch.objects.filter(pk=batch.pk, paused_at__isnull=False).update(
            paused_at=None
        )
        if resumed:
            rejoin_share([batch.pk])
            record_event(
                Event.Kind.BATCH_RESUMED,
                "Batch resumed.",
                at=now,
                batch_id=batch.pk,
                actor=actor,
            )
    batch.refresh_from_db(fields=["paused_at", "virtual_time"])
    return bool(resumed)


def set_share(
    batch: Batch,
    *,
    priority: int,
    weight: int,
    max_in_flight: int | None,
    now: datetime,
    actor: Any = None,
) -> list[str]:
    """Change how the batch shares the workers; the next claim follows it. A
    batch moved to another priority joins that priority's rotation where its
    batches are. Records one event saying what changed; returns the changes."""
    with transaction.atomic():
        current = Batch.objects.select_for_update().get(pk=batch.pk)
        wanted = {
            "priority": priority,
            "weight": weight,
            "max_in_flight": max_in_flight,
        }
        changes = [
            f"{field.replace('_', ' ')} {_shown(getattr(current, field))} "
            f"-> {_shown(value)}"
            for field, value in wanted.items()
            if getattr(current, field) != value
        ]
        if changes:
            Batch.objects.filter(pk=batch.pk).update(**wanted)
            if priority != current.priority:
                rejoin_share([batch.pk])
            record_event(
                Event.Kind.BATCH_CHANGED,
                "Changed " + ", ".join(changes) + ".",
                at=now,
                batch_id=batch.pk,
                actor=actor,
            )
    batch.refresh_from_db(
        fields=["priority", "weight", "max_in_flight", "virtual_time"]
    )
    return changes


def _shown(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def set_requires(
    batch: Batch, requires: dict[str, str], *, now: datetime, actor: Any = None
) -> str | None:
    """Change the worker labels the batch requires (already checked by
    ``batches.labels.clean_labels``); the next claim follows it. Only while
    the batch is open, checked under its lock (BatchClosed otherwise). Records
    one event saying what changed; returns it, or None if nothing did."""
    with transaction.atomic():
        current = Batch.objects.select_for_update().get(pk=batch.pk)
        if current.cancelled_at is not None:
            raise BatchClosed(batch.pk, "cancelled")
        if current.finished_at is not None:
            raise BatchClosed(batch.pk, "finished")
        change = None
        if current.requires != requires:
            change = (
                f"requires {format_pairs(current.requires) or 'nothing'} -> "
                f"{format_pairs(requires) or 'nothing'}"
            )
            Batch.objects.filter(pk=batch.pk).update(requires=requires)
            record_event(
                Event.Kind.BATCH_CHANGED,
                f"Changed {change}.",
                at=now,
                batch_id=batch.pk,
                actor=actor,
            )
    batch.refresh_from_db(fields=["requires"])
    return change


def cancel_batch(
    batch: Batch,
    *,
    now: datetime,
    actor: Any = None,
    time_limit: float | None = None,
) -> int:
    """Cancel a batch: its queued and in-flight jobs become cancelled.

    The batch is marked cancelled first (claims skip it from then on), then its
    jobs are cancelled in bounded transactions. In-flight leases end at once
    (ledger reason ``forced``); their workers get 409 on the next call. After
    ``time_limit`` seconds no new chunk is started (a web request must answer in
    time); reconciliation finishes the rest, as it does when the process dies
    part-way. Returns how many jobs this call cancelled.
    """
    deadline = None if time_limit is None else time.monotonic() + time_limit
    with transaction.atomic():
        marked = Batch.objects.filter(pk=batch.pk, cancelled_at__isnull=True).update(
            cancelled_at=now
        )
        if marked:
            record_event(
                Event.Kind.BATCH_CANCELLED,
                "Batch cancelled.",
                at=now,
                batch_id=batch.pk,
                actor=actor,
            )
    total = 0
    for wait in (False, True):  # then rows another transaction held a moment ago
        while deadline is None or time.monotonic() < deadline:
            n = cancel_batch_chunk(batch.pk, now=now, wait=wait)
            total += n
            if not n:
                break
    # Mark it finished now, so claims stop checking it for an unfinished cancel.
    settle(Batch.objects.filter(pk=batch.pk), now=now)
    batch.refresh_from_db(fields=["cancelled_at", "finished_at"])
    return total


def cancel_batch_chunk(batch_id: int, *, now: datetime, wait: bool = False) -> int:
    """Cancel up to one chunk of a cancelled batch's unfinished jobs (the
    chunk that cancels the last of them finishes the batch)."""
    with finishing(now):
        jobs = list(
            Job.objects.filter(
                batch_id=batch_id,
                batch__cancelled_at__isnull=False,
                status__in=[JobStatus.QUEUED, JobStatus.LEASED],
            )
            .locked(skip_locked=not wait)
            .order_by("pk")[: settings.RECALL_CHUNK_SIZE]
        )
        groups = group_by(jobs, "status")
        move_jobs(groups.get(JobStatus.QUEUED, []), to=JobStatus.CANCELLED, now=now)
        move_jobs(
            groups.get(JobStatus.LEASED, []),
            to=JobStatus.CANCELLED,
            now=now,
            lease_end=LeaseEnd.FORCED,
            error=BATCH_CANCELLED,
        )
    return len(jobs)


def finish_cancel(batch_id: int, *, now: datetime, chunks: int | None = None) -> int:
    """Cancel what a cancelled batch still has queued or in flight (an
    interrupted cancel), ``chunks`` chunks at most; then settle the batch."""
    total = 0
    while chunks is None or chunks > 0:
        n = cancel_batch_chunk(batch_id, now=now)
        total += n
        if chunks is not None:
            chunks -= 1
        if n == 0:
            break
    if total:
        log.warning(
            "repair: finished an interrupted cancel of batch %s: %d jobs",
            batch_id,
            total,
            extra={"batch": batch_id},
        )
    settle(Batch.objects.filter(pk=batch_id), now=now)
    return total


def finish_interrupted_cancel(*, now: datetime) -> int:
    """The claim's share of reconciliation: one chunk of the oldest interrupted
    batch cancel, if any (a probe of a partial index that is empty unless so)."""
    batch_id = (
        Batch.objects.filter(
            cancelled_at__isnull=False,
            finished_at__isnull=True,
            cancelled_at__lt=now - CANCEL_GRACE,
        )
        .values_list("pk", flat=True)
        .first()
    )
    if batch_id is None:
        return 0
    return finish_cancel(batch_id, now=now, chunks=1)


def settle(batches: QuerySet[Batch], *, now: datetime) -> int:
    """Mark finished the batches of ``batches`` with nothing queued or in
    flight, each with its ``batch.finished`` event; return how many.

    The transition that finishes a batch normally marks it itself; this is the
    sweep's (and a cancel's) safety net, with the same locked check
    (``outbox.finish_if_done``), so a batch still finishes exactly once.
    """
    settled = 0
    for batch_id in batches.filter(finished_at__isnull=True).values_list(
        "pk", flat=True
    ):
        with transaction.atomic():
            settled += finish_if_done(batch_id, now=now)
    return settled


# --- Jobs ------------------------------------------------------------------------


def force_reclaim(job_id: int, *, now: datetime, actor: Any = None) -> Job | None:
    """End a live lease now (admin action): job and item back to queued, the
    ledger row closed as ``forced``, the attempt not counted. The old worker is
    fenced out by its token. Returns the job, or None if it was not leased."""
    with transaction.atomic():
        job = Job.objects.filter(pk=job_id, status=JobStatus.LEASED).locked().first()
        if job is None:
            return None
        worker = job.leased_by_id
        move_jobs(
            [job],
            to=JobStatus.QUEUED,
            now=now,
            lease_end=LeaseEnd.FORCED,
            error=FORCED_BY_ADMIN,
            refund_attempt=True,
        )
        record_event(
            Event.Kind.FORCE_RECLAIMED,
            f"Lease of worker {worker} ended by force; job queued again.",
            at=now,
            job=job,
            actor=actor,
        )
    log_lease("forced", job, worker_id=worker, attempt=job.attempts + 1)
    return job


def force_reclaim_many(
    jobs: JobQuerySet,
    *,
    now: datetime,
    actor: Any = None,
    audit: Audit | None = None,
) -> int:
    """End the live leases of ``jobs``' leased jobs, each job in a transaction of
    its own, so a large selection never holds many locks at once. Jobs that are
    not leased (any more) are skipped. Returns how many leases were ended."""
    total, after = 0, 0
    leased = jobs.filter(status=JobStatus.LEASED).order_by("pk")
    while ids := list(
        leased.filter(pk__gt=after).values_list("pk", flat=True)[
            : settings.RECALL_CHUNK_SIZE
        ]
    ):
        for pk in ids:
            with transaction.atomic():
                job = force_reclaim(pk, now=now, actor=actor)
                if job is not None and audit is not None:
                    audit([job])
            total += job is not None
        after = ids[-1]
    return total


def disable_and_reclaim(
    worker: Worker,
    *,
    now: datetime,
    actor: Any = None,
    audit: Audit | None = None,
) -> list[Job]:
    """Stop a stolen or broken worker at once: disable it (its requests get
    403) and force-reclaim every live lease it holds, in one transaction.
    Returns the jobs whose leases ended (queued again, attempts refunded)."""
    with transaction.atomic():
        Worker.objects.filter(pk=worker.pk).update(is_active=False)
        worker.is_active = False
        ids = list(
            Job.objects.filter(leased_by=worker, status=JobStatus.LEASED)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        reclaimed = [
            job
            for job in (force_reclaim(pk, now=now, actor=actor) for pk in ids)
            if job is not None
        ]
        if audit is not None:
            audit(reclaimed)
    return reclaimed


def cancel_job(job_id: int, *, now: datetime, actor: Any = None) -> bool:
    """Cancel a queued job. Returns False if it was not queued."""
    with finishing(now):
        job = Job.objects.filter(pk=job_id, status=JobStatus.QUEUED).locked().first()
        if job is None:
            return False
        move_jobs([job], to=JobStatus.CANCELLED, now=now)
        record_event(
            Event.Kind.CANCELLED, "Job cancelled.", at=now, job=job, actor=actor
        )
    return True


def cancel_queued(
    jobs: JobQuerySet,
    *,
    now: datetime,
    actor: Any = None,
    audit: Audit | None = None,
) -> int:
    """Cancel the queued jobs of ``jobs``, in bounded transactions.

    A job a claim holds right now is being leased, so it is no longer queued and
    is left alone; so are jobs in any other status. Returns how many.
    """

    def cancel(chunk: list[Job]) -> None:
        move_jobs(chunk, to=JobStatus.CANCELLED, now=now)
        record_events(
            chunk, Event.Kind.CANCELLED, "Job cancelled.", at=now, actor=actor
        )

    return _in_chunks(jobs, JobStatus.QUEUED, cancel, audit, now=now)


def retry_failed(
    jobs: JobQuerySet,
    *,
    now: datetime,
    actor: Any = None,
    audit: Audit | None = None,
) -> int:
    """Queue the failed jobs of ``jobs`` again, with fresh attempts.

    Works in bounded transactions; each reopens the batches it touches so
    claims find them again. Jobs of cancelled batches stay failed. Returns how
    many jobs were queued.
    """

    def retry(chunk: list[Job]) -> None:
        batch_ids = {j.batch_id for j in chunk}
        move_jobs(chunk, to=JobStatus.QUEUED, now=now, attempts=0)
        # Failed for good once, and counted so: the total only ever grows.
        add_tally("jobs_failed_retried", len(chunk))
        # After the counters (every transition locks batches last), and under
        # the batch row's lock, which the finish check takes too.
        reopened = list(
            Batch.objects.filter(pk__in=batch_ids, finished_at__isnull=False)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        Batch.objects.filter(pk__in=batch_ids).update(finished_at=None)
        rejoin_share(reopened)
        record_events(
            chunk,
            Event.Kind.RETRIED,
            "Queued again with fresh attempts.",
            at=now,
            actor=actor,
        )

    return _in_chunks(
        jobs.filter(batch__cancelled_at__isnull=True),
        JobStatus.FAILED,
        retry,
        audit,
        now=now,
    )


# What a re-run may send back to the queue: items that finished, well or not.
RERUNNABLE = (JobStatus.COMPLETED, JobStatus.FAILED)
# What the re-run of a completed job is tallied as: it was completed once, and
# the fleet's "jobs completed" total (the counters plus this) only ever grows.
COMPLETED_RERUN = "jobs_completed_rerun"


def rerun(
    batch_id: int,
    *,
    items: Sequence[int] | None = None,
    flag: str | None = None,
    requires: dict[str, str],
    now: datetime,
    actor: Any = None,
) -> int:
    """Run again, as a new run, the chosen items of a batch (``items``: their
    ids) or every done item with quality flag ``flag``; returns how many.

    Only done and failed items may be re-run. Named items that are not the
    batch's, or are queued, in flight or cancelled, refuse the whole re-run
    (RerunRefused: nothing written); a flag selects done items only (only
    they have flags), so it never refuses. A cancelled batch refuses it
    (BatchClosed); so does a requirement that gives a key the batch requires
    another value (LabelError: no worker could take the jobs). ``requires``
    (already checked by ``clean_labels``) is the requirement of the new run,
    on top of the batch's: only workers whose labels satisfy both take those
    jobs.

    One transaction: for each job (locked, in id order, a chunk of
    ``RECALL_CHUNK_SIZE`` per statement), its run so far is kept as a
    ``JobRun`` (status, result, flags, error, attempts, requirement, worker,
    finish, its last ledger row); the job goes back to queued with fresh
    attempts, no result, the new requirement and the next run number; the item
    to queued, its flags cleared, the counters (flag counts too) shifted
    (``move_jobs``). Then the batch, locked last as every transition locks
    it and held to the commit, is reopened if it had finished (it finishes
    again, with a new ``batch.finished`` event, when the re-run items end),
    and one event says who re-ran how many items and with which requirement.
    A cancel committed before that lock refuses the whole re-run
    (BatchClosed, nothing written); one after it cancels the queued items."""
    with transaction.atomic():
        batch = Batch.objects.filter(pk=batch_id).only("cancelled_at", "requires").get()
        if batch.cancelled_at is not None:
            raise BatchClosed(batch_id, "cancelled")
        clash = {
            key: value
            for key, value in requires.items()
            if key in batch.requires and batch.requires[key] != value
        }
        if clash:
            # No worker could take such a job: refused rather than stranded.
            raise LabelError(
                f"requires {format_pairs(clash)}: the batch requires "
                f"{format_pairs({k: batch.requires[k] for k in clash})}, and no "
                f"worker can offer both"
            )
        if items is not None:
            wanted = sorted(set(items))
            found = {
                item_id: (pk, status, item_status)
                for item_id, pk, status, item_status in Job.objects.filter(
                    batch_id=batch_id, item_id__in=wanted
                ).values_list("item_id", "pk", "status", "item__status")
            }
            missing = [i for i in wanted if i not in found]
            busy = {
                item_id: item_status
                for item_id, (_, status, item_status) in found.items()
                if status not in RERUNNABLE
            }
            if missing or busy:
                raise RerunRefused(batch_id, missing=missing, busy=busy)
            ids = sorted(pk for pk, _, _ in found.values())
        elif flag is not None:
            flagged = BatchItem.objects.filter(
                batch_id=batch_id, **{FLAG_COLUMNS[flag]: True}
            ).values("pk")
            ids = sorted(
                Job.objects.filter(item_id__in=flagged).values_list("pk", flat=True)
            )
        else:
            raise ValueError("a re-run names items or a flag")
        total = 0
        chunk = settings.RECALL_CHUNK_SIZE
        for start in range(0, len(ids), chunk):
            jobs = list(
                Job.objects.filter(pk__in=ids[start : start + chunk])
                .locked()
                .order_by("pk")
            )
            if items is not None:  # checked again under the locks
                busy = {
                    j.item_id: j.item.status for j in jobs if j.status not in RERUNNABLE
                }
                if busy:
                    raise RerunRefused(batch_id, busy=busy)
            # A flag's items that a concurrent re-run already sent back.
            jobs = [
                j
                for j in jobs
                if j.status in RERUNNABLE and (flag is None or flag in j.item.flags)
            ]
            _start_runs(jobs, requires=requires, now=now, actor=actor)
            total += len(jobs)
        if total:
            # The batch row's lock, after the counters (every transition locks
            # batches last), held to the commit: a finish check (which takes
            # it too) waits and then sees the items queued, and a cancel that
            # came first is seen (the whole re-run is refused then).
            cancelled, finished = (
                Batch.objects.select_for_update(no_key=True)
                .filter(pk=batch_id)
                .values_list("cancelled_at", "finished_at")
                .get()
            )
            if cancelled is not None:
                raise BatchClosed(batch_id, "cancelled")
            reopened = finished is not None
            if reopened:
                Batch.objects.filter(pk=batch_id).update(finished_at=None)
                rejoin_share([batch_id])
            need = format_pairs(requires)
            record_event(
                Event.Kind.RERUN,
                f"Re-ran {total} item{'s' * (total != 1)}"
                + (f" with flag {flag}" if flag is not None else "")
                + (f", requiring {need}" if need else ", with no requirement")
                + (" (the batch is running again)." if reopened else "."),
                at=now,
                batch_id=batch_id,
                actor=actor,
            )
    return total


def _start_runs(
    jobs: Sequence[Job], *, requires: dict[str, str], now: datetime, actor: Any
) -> None:
    """Keep each locked job's run so far (``JobRun``) and queue it as a new one."""
    if not jobs:
        return
    pks = [j.pk for j in jobs]
    last: dict[int, int] = dict(
        Lease.objects.filter(job_id__in=pks)
        .values("job_id")
        .annotate(last=Max("pk"))
        .values_list("job_id", "last")
        .order_by()
    )
    ran_by: dict[int, int] = dict(
        Lease.objects.filter(pk__in=last.values()).values_list("pk", "worker")
    )
    JobRun.objects.bulk_create(
        JobRun(
            job_id=j.pk,
            number=j.run,
            status=j.status,
            result=j.result,
            error=j.last_error,
            flags=j.item.flags,
            attempts=j.attempts,
            requires=j.requires or {},
            worker_id=ran_by.get(last.get(j.pk, 0)),
            finished_at=j.finished_at,
            last_lease_id=last.get(j.pk),
            rerun_at=now,
            rerun_by=actor,
        )
        for j in jobs
    )
    groups = group_by(jobs, "status")
    for group in groups.values():
        move_jobs(
            group,
            to=JobStatus.QUEUED,
            now=now,
            attempts=0,
            result=None,
            last_error="",
            requires=requires,
        )
    Job.objects.filter(pk__in=pks).update(run=F("run") + 1)
    for j in jobs:
        j.run += 1
    # Finished once, and counted so: the totals only ever grow.
    add_tally("jobs_failed_retried", len(groups.get(JobStatus.FAILED, [])))
    add_tally(COMPLETED_RERUN, len(groups.get(JobStatus.COMPLETED, [])))


def _in_chunks(
    jobs: JobQuerySet,
    status: str,
    change: Callable[[list[Job]], None],
    audit: Audit | None,
    *,
    now: datetime,
) -> int:
    """Apply ``change`` to ``jobs`` in ``status``, one locked chunk per
    transaction (keyset on id, SKIP LOCKED: rows a transition holds now are
    skipped); ``audit`` runs in the same transaction. Returns how many."""
    total, after = 0, 0
    while True:
        with finishing(now):
            chunk = list(
                jobs.filter(status=status, pk__gt=after)
                .locked(skip_locked=True)
                .order_by("pk")[: settings.RECALL_CHUNK_SIZE]
            )
            if not chunk:
                return total
            change(chunk)
            if audit is not None:
                audit(chunk)
        total += len(chunk)
        after = chunk[-1].pk
