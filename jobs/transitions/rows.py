"""The ORM backend's building blocks: each writes one kind of row, inside the
caller's transaction, for jobs the caller has locked.

A transition is a few of these in one ``transaction.atomic()`` (or
``outbox.finishing()``, when an item may enter a final status and so finish its
batch): ``move_jobs`` (the jobs, their ledger rows, items, counters and
throughput buckets together), ``open_lease``, and the event log. Each fact is
written once here: the counter shift (``shift_counters``), the throughput
upsert (``record_finished``), the job-to-item status mapping
(``jobs.models.item_status_for``). The PostgreSQL backend writes the same facts
in its statements (``statements.py``); the differential test proves the two
write the same rows.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import F, Min, OuterRef, Subquery, Value
from django.db.models.functions import Coalesce, Greatest

from batches.flags import FLAG_COLUMNS, columns_for
from batches.models import (
    COUNTER_SHARDS,
    TERMINAL_ITEM_STATUSES,
    VIRTUAL_TIME_STRIDE,
    Batch,
    BatchCounter,
    BatchItem,
    BatchMinute,
    ItemStatus,
)
from jobs.models import (
    TERMINAL_JOB_STATUSES,
    Event,
    Job,
    JobStatus,
    Lease,
    LeaseEnd,
    RepairKind,
    Tally,
    Worker,
    item_status_for,
)

from . import outbox
from .rules import lease_duration

log = logging.getLogger("recall.transitions")


class InvalidMove(ValueError):
    """A transition asked for a move the rows cannot make (a bug, not bad input)."""


@dataclass(frozen=True)
class ItemMove:
    """One item changing status; the counters shift by one item and its duration,
    and by its quality flags (``batches.flags``) where they change."""

    item_id: int
    batch_id: int
    old: str
    new: str
    ms: int = 0
    old_flags: tuple[str, ...] = ()
    new_flags: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        return self.old != self.new or self.old_flags != self.new_flags


# --- Jobs, their items and ledger rows -------------------------------------------


def move_jobs(
    jobs: Sequence[Job],
    *,
    to: str,
    now: datetime,
    lease_end: str | None = None,
    error: str = "",
    refund_attempt: bool = False,
    flags: Sequence[str] | None = None,
    **fields: Any,
) -> None:
    """Move locked ``jobs`` (all in the same status) to status ``to``.

    Writes the jobs, closes their ledger rows (if they were leased, with reason
    ``lease_end``), and moves their items, the counters and the throughput
    buckets. ``flags``: a completion's quality flags, for its items. ``fields``
    are further job fields to set. Updates the instances.
    """
    if not jobs:
        return
    was = jobs[0].status
    if any(job.status != was for job in jobs):
        raise InvalidMove("move_jobs moves jobs of one status at a time")
    if was == JobStatus.LEASED:
        if lease_end is None:
            raise InvalidMove("a lease that ends needs a reason")
        close_leases(jobs, reason=lease_end, now=now, error=error)
    values: dict[str, Any] = {"status": to, "updated_at": now, **fields}
    if was == JobStatus.LEASED:
        values.update(lease_token=None, leased_by=None, lease_expires_at=None)
    if to == JobStatus.QUEUED:
        values.setdefault("available_at", now)
        values["finished_at"] = None
    elif to in TERMINAL_JOB_STATUSES:
        values["finished_at"] = now
    if to == JobStatus.CANCELLED:
        # A cancelled job will not run: a re-run's requirement no longer
        # applies to anything (its run is cancelled; JobRun keeps the ones before).
        values["requires"] = {}
    update = dict(values)
    if refund_attempt:
        update["attempts"] = F("attempts") - 1
    Job.objects.filter(pk__in=[job.pk for job in jobs]).update(**update)
    for job in jobs:
        for name, value in values.items():
            setattr(job, name, value)
        if refund_attempt:
            job.attempts -= 1
    move_items(jobs, was=was, to=to, now=now, flags=flags)
    if to == JobStatus.FAILED:
        outbox.items_failed(jobs, now=now)


def move_items(
    jobs: Sequence[Job],
    *,
    was: str,
    to: str,
    now: datetime,
    flags: Sequence[str] | Mapping[int, Sequence[str]] | None = None,
) -> None:
    """Bring the items of ``jobs`` to the status that agrees with ``to``.

    ``was`` is the jobs' status before this transition; an item that did not
    agree with it had drifted: the repair is logged and the batch recounted.
    Only done items have quality flags: ``flags`` when given (a completion's;
    a mapping of job id to flags: each job's own, a batched completion's),
    else those they had; an item that is not done has none.
    """
    expected, new = item_status_for(was), item_status_for(to)
    moves, drifted = [], set()
    for job in jobs:
        item = job.item
        if item.status != expected:
            record_repair(
                job,
                f"Item was {item.status} while its job was {was}; set to {new}.",
                kind=RepairKind.ITEM_DRIFT,
                at=now,
            )
            drifted.add(job.batch_id)
        had = tuple(item.flags)
        if new != ItemStatus.DONE:
            kept: tuple[str, ...] = ()
        else:
            chosen = flags.get(job.pk) if isinstance(flags, Mapping) else flags
            kept = had if chosen is None else tuple(sorted(chosen))
        moves.append(
            ItemMove(
                item.pk,
                job.batch_id,
                item.status,
                new,
                item.duration_ms or 0,
                old_flags=had,
                new_flags=kept,
            )
        )
        item.status = new
        for column, value in columns_for(kept).items():
            setattr(item, column, value)
    apply_item_moves(moves, now=now)
    if drifted:
        # Whatever changed the item may have bypassed the counters too.
        Batch.objects.filter(pk__in=drifted).update(recount_requested_at=now)


def apply_item_moves(moves: Iterable[ItemMove], *, now: datetime) -> None:
    """Write the items' new statuses (and flags), shift the counters and count
    the finishes."""
    moves = [m for m in moves if m.changes]
    by_new: dict[tuple[str, tuple[str, ...] | None], list[int]] = defaultdict(list)
    for move in moves:
        flags = move.new_flags if move.new_flags != move.old_flags else None
        by_new[(move.new, flags)].append(move.item_id)
    for (status, flags), ids in by_new.items():
        more = {} if flags is None else columns_for(flags)
        BatchItem.objects.filter(pk__in=ids).update(
            status=status, updated_at=now, **more
        )
    shift_counters(moves)
    record_finished([m for m in moves if m.old != m.new], now=now)
    # An item entering a final status may have finished its batch: checked at
    # the end of the transition (outbox.finishing).
    outbox.may_finish(
        m.batch_id
        for m in moves
        if m.new in TERMINAL_ITEM_STATUSES and m.old not in TERMINAL_ITEM_STATUSES
    )


def shift_counters(moves: Iterable[ItemMove]) -> None:
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
        for flag in m.old_flags:
            delta[FLAG_COLUMNS[flag]] -= 1
        for flag in m.new_flags:
            delta[FLAG_COLUMNS[flag]] += 1
    for (batch_id, shard), delta in sorted(deltas.items()):
        changes = {column: F(column) + d for column, d in delta.items() if d}
        if changes:
            BatchCounter.objects.filter(batch_id=batch_id, shard=shard).update(
                **changes
            )


def record_finished(moves: Iterable[ItemMove], *, now: datetime) -> None:
    """Count the moves that finish items (done or failed) in ``now``'s minute.

    One upsert per (batch, shard), after the counters (the same lock order
    everywhere: no deadlock).
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


