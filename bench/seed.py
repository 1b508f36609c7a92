"""Fill the tables fast for a benchmark, in states the invariants allow.

Benchmarks need a million finished jobs or ten thousand live leases in seconds,
not the hours real traffic takes, so this writes the rows with set-based SQL
(``generate_series``) instead of through the transitions. Every row it writes
agrees with the others exactly as the transitions would leave them: each item
has the status mapped from its job's, each leased job one open ledger row, each
completed job one ledger row ended ``completed``, and the counters are a fresh
recount. ``recall_check`` passes on a seeded database (the smoke test checks).
PostgreSQL only.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection, transaction

from batches.models import (
    COUNTER_COLUMNS,
    COUNTER_SHARDS,
    Batch,
    BatchCounter,
    BatchItem,
    BatchMinute,
)
from jobs import transitions
from jobs.models import (
    Event,
    Job,
    JobRun,
    Lease,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEvent,
    Worker,
)

ITEM_MS = 60_000  # every seeded item "lasts" a minute: the ETA is duration-weighted
# A done job's result (SQL; a literal % would be read as a placeholder).
SEEDED_RESULT = '\'{"text": "seeded by the benchmark"}\'::jsonb'


def reset() -> None:
    """Empty every batch, item, job (and its earlier runs), ledger and event
    row, the intakes, the webhook outbox and the submissions' idempotency
    keys (workers stay)."""
    from batches.intake_records import Intake, IntakeChunk
    from operator_api.models import IdempotencyKey

    outbox = (WebhookAttempt, WebhookDelivery, WebhookEvent)
    tables = [
        m._meta.db_table
        for m in (
            *outbox,
            Event,
            Lease,
            JobRun,
            Job,
            BatchMinute,
            BatchCounter,
            IntakeChunk,
            Intake,
            IdempotencyKey,
        )
    ] + [BatchItem._meta.db_table, Batch._meta.db_table]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)}")


def workers(n: int, prefix: str = "bench") -> list[tuple[Worker, str]]:
    """``n`` fresh workers with their tokens (earlier ones of the same name go)."""
    found = []
    for i in range(n):
        name = f"{prefix}-{i}"
        existing = Worker.objects.filter(name=name).first()
        if existing is not None:
            found.append((existing, transitions.rotate_worker_token(existing)))
        else:
            found.append(transitions.create_worker(name))
    return found


def batch(
    name: str,
    *,
    now: datetime,
    queued: int = 0,
    completed: int = 0,
    leased: int = 0,
    lease_expires_at: datetime | None = None,
    worker: Worker | None = None,
    priority: int = 0,
    max_attempts: int = 3,
    analyze: bool = True,
    requires: dict[str, str] | None = None,
    done_result: str = SEEDED_RESULT,
) -> Batch:
    """One batch with ``completed`` done items, then ``leased`` in flight (held by
    ``worker`` until ``lease_expires_at``), then ``queued`` waiting; open only to
    workers whose labels meet ``requires`` (none: open to every worker).
    ``done_result``: the SQL of a done job's result (jsonb), which may name
    the item's row as ``i`` (a transcript of its own, row 22)."""
    total = queued + completed + leased
    if leased and (worker is None or lease_expires_at is None):
        raise ValueError("leased items need a worker and a lease expiry")
    expires = lease_expires_at or now
    with transaction.atomic(), connection.cursor() as cursor:
        _hold_statistics(cursor)
        b = Batch.objects.create(
            name=name,
            priority=priority,
            created_at=now - timedelta(hours=1),
            total=total,
            total_ms=total * ITEM_MS,
            durations_known=total > 0,
            requires=requires or {},
        )
        cursor.execute(
            f"""
            INSERT INTO {BatchItem._meta.db_table}
                (batch_id, source, params, duration_ms, status, created_at, updated_at)
            SELECT %(batch)s, 'bench/' || %(batch)s || '/' || n || '.wav', '{{}}',
                   %(ms)s,
                   CASE WHEN n <= %(done)s THEN 'done'
                        WHEN n <= %(done)s + %(leased)s THEN 'transcribing'
                        ELSE 'queued' END,
                   %(now)s, %(now)s
            FROM generate_series(1, %(total)s) AS n
            """,
            {
                "batch": b.pk,
                "ms": ITEM_MS,
                "done": completed,
                "leased": leased,
                "total": total,
                "now": now,
            },
        )
        cursor.execute(
            f"""
            INSERT INTO {Job._meta.db_table}
                (item_id, batch_id, status, attempts, max_attempts, lease_token,
                 leased_by_id, lease_expires_at, heartbeat_at, available_at, result,
                 last_error, created_at, updated_at, finished_at)
            SELECT i.id, i.batch_id,
                   CASE i.status WHEN 'done' THEN 'completed'
                                 WHEN 'transcribing' THEN 'leased' ELSE 'queued' END,
                   CASE i.status WHEN 'queued' THEN 0 ELSE 1 END,
                   %(max_attempts)s,
                   CASE i.status WHEN 'transcribing' THEN 'bench-' || i.id END,
                   CASE i.status WHEN 'transcribing' THEN %(worker)s::bigint END,
                   CASE i.status WHEN 'transcribing' THEN %(expires)s END,
                   CASE i.status WHEN 'transcribing' THEN %(now)s END,
                   %(now)s,
                   CASE i.status WHEN 'done' THEN {done_result} END,
                   '', %(now)s, %(now)s,
                   CASE i.status WHEN 'done' THEN %(now)s END
            FROM {BatchItem._meta.db_table} i WHERE i.batch_id = %(batch)s
            """,
            {
                "batch": b.pk,
                "max_attempts": max_attempts,
                "worker": worker.pk if worker else None,
                "expires": expires,
                "now": now,
            },
        )
        cursor.execute(
            f"""
            INSERT INTO {Lease._meta.db_table}
                (job_id, worker_id, token, attempt, claimed_at, heartbeat_at,
                 expires_at, ended_at, end_reason, error)
            SELECT j.id, %(worker)s, COALESCE(j.lease_token, 'bench-done-' || j.id), 1,
                   %(now)s, %(now)s, COALESCE(j.lease_expires_at, %(now)s),
                   CASE j.status WHEN 'completed' THEN %(now)s END,
                   CASE j.status WHEN 'completed' THEN 'completed' END, ''
            FROM {Job._meta.db_table} j
            WHERE j.batch_id = %(batch)s AND j.status IN ('completed', 'leased')
            """,
            {"batch": b.pk, "worker": (worker or _seed_worker()).pk, "now": now},
        )
    _count(b.pk)
    if not (queued or leased):
        Batch.objects.filter(pk=b.pk).update(finished_at=now)
    if analyze:  # fresh statistics for the planner (once, after many batches)
        with connection.cursor() as cursor:
            for model in (BatchItem, Job, Lease, Batch):
                cursor.execute(f"ANALYZE {model._meta.db_table}")
    return b


