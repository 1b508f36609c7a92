"""The hot path in PostgreSQL SQL: claim, complete, reclaim chunk, worker auth.

A worker's claim and complete run thousands of times a minute. Through the ORM
a claim plus a complete is about fifteen statements, each built in Python and
planned anew, and that cost more than PostgreSQL spent running them (see
BENCHMARKS.md). Here each transition is one statement, prepared once per
connection: it locks the rows, checks that they agree with each other, and only
then writes them all together (job, item, counter shard, ledger row, and on
completion the throughput minute), exactly what ``Job._start_lease`` and
``Job._move`` write. A claim also looks at what to do first (expired leases,
an unfinished cancel) and where to look for work in the same statement; a
reclaim chunk does for up to 500 expired leases what ``_move`` does for them.

A single statement is atomic by itself, so these run without a transaction
block of their own (no BEGIN and COMMIT round trips), or inside the caller's.
Only the clean case is handled here. When the rows disagree (an item whose
status drifted, a live lease without its open ledger row), the statement writes
nothing and says so; the caller then runs the ORM code in ``jobs/models.py``,
which locks the rows again, heals and logs the drift. That code is the
reference: this module must write what it writes, and the tests run both
(SQLite has only the ORM path).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from datetime import datetime

import psycopg
from django.conf import settings
from django.db import IntegrityError, connection, transaction

from batches.models import COUNTER_SHARDS, Batch, BatchItem, ItemStatus

from .models import Job, JobStatus, LeaseEnd, Worker, lease_duration

# psycopg's default: prepare a statement on its fifth execution (``prepare=True``
# below prepares ours at once).
PREPARE_THRESHOLD = 5

WORKER_COLUMNS = [f.column for f in Worker._meta.concrete_fields]
JOB_COLUMNS = [f.column for f in Job._meta.concrete_fields]
ITEM_COLUMNS = [f.column for f in BatchItem._meta.concrete_fields]

# Every API request authenticates its worker by the token's clear prefix.
WORKERS_WITH_PREFIX = f"""
    SELECT {", ".join(WORKER_COLUMNS)} FROM jobs_worker WHERE token_prefix = %(prefix)s
"""

# Before a claim: is there an expired lease to reclaim, an interrupted cancel to
# finish (each a probe of a partial index that is empty unless so), and which
# open batches have a claimable job, by priority. The LATERAL ... LIMIT 1 keeps
# that one probe of the claim index per batch (as a plain EXISTS the planner may
# hash-join every queued job of every batch).
#
# Claims take jobs in (created_at, id) order, the claim index's: within a batch
# that is the order of the manifest, as by id alone, but the primary key cannot
# produce it. Ordered by id, PostgreSQL may walk the primary key instead, past
# every finished job of the table, when its statistics say most jobs are queued
# (as they do after a big intake): a claim then costs as much as a table scan.
CHORES = """EXISTS (
    SELECT 1 FROM jobs_job WHERE status = 'leased' AND lease_expires_at < %(now)s
)"""
CANCELLING = """EXISTS (
    SELECT 1 FROM batches_batch
    WHERE cancelled_at IS NOT NULL AND finished_at IS NULL
      AND cancelled_at < %(cancelled_before)s
)"""
CLAIMABLE_IN_B = """
    SELECT 1 FROM jobs_job j
    WHERE j.batch_id = b.id AND j.status = 'queued'
      AND j.available_at <= %(now)s AND j.attempts < j.max_attempts
    ORDER BY j.created_at, j.id LIMIT 1
"""
CLAIM_PLAN = f"""
    SELECT {CHORES}, {CANCELLING},
        ARRAY(
            SELECT b.id FROM batches_batch b
            CROSS JOIN LATERAL ({CLAIMABLE_IN_B}) AS claimable
            WHERE b.paused_at IS NULL AND b.cancelled_at IS NULL
              AND b.finished_at IS NULL
            ORDER BY b.priority DESC, b.id LIMIT %(limit)s
        )