def open_lease(job: Job, worker: Worker, *, token: str, now: datetime) -> None:
    """queued -> leased for this locked job: job, item, counters, new ledger row."""
    was = job.status
    job.status = JobStatus.LEASED
    job.lease_token = token
    job.leased_by = worker
    job.lease_expires_at = now + lease_duration()
    job.heartbeat_at = now
    job.attempts += 1
    job.updated_at = now
    job.save(
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
    move_items([job], was=was, to=job.status, now=now)
    Lease.objects.create(
        job=job,
        worker=worker,
        token=token,
        attempt=job.attempts,
        claimed_at=now,
        heartbeat_at=now,
        expires_at=job.lease_expires_at,
    )


def close_leases(
    jobs: Sequence[Job], *, reason: str, now: datetime, error: str = ""
) -> None:
    """Close the open ledger rows of the live leases of ``jobs``.

    Call it before the jobs' lease fields are cleared. A live lease whose row
    is missing or already closed is drift: the row is written (closed) or left
    as it is, and the repair logged, so the history shows every attempt.
    """
    if reason not in LeaseEnd.values:
        raise InvalidMove(f"{reason!r} is not a way a lease ends")
    tokens = [job.lease_token for job in jobs]
    closed = Lease.objects.filter(token__in=tokens, ended_at__isnull=True).update(
        ended_at=now, end_reason=reason, error=error
    )
    if reason == LeaseEnd.FORCED:
        add_tally("leases_forced", closed)
    if closed == len(tokens):
        return
    rows = dict(Lease.objects.filter(token__in=tokens).values_list("token", "ended_at"))
    for job in jobs:
        if job.lease_token is None or job.leased_by_id is None:
            raise InvalidMove(f"job {job.pk} has no live lease to close")
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
            record_repair(
                job,
                "The live lease had no ledger row; wrote it, closed.",
                kind=RepairKind.LEDGER_ROW_WRITTEN,
                at=now,
            )
        elif rows[job.lease_token] != now:
            record_repair(
                job,
                "The live lease's ledger row was already closed.",
                kind=RepairKind.LEDGER_ROW_CLOSED_EARLY,
                at=now,
            )


# --- Fair share ------------------------------------------------------------------


def charge_share(batch_id: int) -> None:
    """The batch won a claim over another open batch of its priority: its
    virtual time grows by its stride (less, the heavier it is)."""
    Batch.objects.filter(pk=batch_id).update(
        virtual_time=F("virtual_time") + Value(VIRTUAL_TIME_STRIDE) / F("weight")
    )


def rejoin_share(batch_ids: Iterable[int]) -> None:
    """Batches that (re)join the rotation (new, resumed, reopened, moved to
    another priority) start no earlier than the open batches of their priority
    are now, so they cannot claim their way back over time they were away."""
    others = (
        Batch.objects.open()
        .filter(priority=OuterRef("priority"))
        .exclude(pk=OuterRef("pk"))
        .order_by()
        .values("priority")
        .annotate(least=Min("virtual_time"))
        .values("least")
    )
    Batch.objects.filter(pk__in=list(batch_ids)).update(
        virtual_time=Greatest(
            F("virtual_time"), Coalesce(Subquery(others), F("virtual_time"))
        )
    )


# --- The event log and tallies ---------------------------------------------------


def record_event(
    kind: str,
    message: str,
    *,
    at: datetime,
    job: Job | None = None,
    batch_id: int | None = None,
    actor: Any = None,
) -> Event:
    """One event, stamped with the transition's time (the database's clock)."""
    if batch_id is None and job is not None:
        batch_id = job.batch_id
    return Event.objects.create(
        created_at=at,
        kind=kind,
        job=job,
        batch_id=batch_id,
        actor=actor,
        message=message,
    )


def record_events(
    jobs: Sequence[Job], kind: str, message: str, *, at: datetime, actor: Any
) -> None:
    """One event per job (an operator's or admin's action on each)."""
    Event.objects.bulk_create(
        Event(
            created_at=at,
            kind=kind,
            job=job,
            batch_id=job.batch_id,
            actor=actor,
            message=message,
        )
        for job in jobs
    )


def record_repair(
    job: Job | None,
    message: str,
    *,
    kind: RepairKind,
    at: datetime,
    batch_id: int | None = None,
) -> Event:
    """Log a reconciliation repair: an event row, a WARNING line, and the tally
    of repairs of this ``kind`` (the metric operators alert on)."""
    if batch_id is None and job is not None:
        batch_id = job.batch_id
    log.warning(
        "repair: job=%s batch=%s: %s",
        job.pk if job else "-",
        batch_id,
        message,
        extra={"job": job.pk if job else None, "batch": batch_id},
    )
    add_tally(kind.tally, 1)
    return record_event(Event.Kind.REPAIR, message, at=at, job=job, batch_id=batch_id)


def add_tally(name: str, n: int) -> None:
    """Add ``n`` to the tally ``name`` (an upsert: atomic, no read first)."""
    if n <= 0:
        return
    table = Tally._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (name, count) VALUES (%s, %s) "
            f"ON CONFLICT (name) DO UPDATE SET count = {table}.count + excluded.count",
            [name, n],
        )


def lost_detail(job_id: int) -> str:
    return (
        f"Job {job_id} is not leased to this worker under this token: the lease "
        f"ended (completed, failed, released, reclaimed or cancelled) or the token "
        f"is wrong."
    )


def log_lease(
    what: str, job: Job, *, worker_id: int | None, attempt: int | None = None
) -> None:
    """One INFO line per lease transition, with the ids a job's life is
    followed by (``LOG_FORMAT=json`` puts them in fields of their own)."""
    if not log.isEnabledFor(logging.INFO):
        return  # LOG_LEVEL=WARNING: not even the fields are gathered
    attempt = job.attempts if attempt is None else attempt
    log.info(
        "%s: job=%s attempt=%s worker=%s batch=%s",
        what,
        job.pk,
        attempt,
        worker_id,
        job.batch_id,
        extra={
            "job": job.pk,
            "attempt": attempt,
            "worker": worker_id,
            "batch": job.batch_id,
        },
    )


def group_by(jobs: Iterable[Job], attribute: str) -> dict[Any, list[Job]]:
    groups: dict[Any, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[getattr(job, attribute)].append(job)
    return groups
