"""The PostgreSQL backend's statements, each written once and named.

A worker's claim and complete run thousands of times a minute. Through the ORM
a claim plus a complete is about fifteen statements, each built in Python and
planned anew; here each hot transition is one statement that locks its rows,
checks that they agree, and only then writes them all (job, item, counter
shard, ledger row, throughput minute), exactly what the ORM backend writes.

Every table and column name comes from the models' ``_meta`` (``{job}`` is the
job table, ``{job.leased_by}`` its column), every status from the models'
enums and ``item_status_for`` (``{job_status[leased]}``,
``{item_for[leased]}``), so the statements cannot drift from the schema. The
facts the ORM backend writes once in ``rows.py`` are written once here too, as
fragments every statement shares: the claimable condition (``CLAIMABLE``), the
counter shift and the throughput upsert (``shift_and_record``; ``shift_one``
is its form for a single move whose statuses the statement fixes, a claim's or
a completion's, which touches only the columns that move changes), and the
clock (``{now}``: the caller's instant, or the database's
``statement_timestamp()`` when the caller passes none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import Model

from batches.flags import FLAG_COLUMNS, SHORT_MIN_MS, SPACES
from batches.models import (
    COUNTER_COLUMNS,
    COUNTER_SHARDS,
    VIRTUAL_TIME_STRIDE,
    Batch,
    BatchCounter,
    BatchItem,
    BatchMinute,
    ItemStatus,
)
from jobs.models import (
    ITEM_STATUS_FOR_JOB,
    Job,
    JobStatus,
    Lease,
    LeaseEnd,
    Tally,
    Worker,
)


class Table:
    """A model's table for SQL text: ``str()`` is its name, attributes are the
    columns of its fields (an unknown field raises at import time)."""

    def __init__(self, model: type[Model]) -> None:
        self._meta = model._meta

    def __str__(self) -> str:
        return self._meta.db_table

    def __getattr__(self, field: str) -> str:
        column = getattr(self._meta.get_field(field), "column", None)
        if column is None:
            raise AttributeError(f"{self._meta.db_table}.{field} has no column")
        return str(column)

    def columns(self, alias: str, prefix: str, fields: Sequence[str]) -> str:
        """The columns of ``fields`` as ``alias.col AS prefix_col``."""
        return ", ".join(
            f"{alias}.{getattr(self, field)} AS {prefix}{getattr(self, field)}"
            for field in fields
        )


def _quoted(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


NAMES: dict[str, Any] = {
    "job": Table(Job),
    "item": Table(BatchItem),
    "batch": Table(Batch),
    "counter": Table(BatchCounter),
    "minute": Table(BatchMinute),
    "lease": Table(Lease),
    "worker": Table(Worker),
    "tally": Table(Tally),
    "shards": COUNTER_SHARDS,
    "job_status": {s.value: _quoted(s.value) for s in JobStatus},
    "item_status": {s.value: _quoted(s.value) for s in ItemStatus},
    "item_for": {j.value: _quoted(i.value) for j, i in ITEM_STATUS_FOR_JOB.items()},
    "lease_end": {e.value: _quoted(e.value) for e in LeaseEnd},
    # The clock: the caller's instant, else the database's (one value for the
    # whole statement: statement_timestamp() is stable within it).
    "now": "COALESCE(%(now)s::timestamptz, statement_timestamp())",
    "lease_seconds": "make_interval(secs => %(lease_seconds)s)",
}


ITEM_FOR = ITEM_STATUS_FOR_JOB


def sql(template: str, **more: Any) -> str:
    return template.format(**NAMES, **more)


# --- Shared fragments ------------------------------------------------------------

# A job (alias j) a claim may take now.
CLAIMABLE = sql(
    """j.{job.status} = {job_status[queued]} AND j.{job.available_at} <= {now}
    AND j.{job.attempts} < j.{job.max_attempts}"""
)

# A batch (alias b) whose jobs may be handed out (not paused, cancelled, finished).
OPEN_BATCH = sql(
    """b.{batch.paused_at} IS NULL AND b.{batch.cancelled_at} IS NULL
    AND b.{batch.finished_at} IS NULL"""
)


def shift_and_record(moves: str, *, flags: bool = False) -> str:
    """CTEs that apply the item moves in CTE ``moves`` (batch_id, item_id, old,
    new, ms) to the counter shards and count the finishes (done or failed) in
    the minute's throughput bucket: ``rows.shift_counters`` and
    ``rows.record_finished`` as SQL, for any number of moves between any
    statuses (a chunk of reclaimed leases, a batched completion). With
    ``flags``, the moves also carry ``old_flag_<name>`` and ``new_flag_<name>``
    (booleans: completions' quality flags) and the flag counters shift by
    them, as ``shift_one(..., flags=True)`` does for one move.

    The moves are summed per shard, and the shards are locked in (batch, shard)
    order, as every transition orders them. The minute rows come after the
    counters (the upsert reads from ``counter``): no deadlock.
    """
    counter = NAMES["counter"]

    def change(status: str, ms: bool) -> str:
        """How one move changes the ``status`` count (or its duration sum)."""
        quoted = NAMES["item_status"][status]
        step = f"((new = {quoted})::int - (old = {quoted})::int)"
        return f"{step} * ms" if ms else step

    def finishes(status: str, ms: bool) -> str:
        quoted = NAMES["item_status"][status]
        return f"CASE WHEN new = {quoted} THEN {'ms' if ms else '1'} ELSE 0 END"

    # Each counter column: (column, the item status it counts, a duration sum?).
    columns = [
        (column, column.removesuffix("_ms"), column.endswith("_ms"))
        for column in COUNTER_COLUMNS
    ]
    deltas = [
        f"sum({change(status, ms)}) AS d_{column}" for column, status, ms in columns
    ]
    updated = [column for column, _, _ in columns]
    if flags:
        deltas += [
            f"sum(new_{c}::int - old_{c}::int) AS d_{c}" for c in FLAG_COLUMNS.values()
        ]
        updated += list(FLAG_COLUMNS.values())
    finished = [("f_done", "done", False), ("f_done_ms", "done", True)]
    finished += [("f_failed", "failed", False), ("f_failed_ms", "failed", True)]
    counted = sql(
        """shift AS (
        SELECT batch_id, mod(item_id, {shards}) AS shard, {deltas}, {finished}
        FROM {moves} WHERE old <> new GROUP BY 1, 2
    ), locked AS (
        SELECT c.{counter.id} AS counter_id, shift.*
        FROM {counter} c
        JOIN shift ON c.{counter.batch} = shift.batch_id
            AND c.{counter.shard} = shift.shard
        ORDER BY c.{counter.batch}, c.{counter.shard}
        FOR NO KEY UPDATE OF c
    ), counter AS (
        UPDATE {counter} c SET {updates}
        FROM locked WHERE c.{counter.id} = locked.counter_id
        RETURNING locked.batch_id, locked.shard, locked.f_done, locked.f_done_ms,
            locked.f_failed, locked.f_failed_ms
    )""",
        deltas=", ".join(deltas),
        finished=", ".join(
            f"sum({finishes(status, ms)}) AS {name}" for name, status, ms in finished
        ),
        moves=moves,
        updates=", ".join(
            f"{getattr(counter, column)} = c.{getattr(counter, column)} "
            f"+ locked.d_{column}"
            for column in updated
        ),
    )
    return counted + sql(
        """, finished AS (
        INSERT INTO {minute} ({minute.batch}, {minute.minute}, {minute.shard},
            {minute.done}, {minute.done_ms}, {minute.failed}, {minute.failed_ms})
        SELECT batch_id, date_trunc('minute', {now}), shard,
            f_done, f_done_ms, f_failed, f_failed_ms
        FROM counter WHERE f_done > 0 OR f_failed > 0
        ORDER BY batch_id, shard
        ON CONFLICT ({minute.batch}, {minute.minute}, {minute.shard}) DO UPDATE SET
            {minute.done} = {minute}.{minute.done} + excluded.{minute.done},
            {minute.done_ms} = {minute}.{minute.done_ms} + excluded.{minute.done_ms},
            {minute.failed} = {minute}.{minute.failed} + excluded.{minute.failed},
            {minute.failed_ms} = {minute}.{minute.failed_ms}
                + excluded.{minute.failed_ms}
    )"""
    )


def shift_one(
    moves: str, moved: tuple[ItemStatus, ItemStatus], *, flags: bool = False
) -> str:
    """``shift_and_record`` for CTE ``moves`` holding at most one move, from
    ``moved`` = (old, new) (a claim, a completion): one counter row changes, by
    the four columns the move touches, so no lock order is needed; and the
    minute's bucket only if the move is a finish. With ``flags``, the moves
    also carry ``old_flag_<name>`` and ``new_flag_<name>`` (booleans: a
    completion's quality flags) and the flag counters shift by them."""
    counter, minute = NAMES["counter"], NAMES["minute"]
    old, new = (ItemStatus(status).value for status in moved)
    changes = ", ".join(
        f"{column} = c.{column} {sign} {amount}"
        for status, sign in ((old, "-"), (new, "+"))
        for column, amount in (
            (getattr(counter, status), "1"),
            (getattr(counter, f"{status}_ms"), "m.ms"),
        )
    )
    if flags:
        changes += "".join(
            f", {getattr(counter, c)} = c.{getattr(counter, c)}"
            f" + m.new_{c}::int - m.old_{c}::int"
            for c in FLAG_COLUMNS.values()
        )
    counted = sql(
        """counter AS (
        UPDATE {counter} c SET {changes}
        FROM {moves} m
        WHERE c.{counter.batch} = m.batch_id
          AND c.{counter.shard} = mod(m.item_id, {shards})
        RETURNING m.batch_id, c.{counter.shard} AS shard, m.ms
    )""",
        changes=changes,
        moves=moves,
    )
    if new not in (ItemStatus.DONE.value, ItemStatus.FAILED.value):
        return counted
    count, ms = getattr(minute, new), getattr(minute, f"{new}_ms")
    return counted + sql(
        """, finished AS (
        INSERT INTO {minute} ({minute.batch}, {minute.minute}, {minute.shard},
            {minute.done}, {minute.done_ms}, {minute.failed}, {minute.failed_ms})
        SELECT batch_id, date_trunc('minute', {now}), shard, {values}
        FROM counter
        ON CONFLICT ({minute.batch}, {minute.minute}, {minute.shard}) DO UPDATE SET
            {count} = {minute}.{count} + 1, {ms} = {minute}.{ms} + excluded.{ms}
    )""",
        values="1, ms, 0, 0" if new == ItemStatus.DONE.value else "0, 0, 1, ms",
        count=count,
        ms=ms,
    )


# --- Workers ---------------------------------------------------------------------


# Every API request authenticates its worker by the token's clear prefix, and
# takes with it the request's time from the database and how many live leases
# the worker holds (its cap), at no round trip more.
# The worker's live leases: its jobs, as a job has a holder exactly while it is
# leased (a check constraint). Not "AND status = 'leased'": that let PostgreSQL
# walk every live lease's expiry index instead of this worker's own (3 ms, not
# 0.05, with 10,000 live leases).
def _workers_where(condition: str) -> str:
    """Workers (every column), the leases each holds, and the statement's time."""
    return sql(
        """SELECT {columns}, (
            SELECT count(*) FROM {job} j WHERE j.{job.leased_by} = w.{worker.id}
        ), statement_timestamp()
        FROM {worker} w
        WHERE """
        + condition,
        columns=", ".join(f"w.{f.column}" for f in Worker._meta.concrete_fields),
    )


WORKERS_WITH_PREFIX = _workers_where("w.{worker.token_prefix} = %(prefix)s")
# The same for many tokens at once (the woken long-poll claims of a process).
WORKERS_WITH_PREFIXES = _workers_where("w.{worker.token_prefix} = ANY(%(prefixes)s)")

# The worker was seen now (``workers.touch``, which decides when it is due).
TOUCH_WORKER = sql(
    "UPDATE {worker} SET {worker.last_seen} = %(now)s WHERE {worker.id} = %(worker)s"
)

# --- Claim -----------------------------------------------------------------------

# Is there an expired lease to reclaim, or an interrupted cancel to finish (each
# a probe of a partial index that is empty unless so)?
CHORES = sql(
    """EXISTS (
        SELECT 1 FROM {job} WHERE {job.status} = {job_status[leased]}
            AND {job.lease_expires_at} < {now}
    ) AS expired, EXISTS (
        SELECT 1 FROM {batch}
        WHERE {batch.cancelled_at} IS NOT NULL AND {batch.finished_at} IS NULL
          AND {batch.cancelled_at} < {now} - %(cancel_grace)s::interval
    ) AS cancelling"""
)


# A batch (alias b) the claiming worker's labels (``%(labels)s``, a JSON object)
# can serve: it requires nothing they do not offer. jsonb containment is
# exactly ``batches.labels.satisfies`` for flat objects of strings, and a batch
# that requires nothing ({}) is contained in any labels.
#
# Said twice on purpose: "requires nothing, or requires what the labels
# offer". The claim's plan is generic (``postgres.plan_once``), made without
# the labels, and for ``<@`` a parameter PostgreSQL guesses that one row in a
# thousand passes. With that guess alone the claim read every job of the
# table, joined each queued one to its item and sorted them, for every
# claim (tests/jobs/test_plans.py). ``= '{{}}'`` is estimated from the
# column's statistics (nearly every row), so the plan walks the claim index
# in order and stops at the first job, as it does for any labels.
SERVES = sql("(b.{batch.requires} = '{{}}' OR b.{batch.requires} <@ %(labels)s::jsonb)")

# A job (alias j) whose own requirement (a re-run's, ``Job.requires``; {} for
# nearly every job, contained in any labels) the claiming worker's labels
# satisfy: the worker must serve the batch (``SERVES``) and the job. Checked
# on the claim index's rows as they are walked: a plain job passes at once,
# and a batch whose only claimable jobs need labels the worker lacks yields
# no candidate (it never hides another batch's work), at the cost of walking
# those jobs (a re-run's, few). Said twice for the plan's sake, as ``SERVES``.
JOB_SERVES = sql("(j.{job.requires} = '{{}}' OR j.{job.requires} <@ %(labels)s::jsonb)")


# Open batches the worker can serve (``SERVES``) with a claimable job and room
# under their in-flight cap (and
# ``unless`` is true), in claim order: priority, then fair share (least virtual
# time; see ``rows.charge_share``), then age. The LATERAL ... LIMIT 1 keeps that
# one probe of the claim index per batch (as a plain EXISTS the planner may
# hash-join every queued job of every batch). A cap is checked by counting the
# batch's live leases (at most the cap) on the (batch, status) index. Claims
# take jobs in (created_at, id) order, the claim index's: within a batch the
# manifest's order; by id alone, PostgreSQL may walk the primary key past every
# finished job when its statistics say most jobs are queued. Each candidate
# comes with the position of the job its probe found (``job_created_at``,
# ``job_id``): its first claimable job in that order, as the statement's
# snapshot sees it (see ``_claim``'s ``start``).
def candidates(*, unless: str = "true") -> str:
    return sql(
        """SELECT b.{batch.id} AS id, b.{batch.name} AS name,
        b.{batch.priority} AS priority, b.{batch.virtual_time} AS virtual_time,
        b.{batch.max_in_flight} IS NOT NULL AS capped,
        claimable.{job.created_at} AS job_created_at, claimable.{job.id} AS job_id
    FROM {batch} b
    CROSS JOIN LATERAL (
        SELECT j.{job.created_at}, j.{job.id} FROM {job} j
        WHERE j.{job.batch} = b.{batch.id} AND {claimable} AND {job_serves}
        ORDER BY j.{job.created_at}, j.{job.id} LIMIT 1
    ) AS claimable
    WHERE {open_batch} AND {serves} AND {unless} AND (
        b.{batch.max_in_flight} IS NULL OR b.{batch.max_in_flight} > (
            SELECT count(*) FROM {job} l
            WHERE l.{job.batch} = b.{batch.id} AND l.{job.status} = {job_status[leased]}
        )
    )
    ORDER BY b.{batch.priority} DESC, b.{batch.virtual_time}, b.{batch.id}""",
        claimable=CLAIMABLE,
        job_serves=JOB_SERVES,
        open_batch=OPEN_BATCH,
        serves=SERVES,
        unless=unless,
    )


# The chores, and one row per candidate batch (none: a row of NULLs).
CLAIM_PLAN = f"""SELECT chores.*, c.id, c.priority, c.capped
    FROM (SELECT {CHORES}) AS chores
    LEFT JOIN LATERAL ({candidates()} LIMIT %(limit)s) AS c ON true"""

# Charge a claim to its batch's share: stride scheduling's pass += stride.
CHARGE = sql(
    """UPDATE {batch} SET {batch.virtual_time} = {batch}.{batch.virtual_time}
        + {stride} / {batch}.{batch.weight}""",
    stride=VIRTUAL_TIME_STRIDE,
)


# A picked job's rows disagree: its item is not queued, or a ledger row of an
# earlier lease was left open. The long way heals them.
_DISAGREES = sql("(i_{item.status} <> {item_for[queued]} OR stray_lease)")
# The job picked, unless its rows disagree.
_CLEAN_ONE = f"SELECT * FROM pick WHERE NOT {_DISAGREES}"
# The jobs picked, numbered in claim order, up to the first whose rows disagree.
_CLEAN_MANY = sql(
    """SELECT * FROM (
            SELECT *, row_number() OVER claim_order AS n,
                bool_or({disagrees}) OVER claim_order AS disagreed
            FROM pick
            WINDOW claim_order AS (ORDER BY j_{job.created_at}, j_{job.id})
        ) numbered
        WHERE NOT disagreed""",
    disagrees=_DISAGREES,
)


# The job's and its item's fields a claim statement reads and returns: what
# its own checks and writes need and what the worker is handed
# (``api.worker_views.claimed``). The claim changes none of the others, which
# the instances it gives read from the database if ever asked for (deferred).
# Every column more is carried through each node of the claim's plan and its
# CTEs, set up on every execution, and read by the app.
CLAIMED_JOB_FIELDS = ("id", "item", "batch", "attempts", "max_attempts", "created_at")
CLAIMED_ITEM_FIELDS = ("id", "source", "params", "duration_ms", "status")


def _claim(
    *,
    prelude: str,
    batch_id: str,
    charge: str,
    result: str,
    limit: str = "1",
    token: str = "%(token)s",
    shift: str | None = None,
    start: str | None = None,
) -> str:
    """queued -> leased for the oldest claimable job of batch ``batch_id`` (SKIP
    LOCKED), if the worker's labels serve the batch (``SERVES``: checked again
    here when an earlier statement chose it, as its requirements may have
    changed since; a batch the prelude chose, ``start``, was checked there in
    this statement), its item agrees and no ledger row of an earlier lease
    was left open, and the worker holds fewer than ``%(cap)s`` live leases; the claim is
    charged to the batch's share if ``charge``. The prelude defines ``turn``:
    the worker's live leases, counted after its turn to claim came, or -1 if
    the worker is disabled (``recall_claim_turn``, migrations 0013 and 0014: a
    count read in this statement's own snapshot would be stale by the time the
    turn came). Returns the job's
    and item's ``CLAIMED_JOB_FIELDS`` and ``CLAIMED_ITEM_FIELDS`` as they
    were, the batch's name, whether such a stray ledger row exists, and the
    lease's times.

    The batch's row is read once, by subqueries that do not depend on the job
    (its checks a one-time filter, its name a value), never joined to the
    jobs: the plan is generic, made for the average batch, and when that
    guessed few queued jobs per batch the join read the batches table once
    for every queued job of the batch (tests/jobs/test_plans.py).

    A stray ledger row is looked up for each job picked, on the index of open
    rows (at most one per job): a scalar subquery, which PostgreSQL runs per
    row. Written as EXISTS, the generic plan, guessing many queued jobs per
    batch, hashed the whole index once per claim instead: an entry for each
    live lease of the fleet and each row closed since the last vacuum.

    Up to ``limit`` jobs (an SQL expression; 1 by default) for a claim of
    many (``CLAIM_MANY``): ``token`` is the lease token each job gets (an SQL
    expression over ``clean``), and ``clean`` then numbers the jobs in claim
    order (``n``) and keeps only those ahead of the first whose rows disagree,
    which the single claims after the statement heal and take in its place,
    as a run of single claims would (tests/jobs/test_differential.py);
    ``shift`` is the counter shift (one that sums the moves per shard:
    ``shift_and_record``).

    ``start`` (the name of a CTE of the prelude, with the batch's
    ``job_created_at`` and ``job_id`` from ``candidates``) starts the walk of
    the claim index at the job the batch's probe found, in the index's
    descent, instead of at the batch's first entry. Every entry before it
    is of a job that is not claimable in this statement's snapshot, which
    the pick shares with the probe, so the pick takes the same jobs. Those
    entries are mostly of jobs claimed since the index was last vacuumed,
    each passed by a claim's walk until then (with leases in flight, as a
    heap fetch, for as long as some snapshot may still see the job queued):
    walked from the start, a claim passed them twice, once in the probe and
    once in the pick (tests/jobs/test_plans.py)."""
    single = token == "%(token)s"
    return sql(
        """WITH {prelude} pick AS (
        SELECT {job_columns}, {item_columns}, {batch_name} AS batch_name,
            COALESCE((SELECT true FROM {lease} l
                      WHERE l.{lease.job} = j.{job.id} AND l.{lease.ended_at} IS NULL),
                false) AS stray_lease,
            {now} AS at, {now} + {lease_seconds} AS expires
        FROM {job} j
        JOIN {item} i ON i.{item.id} = j.{job.item}
        WHERE j.{job.batch} = {batch_id} AND {claimable}{batch_open}
          AND {job_serves}{start}
          AND (SELECT held BETWEEN 0 AND %(cap)s::bigint - 1 FROM turn)
        ORDER BY j.{job.created_at}, j.{job.id} LIMIT {limit}
        FOR NO KEY UPDATE OF j, i SKIP LOCKED
    ), clean AS (
        {clean}
    ), job AS (
        UPDATE {job} SET {job.status} = {job_status[leased]},
            {job.lease_token} = {token}, {job.leased_by} = %(worker)s,
            {job.lease_expires_at} = clean.expires, {job.heartbeat_at} = clean.at,
            {job.attempts} = clean.j_{job.attempts} + 1, {job.updated_at} = clean.at
        FROM clean WHERE {job}.{job.id} = clean.j_{job.id}
        RETURNING {job}.{job.id}, {job}.{job.attempts},
            clean.at, clean.expires{returned}
    ), item AS (
        UPDATE {item} SET {item.status} = {item_for[leased]},
            {item.updated_at} = clean.at
        FROM clean WHERE {item}.{item.id} = clean.i_{item.id}
    ), moves AS (
        SELECT j_{job.batch} AS batch_id, i_{item.id} AS item_id,
            i_{item.status} AS old, {item_for[leased]} AS new,
            COALESCE(i_{item.duration_ms}, 0) AS ms
        FROM clean
    ), {shift}, opened AS (
        INSERT INTO {lease} ({lease.job}, {lease.worker}, {lease.token},
            {lease.attempt}, {lease.claimed_at}, {lease.heartbeat_at},
            {lease.expires_at}, {lease.error})
        SELECT id, %(worker)s, {opened_token}, attempts, at, at, expires, ''
        FROM job{opened_order}
    ){charged}
    {result}""",
        prelude=prelude,
        batch_id=batch_id,
        # A statement that never charges has no update of the batch in its
        # plan: every node of a plan is set up on each execution, rows or none.
        charged=""
        if charge == "false"
        else sql(
            """, charged AS (
        {charge_share} FROM clean
        WHERE {batch}.{batch.id} = clean.j_{job.batch} AND {charge}
    )""",
            charge_share=CHARGE,
            charge=charge,
        ),
        job_columns=NAMES["job"].columns("j", "j_", CLAIMED_JOB_FIELDS),
        item_columns=NAMES["item"].columns("i", "i_", CLAIMED_ITEM_FIELDS),
        claimable=CLAIMABLE,
        job_serves=JOB_SERVES,
        shift=shift_one(
            "moves", (ITEM_FOR[JobStatus.QUEUED], ITEM_FOR[JobStatus.LEASED])
        )
        if shift is None
        else shift,
        result=result,
        limit=limit,
        clean=_CLEAN_ONE if single else _CLEAN_MANY,
        token=token,
        # One token (a single claim): the ledger row takes it as given. Many:
        # each job's, as written, and the rows opened in claim order.
        returned=""
        if single
        else sql(",\n            {job}.{job.lease_token} AS token"),
        # A batch chosen by an earlier statement is read again: it may have
        # been paused, cancelled or given other requirements since. One chosen
        # by this statement's own prelude (``start``: ``candidates``, in this
        # snapshot, or locked at its latest version and checked again) comes
        # with its name and was found open to the worker there.
        batch_name=sql(
            "(SELECT b.{batch.name} FROM {batch} b WHERE b.{batch.id} = {batch_id})",
            batch_id=batch_id,
        )
        if start is None
        else f"(SELECT name FROM {start})",
        batch_open=sql(
            """
          AND EXISTS (
            SELECT 1 FROM {batch} b WHERE b.{batch.id} = {batch_id}
              AND b.{batch.paused_at} IS NULL AND b.{batch.cancelled_at} IS NULL
              AND {serves}
          )""",
            batch_id=batch_id,
            serves=SERVES,
        )
        if start is None
        else "",
        start=""
        if start is None
        else sql(
            """
          AND (j.{job.created_at}, j.{job.id}) >= (
              SELECT job_created_at, job_id FROM {start})""",
            start=start,
        ),
        opened_token="%(token)s" if single else "token",
        opened_order="" if single else "\n        ORDER BY id",
    )


# The worker's turn to claim: its live leases, counted once its row is locked.
TURN = "recall_claim_turn(%(worker)s::bigint)"

# Returns the worker's live leases (as its turn counted them; -1 if it is
# disabled), then the job as the pick found it (NULLs if none: none was
# claimable, or the worker is at its cap or disabled).
CLAIM = _claim(
    prelude=f"turn AS (SELECT {TURN} AS held),",
    batch_id="%(batch)s",
    charge="%(charge)s",
    result="SELECT turn.held, pick.* FROM turn LEFT JOIN pick ON true",
)


# The chores, the first open batch in claim order the worker can serve (``head``,
# with its cap) and whether another batch of its priority has work too
# (``rival``): how every claim statement that chooses its batch begins.
HEAD = f"""chores AS (
        SELECT {CHORES}
    ), top AS (
        {candidates(unless="NOT (SELECT expired OR cancelling FROM chores)")}
        LIMIT 2
    ), head AS (
        SELECT * FROM top ORDER BY priority DESC, virtual_time, id LIMIT 1
    ), rival AS (
        SELECT EXISTS (
            SELECT 1 FROM top, head
            WHERE top.id <> head.id AND top.priority = head.priority
        ) AS found
    ),"""


# ``HEAD``, then the batch the claim takes its job from (``first``): how
# CLAIM_FIRST begins.
#
# A claim with a rival is charged to its batch's share, an update of the
# batch's row held to the claim's commit. Claims that start together all find
# the same least virtual time, and each would queue on that row behind the one
# before (with a thousand open batches, a third of the busy backends did). So
# such a claim walks the candidates of the head's priority again, in claim
# order from the head on (none before it is a candidate, and a batch the
# worker cannot serve may stand before it hundreds of times over), locking the
# row it stops at and stepping over rows other claims hold (``free``: SKIP
# LOCKED): a concurrent claim goes to the next share in line instead of
# waiting for the first one's commit, as it would once that commit had moved
# the first one back. One claim at a time finds no row held and takes exactly
# the head. When every row is held, ``first`` is empty and the caller takes
# the long way.
_FREE = candidates(
    unless=sql(
        "(SELECT found FROM rival) "
        "AND b.{batch.priority} = (SELECT priority FROM head) "
        "AND (b.{batch.virtual_time}, b.{batch.id}) "
        ">= ((SELECT virtual_time FROM head), (SELECT id FROM head))"
    )
)
FIRST_BATCH = f"""{HEAD} free AS (
        {_FREE}
        LIMIT 1 FOR NO KEY UPDATE OF b SKIP LOCKED
    ), first AS (
        SELECT * FROM head WHERE NOT (SELECT found FROM rival)
        UNION ALL
        SELECT * FROM free
    ),"""


def chosen(source: str, condition: str) -> str:
    """The batch the claim takes its job from (``chosen``: the row of CTE
    ``source`` where ``condition``) and the worker's turn, taken only when
    there is such a batch (an idle claim takes no lock)."""
    return f""" chosen AS (
        SELECT * FROM {source} WHERE {condition}
    ), turn AS (
        SELECT {TURN} AS held FROM chosen
    ),"""


# The first batch when it is uncapped and has no rival, no share to charge:
# how CLAIM_SOLO and CLAIM_MANY begin.
UNRIVALLED = HEAD + chosen("head", "NOT capped AND NOT (SELECT found FROM rival)")


# What CLAIM_FIRST and CLAIM_SOLO return before the job: the chores' flags, the
# first batch, the statement's instant, the worker's live leases as its turn
# counted them (NULL when not taken) and whether the first batch has a rival.
_FIRST_RESULT = sql(
    "SELECT chores.*, (SELECT id FROM head), {now} AS at, "
    "(SELECT held FROM turn), (SELECT found FROM rival), pick.* "
    "FROM chores LEFT JOIN pick ON true"
)

# The common case in one statement: nothing to do first, and the first open
# batch in claim order is uncapped and has a job no other claim holds. Returns
# the chores' flags, the first batch, the statement's instant, the worker's
# live leases, whether the batch has a rival (``_FIRST_RESULT``), and the job
# as CLAIM does if there was one (else NULLs): when there is none the caller
# takes the long way (CLAIM_PLAN, then CLAIM per candidate batch), which also
# covers chores, capped batches, and taken or drifted rows. The claim is
# charged to the batch's share when a second open batch of its priority has
# work too. The worker's turn is taken only when there is such a batch (an
# idle claim takes no lock).
CLAIM_FIRST = _claim(
    prelude=FIRST_BATCH + chosen("first", "NOT capped"),
    batch_id="(SELECT id FROM chosen)",
    start="chosen",
    charge="(SELECT found FROM rival)",
    result=_FIRST_RESULT,
)

# CLAIM_FIRST for a first batch without a rival, the whole plan of a claim
# from a queue of one open batch (or of one per priority): there is no share
# to charge, so the plan has neither the walk for a free share nor the
# batch's update, which CLAIM_FIRST sets up on every execution whether it
# runs them or not (a third of its plan's nodes). When the first batch has a
# rival it writes nothing and says so (``_FIRST_RESULT``): the caller then
# claims with CLAIM_FIRST. Otherwise it claims exactly as CLAIM_FIRST does.
CLAIM_SOLO = _claim(
    prelude=UNRIVALLED,
    batch_id="(SELECT id FROM chosen)",
    start="chosen",
    charge="false",
    result=_FIRST_RESULT,
)

# Many jobs in one statement (a claim of ``%(n)s`` jobs, ``max_jobs``), when that
# is exactly what as many single claims in a row would take: nothing to do
# first, and the first open batch in claim order is uncapped and has no rival
# of its priority (no fair share to charge: a run of single claims takes
# every job from it while it has any). Then the oldest claimable jobs of that
# batch, as many as asked and as the worker's lease cap leaves room for
# after its turn (SKIP LOCKED), are leased at once up to the first whose rows
# disagree, each with its own token (``%(tokens)s``, in claim order), the
# counter shards shifted once each in (batch, shard) order, the ledger rows
# opened in claim order. Returns the chores' flags, the first batch, whether
# it is capped, whether it has a rival, the statement's instant and the
# worker's live leases as its turn counted them (NULL when not taken), then
# one row per job picked, as CLAIM does, with the token it was leased under
# (NULL: its rows, or those of a job before it, disagree: it was left as it
# was); one row of NULLs for the job when none was picked. When the
# statement cannot take the jobs (chores, a capped first batch, a rival) it
# writes nothing and the caller claims one job at a time.
CLAIM_MANY = _claim(
    prelude=UNRIVALLED,
    batch_id="(SELECT id FROM chosen)",
    start="chosen",
    charge="false",
    limit=(
        "LEAST(%(n)s::bigint, GREATEST(%(cap)s::bigint - (SELECT held FROM turn), 0))"
    ),
    token="(%(tokens)s::text[])[clean.n]",
    shift=shift_and_record("moves"),
    result=sql(
        """SELECT chores.*, (SELECT id FROM head), (SELECT capped FROM head),
        (SELECT found FROM rival), {now} AS at, (SELECT held FROM turn), pick.*,
        job.token
    FROM chores
    LEFT JOIN pick ON true
    LEFT JOIN job ON job.{job.id} = pick.j_{job.id}
    ORDER BY pick.j_{job.created_at}, pick.j_{job.id}"""
    ),
)

# --- Heartbeat -------------------------------------------------------------------

# The job (alias j, named by its id) is leased to the calling worker under this
# token. Not as plain equalities: a generic plan made while the statistics saw
# no live lease took ``leased_by_id = %(worker)s`` for the condition of an
# index walk of all the worker's leases (up to its cap), keeping the one with
# the job's id, on each heartbeat and completion; with that condition alone
# kept from the index, ``status = 'leased'`` let it walk the partial index of
# the whole fleet's leased jobs instead. IS NOT DISTINCT FROM is the same test
# on these NOT NULL values (a worker's id is never NULL), and neither an
# index condition nor the proof of a partial index's predicate: the job is
# looked up by its id (tests/jobs/test_plans.py). The batched forms
# keep plain equalities: their jobs come from a list, and with nothing left
# to walk but that list's ids a generic plan might hash the whole jobs table
# instead; a walk of the worker's own leases is bounded by its cap.
LEASED_TO_WORKER = sql(
    """j.{job.status} IS NOT DISTINCT FROM {job_status[leased]}
          AND j.{job.lease_token} = %(token)s
          AND j.{job.leased_by} IS NOT DISTINCT FROM %(worker)s"""
)

# Extend a live lease held with this token by this worker: the job's deadline
# and the open ledger row's, one lease length from now. Returns the new expiry,
# or no row if the lease is not live.
#
# Here and in the statements below, a lease's open ledger row is found by its
# job's id (the key of the index of open rows) as well as by its token. Found
# by token alone, a generic plan made while the statistics saw no live lease
# walked every open row of the fleet on every call
# (tests/jobs/test_plans.py).
HEARTBEAT = sql(
    """WITH job AS (
        UPDATE {job} j SET {job.lease_expires_at} = {now} + {lease_seconds},
            {job.heartbeat_at} = {now}, {job.updated_at} = {now}
        WHERE j.{job.id} = %(job)s AND {leased_to_worker}
        RETURNING j.{job.lease_expires_at} AS expires, j.{job.heartbeat_at} AS at
    ), ledger AS (
        UPDATE {lease} SET {lease.heartbeat_at} = job.at,
            {lease.expires_at} = job.expires
        FROM job
        WHERE {lease}.{lease.job} = %(job)s AND {lease}.{lease.token} = %(token)s
          AND {lease}.{lease.ended_at} IS NULL
    )
    SELECT expires FROM job""",
    leased_to_worker=LEASED_TO_WORKER,
)

# Extend many leases of one worker (a batched heartbeat), each as HEARTBEAT
# would: the jobs leased to this worker under the tokens asked with are locked
# in id order (as every transition that locks many jobs takes them), and their
# deadlines and open ledger rows' moved one lease length from now. Returns one
# row per lease asked for, in the order asked: its new expiry (NULL when not
# renewed) and, when not renewed, whether the job exists at all (lease lost,
# or no such job).
HEARTBEAT_MANY = sql(
    """WITH asked AS (
        SELECT * FROM unnest(%(jobs)s::bigint[], %(tokens)s::text[])
            WITH ORDINALITY AS a(job_id, token, n)
    ), held AS MATERIALIZED (
        SELECT j.{job.id} AS id FROM {job} j
        JOIN asked ON j.{job.id} = asked.job_id AND j.{job.lease_token} = asked.token
        WHERE j.{job.status} = {job_status[leased]} AND j.{job.leased_by} = %(worker)s
        ORDER BY j.{job.id}
        FOR NO KEY UPDATE OF j
    ), job AS (
        UPDATE {job} SET {job.lease_expires_at} = {now} + {lease_seconds},
            {job.heartbeat_at} = {now}, {job.updated_at} = {now}
        FROM held WHERE {job}.{job.id} = held.id
        RETURNING {job}.{job.id} AS id, {job}.{job.lease_token} AS token,
            {job}.{job.lease_expires_at} AS expires, {job}.{job.heartbeat_at} AS at
    ), ledger AS (
        UPDATE {lease} SET {lease.heartbeat_at} = job.at,
            {lease.expires_at} = job.expires
        FROM job
        WHERE {lease}.{lease.job} = ANY(%(jobs)s::bigint[])
          AND {lease}.{lease.job} = job.id AND {lease}.{lease.token} = job.token
          AND {lease}.{lease.ended_at} IS NULL
    )
    SELECT job.expires, CASE WHEN job.expires IS NULL THEN EXISTS (
            SELECT FROM {job} k WHERE k.{job.id} = asked.job_id
        ) END
    FROM asked LEFT JOIN job ON job.id = asked.job_id
    ORDER BY asked.n"""
)

# --- Complete --------------------------------------------------------------------


def _new_flags(*, words: str, heard: str) -> str:
    """A completion's quality flags (``batches.flags.flags_for``) as columns
    ``new_flag_<name>``, decided from the item (alias i) the statement locks
    and ``words``, ``heard`` (SQL expressions: the result's word count and
    ``language_name``) and %(per_minute)s."""
    return sql(
        """{words} = 0 AS new_flag_empty,
        COALESCE(i.{item.duration_ms} >= {short_min_ms}
            AND {words} * 60000
                < %(per_minute)s::bigint * i.{item.duration_ms},
            false) AS new_flag_short,
        COALESCE({heard} IS NOT NULL
            AND jsonb_typeof(i.{item.params} -> 'language') = 'string'
            AND lower(btrim(i.{item.params} ->> 'language', {spaces}))
                NOT IN ('', {heard}),
            false) AS new_flag_language_mismatch""",
        words=words,
        heard=heard,
        short_min_ms=SHORT_MIN_MS,
        spaces="E'" + "".join(f"\\x{ord(c):02x}" for c in SPACES) + "'",
    )


# The item's (alias i) flags before the completion, as ``old_flag_<name>``.
_OLD_FLAGS = ", ".join(
    f"i.{getattr(NAMES['item'], c)} AS old_{c}" for c in FLAG_COLUMNS.values()
)
# The item's flag columns set from CTE ``clean``'s new ones.
_SET_FLAGS = ", ".join(
    f"{getattr(NAMES['item'], c)} = clean.new_{c}" for c in FLAG_COLUMNS.values()
)
_MOVED_FLAGS = ", ".join(f"old_{c}, new_{c}" for c in FLAG_COLUMNS.values())

# leased -> completed under this lease, if the item and the ledger row agree
# and the batch is not in its tail. Returns the item's status and the open
# ledger row found (no row at all: the lease is not live), with what the caller
# logs, and whether the batch is in its tail: nothing queued in the counters
# this statement sees. A completion in the tail may finish the batch, which
# needs the batch row's lock and a fresh look at the counters (outbox.py): it
# writes nothing here, and the ORM backend's code does it all in one
# transaction. The tail is at most one completion per worker on the batch.
COMPLETE = sql(
    """WITH target AS (
        SELECT j.{job.id} AS id, j.{job.item} AS item_id, j.{job.batch} AS batch_id,
            j.{job.attempts} AS attempts, i.{item.status} AS item_status,
            COALESCE(i.{item.duration_ms}, 0) AS ms, l.{lease.id} AS lease_id,
            {old_flags}, {new_flags}, {now} AS at
        FROM {job} j
        JOIN {item} i ON i.{item.id} = j.{job.item}
        LEFT JOIN {lease} l ON l.{lease.job} = j.{job.id}
            AND l.{lease.token} = j.{job.lease_token} AND l.{lease.ended_at} IS NULL
        WHERE j.{job.id} = %(job)s AND {leased_to_worker}
        FOR NO KEY UPDATE OF j, i
    ), tail AS (
        SELECT COALESCE(sum(c.{counter.queued}), 0) = 0 AS tail FROM {counter} c
        WHERE c.{counter.batch} = (SELECT batch_id FROM target)
    ), clean AS (
        SELECT * FROM target
        WHERE item_status = {item_for[leased]} AND lease_id IS NOT NULL
          AND NOT (SELECT tail FROM tail)
    ), job AS (
        UPDATE {job} SET {job.status} = {job_status[completed]},
            {job.result} = %(result)s::jsonb, {job.lease_token} = NULL,
            {job.leased_by} = NULL, {job.lease_expires_at} = NULL,
            {job.finished_at} = clean.at, {job.updated_at} = clean.at
        FROM clean WHERE {job}.{job.id} = clean.id
    ), closed AS (
        UPDATE {lease} SET {lease.ended_at} = clean.at,
            {lease.end_reason} = {lease_end[completed]}, {lease.error} = ''
        FROM clean WHERE {lease}.{lease.id} = clean.lease_id
    ), item AS (
        UPDATE {item} SET {item.status} = {item_for[completed]},
            {item.updated_at} = clean.at, {set_flags}
        FROM clean WHERE {item}.{item.id} = clean.item_id
    ), moves AS (
        SELECT batch_id, item_id, item_status AS old, {item_for[completed]} AS new, ms,
            {moved_flags}
        FROM clean
    ), {shift}
    SELECT item_status, lease_id, batch_id, attempts, at, (SELECT tail FROM tail)
    FROM target""",
    shift=shift_one(
        "moves",
        (ITEM_FOR[JobStatus.LEASED], ITEM_FOR[JobStatus.COMPLETED]),
        flags=True,
    ),
    # The completion's quality flags: batches.flags.flags_for, decided here
    # from the item this statement locks and %(words)s, %(heard)s (the
    # result's word count and language_name) and %(per_minute)s, so the
    # completion stays one statement (the differential test holds both to the
    # same answers). The item's old flags come off the counters (an item that
    # is not done has none, but a drifted one may).
    old_flags=_OLD_FLAGS,
    new_flags=_new_flags(words="%(words)s::bigint", heard="%(heard)s::text"),
    set_flags=_SET_FLAGS,
    moved_flags=_MOVED_FLAGS,
    leased_to_worker=LEASED_TO_WORKER,
)

# Many completions of one worker at once (a batched completion), each as
# COMPLETE would make it alone: the jobs leased to this worker under the tokens
# asked with are locked with their items in id order (as every transition that
# locks many jobs takes them: no deadlock), and each whose item and ledger row
# agree and whose batch is not in its tail is completed with its own result
# and quality flags (decided from its locked item, as COMPLETE decides them);
# the counter shards and throughput minutes shift once per (batch, shard), in
# that order (``shift_and_record``). Returns one row per completion asked for,
# in the order asked: the job id, then as COMPLETE does (the item's status,
# the open ledger row, the batch, the attempts, the instant, whether the batch
# is in its tail; NULLs when the lease is not live) and whether it was
# written. Those not written (not live, rows that disagree, the tail) are left
# to the caller, which decides them as the single completion does.
COMPLETE_MANY = sql(
    """WITH asked AS (
        SELECT * FROM unnest(%(jobs)s::bigint[], %(tokens)s::text[],
            %(results)s::text[], %(words)s::bigint[], %(heard)s::text[])
            WITH ORDINALITY AS a(job_id, token, result, words, heard, n)
    ), target AS MATERIALIZED (
        SELECT j.{job.id} AS id, j.{job.item} AS item_id, j.{job.batch} AS batch_id,
            j.{job.attempts} AS attempts, i.{item.status} AS item_status,
            COALESCE(i.{item.duration_ms}, 0) AS ms, l.{lease.id} AS lease_id,
            a.result, {old_flags}, {new_flags}, {now} AS at
        FROM {job} j
        JOIN asked a ON a.job_id = j.{job.id} AND a.token = j.{job.lease_token}
        JOIN {item} i ON i.{item.id} = j.{job.item}
        LEFT JOIN {lease} l ON l.{lease.job} = ANY(%(jobs)s::bigint[])
            AND l.{lease.job} = j.{job.id} AND l.{lease.token} = j.{job.lease_token}
            AND l.{lease.ended_at} IS NULL
        WHERE j.{job.status} = {job_status[leased]} AND j.{job.leased_by} = %(worker)s
        ORDER BY j.{job.id}
        FOR NO KEY UPDATE OF j, i
    ), tail AS (
        SELECT c.{counter.batch} AS batch_id,
            COALESCE(sum(c.{counter.queued}), 0) = 0 AS tail
        FROM {counter} c
        WHERE c.{counter.batch} IN (SELECT batch_id FROM target)
        GROUP BY c.{counter.batch}
    ), clean AS (
        SELECT target.* FROM target
        LEFT JOIN tail ON tail.batch_id = target.batch_id
        WHERE item_status = {item_for[leased]} AND lease_id IS NOT NULL
          AND NOT COALESCE(tail.tail, true)
    ), job AS (
        UPDATE {job} SET {job.status} = {job_status[completed]},
            {job.result} = clean.result::jsonb, {job.lease_token} = NULL,
            {job.leased_by} = NULL, {job.lease_expires_at} = NULL,
            {job.finished_at} = clean.at, {job.updated_at} = clean.at
        FROM clean WHERE {job}.{job.id} = clean.id
        RETURNING {job}.{job.id} AS id
    ), closed AS (
        UPDATE {lease} SET {lease.ended_at} = clean.at,
            {lease.end_reason} = {lease_end[completed]}, {lease.error} = ''
        FROM clean WHERE {lease}.{lease.id} = clean.lease_id
    ), item AS (
        UPDATE {item} SET {item.status} = {item_for[completed]},
            {item.updated_at} = clean.at, {set_flags}
        FROM clean WHERE {item}.{item.id} = clean.item_id
    ), moves AS (
        SELECT batch_id, item_id, item_status AS old, {item_for[completed]} AS new, ms,
            {moved_flags}
        FROM clean
    ), {shift}
    SELECT asked.job_id, target.item_status, target.lease_id, target.batch_id,
        target.attempts, target.at, tail.tail, job.id IS NOT NULL
    FROM asked
    LEFT JOIN target ON target.id = asked.job_id
    LEFT JOIN tail ON tail.batch_id = target.batch_id
    LEFT JOIN job ON job.id = asked.job_id
    ORDER BY asked.n""",
    shift=shift_and_record("moves", flags=True),
    old_flags=_OLD_FLAGS,
    new_flags=_new_flags(words="a.words", heard="a.heard"),
    set_flags=_SET_FLAGS,
    moved_flags=_MOVED_FLAGS,
)

# --- Reclaim ---------------------------------------------------------------------

# leased -> queued for up to ``size`` expired leases with attempts left, oldest
# first (SKIP LOCKED: concurrent sweeps and claims share the work), whose items
# and ledger rows agree. Returns every job it looked at, and whether it was
# clean (the others are left to the ORM path). A lease that expired on the
# job's last attempt is not clean either: that job fails for good, which may
# write an ``item.failed`` event and finish its batch (outbox.py), so the ORM
# backend's code fails it (rare: a file that keeps killing workers).
#
# One reclaimer at a time: every chunk first takes a transaction-level advisory
# lock ({gate}). A sweep waits for it; a claim only tries, and if another
# process is reclaiming right then, claims without waiting. Reclaims all shift
# the same counter rows of a batch, so several at once only queue on them.
RECLAIM_GATE_KEY = 0x7265636C61696D  # "reclaim"
_RECLAIM = sql(
    """WITH gate AS (
        {{gate}}
    ), pick AS (
        SELECT j.{job.id} AS id, j.{job.item} AS item_id, j.{job.batch} AS batch_id,
            j.{job.attempts} AS attempts, j.{job.max_attempts} AS max_attempts,
            j.{job.leased_by} AS worker_id, i.{item.status} AS item_status,
            COALESCE(i.{item.duration_ms}, 0) AS ms,
            (SELECT l.{lease.id} FROM {lease} l
             WHERE l.{lease.job} = j.{job.id} AND l.{lease.token} = j.{job.lease_token}
               AND l.{lease.ended_at} IS NULL) AS lease_id,
            {now} AS at
        FROM {job} j
        JOIN {item} i ON i.{item.id} = j.{job.item}
        WHERE j.{job.status} = {job_status[leased]}
          AND j.{job.lease_expires_at} < {now}
          AND (SELECT open FROM gate)
        ORDER BY j.{job.lease_expires_at} LIMIT %(size)s
        FOR NO KEY UPDATE OF j, i SKIP LOCKED
    ), clean AS (
        SELECT * FROM pick
        WHERE item_status = {item_for[leased]} AND lease_id IS NOT NULL
          AND attempts < max_attempts
    ), job AS (
        UPDATE {job} j SET {job.status} = {job_status[queued]},
            {job.lease_token} = NULL, {job.leased_by} = NULL,
            {job.lease_expires_at} = NULL, {job.updated_at} = clean.at,
            {job.available_at} = clean.at, {job.finished_at} = NULL
        FROM clean WHERE j.{job.id} = clean.id
    ), closed AS (
        UPDATE {lease} l SET {lease.ended_at} = clean.at,
            {lease.end_reason} = {lease_end[expired]}, {lease.error} = %(expired)s
        FROM clean WHERE l.{lease.id} = clean.lease_id
    ), item AS (
        UPDATE {item} i SET {item.updated_at} = clean.at,
            {item.status} = {item_for[queued]}
        FROM clean WHERE i.{item.id} = clean.item_id
    ), moves AS (
        SELECT batch_id, item_id, item_status AS old, {item_for[queued]} AS new, ms
        FROM clean
    ), {shift}, tallied AS (
        INSERT INTO {tally} ({tally.name}, {tally.count})
        SELECT 'leases_expired', count(*) FROM clean HAVING count(*) > 0
        ON CONFLICT ({tally.name}) DO UPDATE
            SET {tally.count} = {tally}.{tally.count} + excluded.{tally.count}
    )
    SELECT id, item_status = {item_for[leased]} AND lease_id IS NOT NULL
            AND attempts < max_attempts,
        attempts, worker_id, batch_id
    FROM pick""",
    shift=shift_and_record("moves"),
)
RECLAIM_WAITING = _RECLAIM.replace(
    "{gate}", f"SELECT true AS open FROM pg_advisory_xact_lock({RECLAIM_GATE_KEY})"
)
RECLAIM_UNLESS_BUSY = _RECLAIM.replace(
    "{gate}", f"SELECT pg_try_advisory_xact_lock({RECLAIM_GATE_KEY}) AS open"
)