"""


# queued -> leased for the batch's oldest claimable job (SKIP LOCKED), if its
# item agrees and no ledger row of an earlier lease was left open. Returns the
# job's and item's columns as they were, the batch's name (what the caller and
# the claim response need), and whether such a stray ledger row exists.
def _claim_sql(*, prelude: str = "", batch: str, result: str) -> str:
    return f"""
    WITH {prelude} pick AS (
        SELECT {", ".join(f"j.{c} AS j_{c}" for c in JOB_COLUMNS)},
               {", ".join(f"i.{c} AS i_{c}" for c in ITEM_COLUMNS)},
               b.name AS batch_name,
               EXISTS (SELECT 1 FROM jobs_lease l
                       WHERE l.job_id = j.id AND l.ended_at IS NULL) AS stray_lease
        FROM jobs_job j
        JOIN batches_batchitem i ON i.id = j.item_id
        JOIN batches_batch b ON b.id = j.batch_id
        WHERE j.batch_id = {batch} AND j.status = 'queued'
          AND j.available_at <= %(now)s AND j.attempts < j.max_attempts
          AND b.paused_at IS NULL AND b.cancelled_at IS NULL
        ORDER BY j.created_at, j.id LIMIT 1
        FOR NO KEY UPDATE OF j, i SKIP LOCKED
    ), clean AS (
        SELECT * FROM pick WHERE i_status = 'queued' AND NOT stray_lease
    ), job AS (
        UPDATE jobs_job SET status = 'leased', lease_token = %(token)s,
            leased_by_id = %(worker)s, lease_expires_at = %(expires)s,
            heartbeat_at = %(now)s, attempts = clean.j_attempts + 1,
            updated_at = %(now)s
        FROM clean WHERE jobs_job.id = clean.j_id
        RETURNING jobs_job.id, jobs_job.attempts
    ), item AS (
        UPDATE batches_batchitem SET status = 'transcribing', updated_at = %(now)s
        FROM clean WHERE batches_batchitem.id = clean.i_id
    ), counter AS (
        UPDATE batches_batchcounter c SET queued = c.queued - 1,
            transcribing = c.transcribing + 1,
            queued_ms = c.queued_ms - COALESCE(clean.i_duration_ms, 0),
            transcribing_ms = c.transcribing_ms + COALESCE(clean.i_duration_ms, 0)
        FROM clean
        WHERE c.batch_id = clean.j_batch_id
          AND c.shard = mod(clean.i_id, {COUNTER_SHARDS})
    ), lease AS (
        INSERT INTO jobs_lease (job_id, worker_id, token, attempt, claimed_at,
                                heartbeat_at, expires_at, error)
        SELECT id, %(worker)s, %(token)s, attempts, %(now)s, %(now)s,
               %(expires)s, ''
        FROM job
    )
    {result}
