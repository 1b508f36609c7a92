"""The clean case of the two hot transitions, claim and complete, as PostgreSQL SQL.

A worker's claim and complete run thousands of times a minute. Through the ORM
each is seven or eight statements, and building them costs more CPU than
PostgreSQL spends running them (see BENCHMARKS.md). Here each is two: one that
locks the rows and reads everything the transition needs to know, and one that
writes every row together (job, item, counter shard, ledger row, throughput
minute). They write exactly what ``Job._start_lease`` and ``Job._move`` write.

These functions only handle the clean case, where the rows agree with each
other. When the first statement shows anything else (an item whose status has
drifted, a live lease without its open ledger row), the caller falls back to the
ORM code in ``jobs/models.py``, which heals and logs the drift. Both statements
run in the caller's transaction, after which nothing of it is half-written.
"""

from __future__ import annotations

import json
from datetime import datetime

import psycopg
from django.db import connection

from batches.models import COUNTER_SHARDS, Batch, BatchItem, ItemStatus

from .models import Job, JobStatus, LeaseEnd, Worker, lease_duration

JOB_COLUMNS = [f.attname for f in Job._meta.concrete_fields]
ITEM_COLUMNS = [f.attname for f in BatchItem._meta.concrete_fields]

# What a claim must do before it takes a job: reclaim expired leases, finish an
# interrupted batch cancel. Each EXISTS is a probe of a partial index that is
# empty unless there is something to do.
CHORES = """
    SELECT EXISTS (SELECT 1 FROM jobs_job
                   WHERE status = 'leased' AND lease_expires_at < %(now)s),
           EXISTS (SELECT 1 FROM batches_batch
                   WHERE cancelled_at IS NOT NULL AND finished_at IS NULL
                     AND cancelled_at < %(cancelled_before)s)
"""

# The open batches with a claimable job, by priority. LATERAL ... LIMIT 1 keeps
# it one index probe per batch: as a plain EXISTS, the planner may turn it into
# a hash join over every queued job of every batch.
CANDIDATES = """
    SELECT b.id FROM batches_batch b
    CROSS JOIN LATERAL (
        SELECT 1 FROM jobs_job j
        WHERE j.batch_id = b.id AND j.status = 'queued'
          AND j.available_at <= %(now)s AND j.attempts < j.max_attempts
        ORDER BY j.id LIMIT 1
    ) AS claimable
    WHERE b.paused_at IS NULL AND b.cancelled_at IS NULL AND b.finished_at IS NULL
    ORDER BY b.priority DESC, b.id LIMIT %(limit)s
"""

LOCK_CLAIMABLE = f"""
    SELECT {", ".join(f"j.{c}" for c in JOB_COLUMNS)},
           {", ".join(f"i.{c}" for c in ITEM_COLUMNS)}, b.name
    FROM jobs_job j
    JOIN batches_batchitem i ON i.id = j.item_id
    JOIN batches_batch b ON b.id = j.batch_id
    WHERE j.batch_id = %(batch)s AND j.status = 'queued'
      AND j.available_at <= %(now)s AND j.attempts < j.max_attempts
      AND b.paused_at IS NULL AND b.cancelled_at IS NULL
    ORDER BY j.id LIMIT 1
    FOR NO KEY UPDATE OF j, i SKIP LOCKED
"""

START_LEASE = """
    WITH job AS (
        UPDATE jobs_job SET status = 'leased', lease_token = %(token)s,
            leased_by_id = %(worker)s, lease_expires_at = %(expires)s,
            heartbeat_at = %(now)s, attempts = %(attempt)s, updated_at = %(now)s
        WHERE id = %(job)s
    ), item AS (
        UPDATE batches_batchitem SET status = 'transcribing', updated_at = %(now)s
        WHERE id = %(item)s
    ), counter AS (
        UPDATE batches_batchcounter SET queued = queued - 1,
            transcribing = transcribing + 1, queued_ms = queued_ms - %(ms)s,
            transcribing_ms = transcribing_ms + %(ms)s
        WHERE batch_id = %(batch)s AND shard = %(shard)s
    )
    INSERT INTO jobs_lease (job_id, worker_id, token, attempt, claimed_at,
                            heartbeat_at, expires_at, error)
    VALUES (%(job)s, %(worker)s, %(token)s, %(attempt)s, %(now)s, %(now)s,
            %(expires)s, '')
"""

LOCK_LEASED = """
    SELECT j.item_id, j.batch_id, i.status, i.duration_ms, l.id
    FROM jobs_job j
    JOIN batches_batchitem i ON i.id = j.item_id
    LEFT JOIN jobs_lease l ON l.token = j.lease_token AND l.ended_at IS NULL
    WHERE j.id = %(job)s AND j.status = 'leased' AND j.lease_token = %(token)s
      AND j.leased_by_id = %(worker)s
    FOR NO KEY UPDATE OF j, i
"""