def _hold_statistics(cursor) -> None:
    """Keep VACUUM and ANALYZE (autovacuum's included) off the tables whose
    rows the seed's foreign keys are checked against, until its COMMIT.

    The foreign keys are deferred, so every row the seed inserts is checked at
    COMMIT, by a plan made then from the tables' statistics. An ANALYZE or
    VACUUM by another session while the seed's rows are not yet committed
    counts none of them: it records the table's pages with no rows in them,
    so the planner takes the table for empty, where every index costs the
    same, and may check ``item_id`` through ``item_batch_status (batch_id,
    status, id)``, walking the whole index for each job. That is quadratic: a
    300,000-item seed sat in its COMMIT for over 13 minutes instead of 10 s
    (docs/development/benchmark-history.md). Autovacuum skips a table held in
    SHARE UPDATE EXCLUSIVE mode, and waiting for one already at work costs at
    most ``deadlock_timeout`` (it is cancelled); inserts, updates and row locks
    by other sessions are not blocked by it."""
    cursor.execute(
        f"LOCK TABLE {Batch._meta.db_table}, {BatchItem._meta.db_table}, "
        f"{Job._meta.db_table} IN SHARE UPDATE EXCLUSIVE MODE"
    )


def _count(batch_id: int) -> None:
    """The batch's counter rows, as a fresh count of its items (the seed is not a
    repair, so it does not go through reconciliation's recount)."""
    counts = ", ".join(
        f"COALESCE(sum(i.duration_ms) FILTER (WHERE i.status = '{column[:-3]}'), 0)"
        if column.endswith("_ms")
        else f"count(i.id) FILTER (WHERE i.status = '{column}')"
        for column in COUNTER_COLUMNS
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {BatchCounter._meta.db_table}
                (batch_id, shard, {", ".join(COUNTER_COLUMNS)})
            SELECT %(batch)s, s.shard, {counts}
            FROM generate_series(0, {COUNTER_SHARDS - 1}) AS s(shard)
            LEFT JOIN {BatchItem._meta.db_table} i
                ON i.batch_id = %(batch)s AND mod(i.id, {COUNTER_SHARDS}) = s.shard
            GROUP BY s.shard
            """,
            {"batch": batch_id},
        )


def expire_leases(batch_id: int, *, at: datetime) -> int:
    """Make every live lease of the batch expire at ``at`` (a worker that died)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Job._meta.db_table} SET lease_expires_at = %s "
            f"WHERE batch_id = %s AND status = 'leased'",
            [at, batch_id],
        )
        expired = cursor.rowcount
        cursor.execute(
            f"UPDATE {Lease._meta.db_table} l SET expires_at = %s "
            f"FROM {Job._meta.db_table} j "
            f"WHERE l.job_id = j.id AND j.batch_id = %s AND l.ended_at IS NULL",
            [at, batch_id],
        )
    return expired


def _seed_worker() -> Worker:
    worker = Worker.objects.filter(name="bench-seed").first()
    if worker is None:
        worker, _ = transitions.create_worker("bench-seed")
    return worker