"""


CLAIM = _claim_sql(batch="%(batch)s", result="SELECT * FROM pick")

# The common case in one statement: nothing to do first, and the first open
# batch with a claimable job (by priority) has one no other claim holds. Returns
# the chores' flags, and the job as CLAIM does if there was one (else NULLs):
# when there is none, the caller takes the long way (CLAIM_PLAN, then CLAIM per
# candidate batch), which also covers chores and taken or drifted rows.
CLAIM_FIRST = _claim_sql(
    prelude=f"""
    chores AS (
        SELECT {CHORES} AS expired, {CANCELLING} AS cancelling
    ), first AS (
        SELECT b.id FROM batches_batch b
        CROSS JOIN LATERAL ({CLAIMABLE_IN_B}) AS claimable
        WHERE b.paused_at IS NULL AND b.cancelled_at IS NULL
          AND b.finished_at IS NULL
          AND NOT (SELECT expired OR cancelling FROM chores)
        ORDER BY b.priority DESC, b.id LIMIT 1
    ),""",
    batch="(SELECT id FROM first)",
    result="SELECT chores.*, (SELECT id FROM first), pick.* "
    "FROM chores LEFT JOIN pick ON true",
)

# leased -> completed under this lease, if the item and the ledger row agree.
# The counter shard is updated before the minute row (the minute insert reads
# from ``counter``), the order every transition takes: no deadlock. Returns the
# item's status and the open ledger row found (no row: the lease is not live).
COMPLETE = f"""
    WITH target AS (
        SELECT j.id, j.item_id, j.batch_id, i.status AS item_status,
               COALESCE(i.duration_ms, 0) AS ms, l.id AS lease_id
        FROM jobs_job j
        JOIN batches_batchitem i ON i.id = j.item_id
        LEFT JOIN jobs_lease l ON l.token = j.lease_token AND l.ended_at IS NULL
        WHERE j.id = %(job)s AND j.status = 'leased' AND j.lease_token = %(token)s
          AND j.leased_by_id = %(worker)s
        FOR NO KEY UPDATE OF j, i
    ), clean AS (
        SELECT * FROM target
        WHERE item_status = 'transcribing' AND lease_id IS NOT NULL
    ), job AS (
        UPDATE jobs_job SET status = 'completed', result = %(result)s::jsonb,
            lease_token = NULL, leased_by_id = NULL, lease_expires_at = NULL,
            finished_at = %(now)s, updated_at = %(now)s
        FROM clean WHERE jobs_job.id = clean.id
    ), lease AS (
        UPDATE jobs_lease SET ended_at = %(now)s, end_reason = 'completed',
            error = ''
        FROM clean WHERE jobs_lease.id = clean.lease_id
    ), item AS (
        UPDATE batches_batchitem SET status = 'done', updated_at = %(now)s
        FROM clean WHERE batches_batchitem.id = clean.item_id
    ), counter AS (
        UPDATE batches_batchcounter c SET transcribing = c.transcribing - 1,
            done = c.done + 1, transcribing_ms = c.transcribing_ms - clean.ms,
            done_ms = c.done_ms + clean.ms
        FROM clean
        WHERE c.batch_id = clean.batch_id
          AND c.shard = mod(clean.item_id, {COUNTER_SHARDS})
        RETURNING c.batch_id, c.shard, clean.ms
    ), minute AS (
        INSERT INTO batches_batchminute
            (batch_id, minute, shard, done, done_ms, failed, failed_ms)
        SELECT batch_id, %(minute)s, shard, 1, ms, 0, 0 FROM counter
        ON CONFLICT (batch_id, minute, shard) DO UPDATE SET
            done = batches_batchminute.done + 1,
            done_ms = batches_batchminute.done_ms + excluded.done_ms
    )
    SELECT item_status, lease_id FROM target