# The counter shard is updated before the minute row (the main statement reads
# from ``counter``), the order every transition takes: no deadlock.
FINISH = """
    WITH job AS (
        UPDATE jobs_job SET status = 'completed', result = %(result)s::jsonb,
            lease_token = NULL, leased_by_id = NULL, lease_expires_at = NULL,
            finished_at = %(now)s, updated_at = %(now)s
        WHERE id = %(job)s
    ), lease AS (
        UPDATE jobs_lease SET ended_at = %(now)s, end_reason = 'completed', error = ''
        WHERE id = %(lease)s
    ), item AS (
        UPDATE batches_batchitem SET status = 'done', updated_at = %(now)s
        WHERE id = %(item)s
    ), counter AS (
        UPDATE batches_batchcounter SET transcribing = transcribing - 1,
            done = done + 1, transcribing_ms = transcribing_ms - %(ms)s,
            done_ms = done_ms + %(ms)s
        WHERE batch_id = %(batch)s AND shard = %(shard)s
        RETURNING batch_id
    )
    INSERT INTO batches_batchminute
        (batch_id, minute, shard, done, done_ms, failed, failed_ms)
    SELECT batch_id, %(minute)s, %(shard)s, 1, %(ms)s, 0, 0 FROM counter
    ON CONFLICT (batch_id, minute, shard) DO UPDATE SET
        done = batches_batchminute.done + 1,
        done_ms = batches_batchminute.done_ms + excluded.done_ms
"""

assert LeaseEnd.COMPLETED == "completed" and ItemStatus.DONE == "done"


def _cursor() -> psycopg.Cursor:
    """A cursor with server-side binding on Django's connection, so that each
    statement here is prepared once per connection and then only executed
    (Django's own cursors bind client-side: every query is planned anew)."""
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


def _execute(cursor: psycopg.Cursor, sql: str, params: dict) -> None:
    # Errors surface as Django's (IntegrityError, OperationalError...), as from
    # any other query.
    with connection.wrap_database_errors:
        cursor.execute(sql, params, prepare=True)


def claim_chores(now: datetime, cancelled_before: datetime) -> tuple[bool, bool]:
    """(any lease expired?, any batch cancel unfinished since before then?)"""
    with _cursor() as cursor:
        _execute(cursor, CHORES, {"now": now, "cancelled_before": cancelled_before})
        return cursor.fetchone()


def candidate_batches(now: datetime, limit: int) -> list[int]:
    """Up to ``limit`` open batches that have a claimable job, by priority."""
    with _cursor() as cursor:
        _execute(cursor, CANDIDATES, {"now": now, "limit": limit})
        return [row[0] for row in cursor.fetchall()]


def lock_claimable(batch_id: int, now: datetime) -> Job | None:
    """The batch's next claimable job, locked with its item (SKIP LOCKED), with
    ``item`` and ``batch`` loaded: what the claim and its response need."""
    with _cursor() as cursor:
        _execute(cursor, LOCK_CLAIMABLE, {"batch": batch_id, "now": now})
        row = cursor.fetchone()
    if row is None:
        return None
    n = len(JOB_COLUMNS)
    job = _from_db(Job, row[:n])
    item = _from_db(BatchItem, row[n : n + len(ITEM_COLUMNS)])
    job.item = item
    job.batch = Batch(pk=job.batch_id, name=row[-1])
    return job


def start_lease(job: Job, worker: Worker, *, token: str, now: datetime) -> bool:
    """queued -> leased for a job ``lock_claimable`` returned, if its item agrees
    (else False, nothing written: the ORM path heals it). Updates ``job``."""
    item = job.item
    if item.status != ItemStatus.QUEUED:
        return False
    job.status = JobStatus.LEASED
    job.lease_token, job.leased_by = token, worker
    job.lease_expires_at = now + lease_duration()
    job.heartbeat_at = job.updated_at = now
    job.attempts += 1
    ms = item.duration_ms or 0
    with _cursor() as cursor:
        _execute(
            cursor,
            START_LEASE,
            {
                "job": job.pk,
                "item": item.pk,
                "batch": job.batch_id,
                "shard": item.pk % COUNTER_SHARDS,
                "worker": worker.pk,
                "token": token,
                "expires": job.lease_expires_at,
                "attempt": job.attempts,
                "ms": ms,
                "now": now,
            },
        )
    item.status = ItemStatus.TRANSCRIBING
    item.updated_at = now
    return True


def complete(
    job_id: int, lease_token: str, worker: Worker, *, result: dict, now: datetime
) -> bool | None:
    """leased -> completed under this lease. None: the lease is not live (nothing
    locked). False: the rows disagree (locked, nothing written: the ORM path
    heals). True: done."""
    with _cursor() as cursor:
        _execute(
            cursor,
            LOCK_LEASED,
            {"job": job_id, "token": lease_token, "worker": worker.pk},
        )
        row = cursor.fetchone()
        if row is None:
            return None
        item_id, batch_id, item_status, ms, lease_id = row
        if item_status != ItemStatus.TRANSCRIBING or lease_id is None:
            return False
        _execute(
            cursor,
            FINISH,
            {
                "job": job_id,
                "lease": lease_id,
                "item": item_id,
                "batch": batch_id,
                "shard": item_id % COUNTER_SHARDS,
                "ms": ms or 0,
                "result": json.dumps(result),
                "minute": now.replace(second=0, microsecond=0),
                "now": now,
            },
        )
    return True


def _from_db(model, values):
    """A model instance from a row of its concrete columns, as the ORM builds it
    (``from_db`` plus the fields' converters: JSON arrives as text)."""
    fields = model._meta.concrete_fields
    values = [
        f.from_db_value(v, None, connection) if hasattr(f, "from_db_value") else v
        for f, v in zip(fields, values, strict=True)
    ]
    return model.from_db(connection.alias, [f.attname for f in fields], values)