"""

# leased -> queued (attempts left) or failed (none left) for up to ``size``
# expired leases, oldest first (SKIP LOCKED: concurrent sweeps and claims share
# the work), whose items and ledger rows agree. The counter shards are locked in
# (batch, shard) order before they are updated, as every transition orders them,
# and the failed ones' minute rows after them. Returns every job it looked at,
# and whether it was clean (the others are left to the ORM path).
#
# One reclaimer at a time: every chunk first takes a transaction-level advisory
# lock ({gate}). A sweep waits for it; a claim only tries, and if another
# process is reclaiming right then, claims without waiting. Reclaims all shift
# the same counter rows of a batch, so several at once only queue on them: a
# claim stuck behind seven others' chunks waited 260 ms, now it waits for none.
RECLAIM_GATE_KEY = 0x7265636C61696D  # "reclaim"
RECLAIM_TEMPLATE = f"""
    WITH gate AS (
        {{gate}}
    ), pick AS (
        SELECT j.id, j.item_id, j.batch_id, j.attempts, j.max_attempts,
               i.status AS item_status, COALESCE(i.duration_ms, 0) AS ms,
               (SELECT l.id FROM jobs_lease l
                WHERE l.token = j.lease_token AND l.ended_at IS NULL) AS lease_id
        FROM jobs_job j
        JOIN batches_batchitem i ON i.id = j.item_id
        WHERE j.status = 'leased' AND j.lease_expires_at < %(now)s
          AND (SELECT open FROM gate)
        ORDER BY j.lease_expires_at LIMIT %(size)s
        FOR NO KEY UPDATE OF j, i SKIP LOCKED
    ), clean AS (
        SELECT *, attempts < max_attempts AS requeue,
               replace(%(gave_up)s, '{{{{n}}}}', max_attempts::text) AS gave_up
        FROM pick
        WHERE item_status = 'transcribing' AND lease_id IS NOT NULL
    ), job AS (
        UPDATE jobs_job j SET
            status = CASE WHEN clean.requeue THEN 'queued' ELSE 'failed' END,
            lease_token = NULL, leased_by_id = NULL, lease_expires_at = NULL,
            updated_at = %(now)s,
            available_at = CASE WHEN clean.requeue THEN %(now)s
                                ELSE j.available_at END,
            finished_at = CASE WHEN clean.requeue THEN NULL ELSE %(now)s END,
            last_error = CASE WHEN clean.requeue THEN j.last_error
                              ELSE clean.gave_up END
        FROM clean WHERE j.id = clean.id
    ), lease AS (
        UPDATE jobs_lease l SET ended_at = %(now)s, end_reason = 'expired',
            error = CASE WHEN clean.requeue THEN %(expired)s ELSE clean.gave_up END
        FROM clean WHERE l.id = clean.lease_id
    ), item AS (
        UPDATE batches_batchitem i SET updated_at = %(now)s,
            status = CASE WHEN clean.requeue THEN 'queued' ELSE 'failed' END
        FROM clean WHERE i.id = clean.item_id
    ), shift AS (
        SELECT batch_id, mod(item_id, {COUNTER_SHARDS}) AS shard,
               count(*) AS n, sum(ms) AS ms,
               count(*) FILTER (WHERE requeue) AS queued,
               COALESCE(sum(ms) FILTER (WHERE requeue), 0) AS queued_ms,
               count(*) FILTER (WHERE NOT requeue) AS failed,
               COALESCE(sum(ms) FILTER (WHERE NOT requeue), 0) AS failed_ms
        FROM clean GROUP BY 1, 2
    ), locked AS (
        SELECT c.id, shift.*
        FROM batches_batchcounter c
        JOIN shift ON c.batch_id = shift.batch_id AND c.shard = shift.shard
        ORDER BY c.batch_id, c.shard
        FOR NO KEY UPDATE OF c
    ), counter AS (
        UPDATE batches_batchcounter c SET
            transcribing = c.transcribing - locked.n,
            transcribing_ms = c.transcribing_ms - locked.ms,
            queued = c.queued + locked.queued,
            queued_ms = c.queued_ms + locked.queued_ms,
            failed = c.failed + locked.failed,
            failed_ms = c.failed_ms + locked.failed_ms
        FROM locked WHERE c.id = locked.id
        RETURNING c.batch_id, c.shard, locked.failed, locked.failed_ms
    ), minute AS (
        INSERT INTO batches_batchminute
            (batch_id, minute, shard, done, done_ms, failed, failed_ms)
        SELECT batch_id, %(minute)s, shard, 0, 0, failed, failed_ms
        FROM counter WHERE failed > 0
        ORDER BY batch_id, shard
        ON CONFLICT (batch_id, minute, shard) DO UPDATE SET
            failed = batches_batchminute.failed + excluded.failed,
            failed_ms = batches_batchminute.failed_ms + excluded.failed_ms
    )
    SELECT id, item_status = 'transcribing' AND lease_id IS NOT NULL,
           attempts < max_attempts
    FROM pick
"""
RECLAIM_WAITING = RECLAIM_TEMPLATE.format(
    gate=f"SELECT true AS open FROM pg_advisory_xact_lock({RECLAIM_GATE_KEY})"
)
RECLAIM_UNLESS_BUSY = RECLAIM_TEMPLATE.format(
    gate=f"SELECT pg_try_advisory_xact_lock({RECLAIM_GATE_KEY}) AS open"
)

assert LeaseEnd.COMPLETED == "completed" and ItemStatus.DONE == "done"
assert LeaseEnd.EXPIRED == "expired" and JobStatus.FAILED == "failed"
assert JobStatus.LEASED == "leased" and ItemStatus.TRANSCRIBING == "transcribing"


def workers_with_prefix(prefix: str) -> list[Worker]:
    """The workers whose token starts with ``prefix`` (the caller compares the
    hashes): ``Worker.objects.filter(token_prefix=prefix)``, prepared."""
    with _cursor() as cursor:
        _execute(cursor, WORKERS_WITH_PREFIX, {"prefix": prefix})
        return [_from_db(Worker, row) for row in cursor.fetchall()]


def claim_plan(
    now: datetime, cancelled_before: datetime, limit: int
) -> tuple[bool, bool, list[int]]:
    """(any lease expired?, any cancel unfinished since ``cancelled_before``?,
    up to ``limit`` open batches with a claimable job, by priority)."""
    with _cursor() as cursor:
        _execute(
            cursor,
            CLAIM_PLAN,
            {"now": now, "cancelled_before": cancelled_before, "limit": limit},
        )
        return cursor.fetchone()


def claim_first(
    worker: Worker, *, token: str, now: datetime, cancelled_before: datetime
) -> tuple[Job | None, bool]:
    """The common case of a claim in one statement (``CLAIM_FIRST``).

    Returns (job, written) as ``claim`` does; (None, True) when there is
    nothing to do first and no batch has a claimable job (an idle claim: one
    statement too); (None, False) when there are chores to do first, or no free
    job in the first batch with work: the caller takes the long way.
    """
    expires = now + lease_duration()
    row = _claim_row(
        CLAIM_FIRST,
        {
            "worker": worker.pk,
            "token": token,
            "expires": expires,
            "now": now,
            "cancelled_before": cancelled_before,
        },
    )
    if row is RACED:
        return None, False
    expired, cancelling, first_batch, *picked = row
    if picked[0] is None:  # no job row joined
        return None, not (expired or cancelling or first_batch)
    return _leased(picked, worker, token=token, expires=expires, now=now)


def claim(
    batch_id: int, worker: Worker, *, token: str, now: datetime
) -> tuple[Job | None, bool]:
    """Lease the batch's next claimable job to ``worker``.

    Returns (None, True) if there is none; (job, True) when it is leased, with
    ``job.item`` and ``job.batch`` loaded; (job, False) when its item has
    drifted or a stray ledger row is open, (None, False) if it raced one (see
    ``_claim_row``): nothing is written.
    """
    expires = now + lease_duration()
    row = _claim_row(
        CLAIM,
        {
            "batch": batch_id,
            "worker": worker.pk,
            "token": token,
            "expires": expires,
            "now": now,
        },
    )
    if row is RACED:
        return None, False
    if row is None:
        return None, True
    return _leased(row, worker, token=token, expires=expires, now=now)


RACED = object()


def _claim_row(sql: str, params: dict):
    """Run a claim statement and return its row, or RACED if its lease insert
    met an open ledger row committed after the statement's snapshot (one open
    row per job): nothing was written, and the ORM path, which closes such a
    row, runs instead."""
    with _cursor() as cursor:
        try:
            _execute(cursor, sql, params)
        except IntegrityError:
            return RACED
        return cursor.fetchone()


def _leased(
    row, worker: Worker, *, token: str, expires: datetime, now: datetime
) -> tuple[Job, bool]:
    """The job a claim statement picked, as the claim left it (if ``True``)."""
    n = len(JOB_COLUMNS)
    job = _from_db(Job, row[:n])
    job.item = item = _from_db(BatchItem, row[n : n + len(ITEM_COLUMNS)])
    batch_name, stray_lease = row[-2:]
    job.batch = Batch(pk=job.batch_id, name=batch_name)
    if item.status != ItemStatus.QUEUED or stray_lease:
        return job, False
    job.status = JobStatus.LEASED
    job.lease_token, job.leased_by = token, worker
    job.lease_expires_at, job.heartbeat_at, job.updated_at = expires, now, now
    job.attempts += 1
    item.status, item.updated_at = ItemStatus.TRANSCRIBING, now
    return job, True


def complete(
    job_id: int, lease_token: str, worker: Worker, *, result: dict, now: datetime
) -> bool | None:
    """leased -> completed under this lease. None: the lease is not live. False:
    the rows disagree. True: done. Nothing is written unless True."""
    with _cursor() as cursor:
        _execute(
            cursor,
            COMPLETE,
            {
                "job": job_id,
                "token": lease_token,
                "worker": worker.pk,
                "result": json.dumps(result),
                "minute": now.replace(second=0, microsecond=0),
                "now": now,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    item_status, lease_id = row
    return item_status == ItemStatus.TRANSCRIBING and lease_id is not None


def reclaim_chunk(
    now: datetime, size: int, *, expired: str, gave_up: str, wait: bool = True
) -> tuple[int, list[int], int, int]:
    """Reclaim up to ``size`` expired leases whose rows agree.

    ``expired`` is the ledger's error for a requeued job; ``gave_up`` the
    message for one failed for good (``{n}``: its max attempts). ``wait=False``:
    do nothing if another process is reclaiming. Returns (jobs looked at, ids
    of those whose rows disagree: nothing written for them, jobs queued again,
    jobs failed for good).
    """
    with _cursor() as cursor:
        _execute(
            cursor,
            RECLAIM_WAITING if wait else RECLAIM_UNLESS_BUSY,
            {
                "now": now,
                "size": size,
                "expired": expired,
                "gave_up": gave_up,
                "minute": now.replace(second=0, microsecond=0),
            },
        )
        rows = cursor.fetchall()
    requeued = sum(1 for _, clean, requeue in rows if clean and requeue)
    failed = sum(1 for _, clean, requeue in rows if clean and not requeue)
    unclean = [job_id for job_id, clean, _ in rows if not clean]
    return len(rows), unclean, requeued, failed


def _cursor() -> psycopg.Cursor:
    """A cursor with server-side binding on Django's connection, so that each
    statement here is prepared once per connection and then only executed
    (Django's own cursors bind client-side: every query is planned anew)."""
    connection.ensure_connection()
    raw = connection.connection
    if (
        raw.prepare_threshold is None
        and settings.RECALL_PREPARED_STATEMENTS
        and not connection.settings_dict["OPTIONS"].get("server_side_binding")
    ):
        # Django turns psycopg's statement preparation off. Its own cursors bind
        # client-side and are never prepared, so this turns it on only here.
        raw.prepare_threshold = PREPARE_THRESHOLD
    return psycopg.Cursor(raw)


def _execute(cursor: psycopg.Cursor, sql: str, params: dict) -> None:
    # Inside a caller's transaction, a savepoint: a failed statement must not
    # leave that transaction aborted (as Django's atomic() guarantees for the
    # ORM path). Errors surface as Django's (IntegrityError, OperationalError...).
    savepoint = transaction.atomic() if connection.in_atomic_block else nullcontext()
    with savepoint, connection.wrap_database_errors:
        cursor.execute(sql, params, prepare=settings.RECALL_PREPARED_STATEMENTS)


def _from_db(model, values):
    """A model instance from a row of its concrete columns, as the ORM builds it
    (``from_db`` plus the fields' converters: JSON arrives as text)."""
    fields = model._meta.concrete_fields
    values = [
        f.from_db_value(v, None, connection) if hasattr(f, "from_db_value") else v
        for f, v in zip(fields, values, strict=True)
    ]
    return model.from_db(connection.alias, [f.attname for f in fields], values)
