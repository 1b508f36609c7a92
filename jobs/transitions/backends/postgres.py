"""The PostgreSQL statement backend: the hot transitions as single statements.

It replaces the ORM backend's hooks for worker authentication, the claim, the
heartbeat, the completion and a chunk of reclaimed leases with the prepared
statements in ``statements.py`` and inherits everything else. A single
statement is atomic by itself, so these run without a transaction block of
their own (no BEGIN and COMMIT round trips), or inside the caller's. Only the
clean case is handled in SQL: when the rows disagree (an item whose status
drifted, a live lease without its open ledger row) a statement writes nothing
and says so, and the ORM backend's code, which locks the rows again, heals and
logs the drift, runs instead. The same goes for a completion in its batch's
tail (nothing queued: it may finish the batch, which takes the batch row's lock
and writes the ``batch.finished`` event, ``outbox.py``) and for a lease that
expired on its job's last attempt (the job fails for good: an ``item.failed``
event, maybe a finish).

Time is the database's: a statement given no ``now`` reads
``statement_timestamp()`` and returns the instant it used, so a fallback to the
ORM path and the response use the same one.
"""

from __future__ import annotations

import functools
import hmac
import json
import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime
from typing import Any

import psycopg
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import JSONField, Model, QuerySet
from django.db.models.base import ModelState
from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute
from django.db.models.query_utils import DeferredAttribute
from django.db.models.signals import post_init, pre_init
from psycopg.types.datetime import TimestamptzLoader

from batches.flags import language_name, words
from batches.labels import Labels
from batches.models import Batch, BatchItem, ItemStatus
from jobs.exceptions import LeaseLost, TooManyLeases, WorkerDisabled
from jobs.models import Job, JobStatus, Worker
from jobs.tokens import hash_token, new_lease_token, plausible_worker_token
from jobs.tokens import token_prefix as prefix_of

from ..rows import log_lease, lost_detail
from ..rules import (
    CANCEL_GRACE,
    CLAIM_BATCH_CANDIDATES,
    LEASE_EXPIRED,
    LEASE_LOST,
    NOT_FOUND,
    lease_duration,
)
from . import statements
from .base import Chores, ItemRow
from .orm import Candidate, OrmBackend

# psycopg's default: prepare a statement on its fifth execution (``prepare=True``
# below prepares ours at once).
PREPARE_THRESHOLD = 5


def prepares(connection: BaseDatabaseWrapper) -> bool:
    """Whether this backend prepares its statements on ``connection``: on
    PostgreSQL with the statement backend, unless ``RECALL_PREPARED_STATEMENTS``
    is off or Django binds server-side itself (its cursors then prepare)."""
    return (
        connection.vendor == "postgresql"
        and settings.RECALL_TRANSITIONS_BACKEND == "auto"
        and settings.RECALL_PREPARED_STATEMENTS
        and not connection.settings_dict["OPTIONS"].get("server_side_binding")
    )


def plan_once(*, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """On a new connection whose statements this backend prepares: keep one
    plan per prepared statement (``plan_cache_mode``), never re-plan it.

    PostgreSQL plans a prepared statement for its first five executions with
    their values, then compares a generic plan's estimated cost with theirs
    and keeps planning anew each time the generic one looks dearer. It looks
    dearer for the claim as soon as labels are in it: a generic plan cannot
    read the statistics of ``requires <@ %(labels)s`` and guesses 1% of the
    rows, so it expects the claim index's walk to be a hundred times as long
    as it is. The claim was then planned on every call, about 1.8 ms of the
    database's CPU over 0.6 ms of execution; its generic plan runs as fast
    (docs/development/benchmark-history.md, "The claim planned on every
    call"). Every statement here is written for one plan whatever its values
    (ids, a token, the worker's labels), so the generic plan is kept for all.

    Only prepared statements (and PL/pgSQL's) have cached plans: Django's own
    queries, bound client-side, are planned each time as before. Run when the
    connection is made (Django's ``connection_created``, in autocommit), so no
    rolled-back transaction can undo it."""
    if prepares(connection):
        with connection.cursor() as cursor:
            cursor.execute("SET plan_cache_mode = force_generic_plan")


# A statement's lease insert met an open ledger row committed after its snapshot.
RACED = object()

# At most this many label sets are remembered as claiming without a rival (a
# set beyond them claims with CLAIM_FIRST, as before any claim).
LABEL_SETS = 64

# The column of CLAIM_FIRST's and CLAIM_SOLO's row that says whether the first
# batch has a rival (``statements._FIRST_RESULT``).
FIRST_RIVAL = 5


@functools.cache
def native(sql: str) -> tuple[bytes, tuple[str, ...]]:
    """``sql`` with PostgreSQL's placeholders (``$1``...) for its ``%(name)s``
    ones, and the names in their order: converted once per process. psycopg
    would convert on every execution, and it caches its conversion only for
    texts under 4 KB, which the claim is not.

    The text comes encoded, once: given a ``str``, psycopg would encode it on
    every execution, and hash the new bytes again to find its prepared
    statement (about 3% of a claim and a completion's instructions); the
    same bytes object keeps its hash."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, sql)
    if "%" in text:
        raise ValueError(f"a placeholder other than %(name)s in: {sql[:80]}")
    return text.encode(), tuple(names)


class PostgresBackend(OrmBackend):
    """The ORM backend, with the hot path in SQL (see the module docstring)."""

    name = "postgres"

    def __init__(self, connection: BaseDatabaseWrapper, chores: Chores) -> None:
        super().__init__(connection, chores)
        self.prepare = settings.RECALL_PREPARED_STATEMENTS
        # _cursor()'s cursor, kept for as long as its database connection lasts.
        self._raw_cursor: psycopg.RawCursor[Any] | None = None
        # The label sets (as claims send them) whose last claim found its first
        # batch without a rival: their next claim tries CLAIM_SOLO first.
        self._alone: set[str] = set()

    # --- Workers ----------------------------------------------------------------

    def authenticate(self, token: str) -> tuple[Worker | None, datetime | None]:
        if not plausible_worker_token(token):
            return None, None
        rows = self._fetchall(
            statements.WORKERS_WITH_PREFIX, {"prefix": prefix_of(token)}
        )
        return self._holder(token, self._workers(rows))

    def authenticate_many(
        self, tokens: Sequence[str]
    ) -> list[tuple[Worker | None, datetime | None]]:
        prefixes = sorted({prefix_of(t) for t in tokens if plausible_worker_token(t)})
        if not prefixes:
            return [(None, None)] * len(tokens)
        rows = self._fetchall(statements.WORKERS_WITH_PREFIXES, {"prefixes": prefixes})
        workers = self._workers(rows)
        return [
            self._holder(token, workers)
            if plausible_worker_token(token)
            else (None, None)
            for token in tokens
        ]

    def _workers(self, rows: Iterable[Any]) -> list[tuple[Worker, datetime]]:
        """The workers of ``WORKERS_WITH_PREFIX(ES)`` rows, with their live
        leases, and the statement's time."""
        workers = []
        for *columns, live_leases, now in rows:
            worker = self._from_db(Worker, columns)
            worker.live_leases = live_leases
            workers.append((worker, now))
        return workers

    def touch(self, worker: Worker, now: datetime) -> None:
        # The ORM's UPDATE, prepared: built by the ORM it cost about 650,000
        # instructions, as much as a claim and its completion (an idle or
        # long-polling worker's request writes it about every other time).
        if worker.seen_long_ago(now):
            seen = {"now": now, "worker": worker.pk}
            self._execute(self._cursor(), statements.TOUCH_WORKER, seen)
            worker.last_seen = now

    @staticmethod
    def _holder(
        token: str, workers: Iterable[tuple[Worker, datetime]]
    ) -> tuple[Worker | None, datetime | None]:
        digest = hash_token(token)
        for worker, now in workers:
            if hmac.compare_digest(worker.token_hash, digest):
                return worker, now
        return None, None

    # --- Claim ------------------------------------------------------------------

    def claim_next(
        self,
        worker: Worker,
        *,
        labels: Labels,
        now: datetime | None,
        max_leases: int,
    ) -> Job | None:
        # Most claims: nothing to do first, and the first batch with work has a
        # job free, or no batch has work. One statement (atomic by itself),
        # which takes the worker's turn and checks its cap too: CLAIM_SOLO,
        # the leaner, while the last claim for these labels found no rival
        # batch; CLAIM_FIRST, which charges fair shares, once one did.
        token = new_lease_token()
        row = self._claim_first(
            {
                **self._claim_params(worker, labels, token, now, max_leases),
                "cancel_grace": CANCEL_GRACE,
            }
        )
        if row is not RACED:
            expired, cancelling, first_batch, at, held, _, *picked = row
            if held is not None:
                self._check_turn(worker, held, max_leases)
            if picked[0] is not None:  # a job row joined
                job, written = self._leased(picked, worker, token)
                if written:
                    return job
            elif not (expired or cancelling or first_batch):
                return None  # an idle claim: one statement too
            now = at  # the long way uses the statement's instant
        # The long way: the ORM backend's, through the hooks below.
        return super().claim_next(worker, labels=labels, now=now, max_leases=max_leases)

    def _claim_first(self, params: dict[str, Any]) -> Any:
        """The row of CLAIM_SOLO while the last claim for these labels found
        no rival batch, else of CLAIM_FIRST (also when CLAIM_SOLO finds one:
        it wrote nothing), or RACED; the label set is remembered by what the
        statement found."""
        labels = params["labels"]
        solo = labels in self._alone
        row = self._claim_row(
            statements.CLAIM_SOLO if solo else statements.CLAIM_FIRST, params
        )
        if row is RACED:
            return row
        if row[FIRST_RIVAL]:
            self._alone.discard(labels)
            if solo:
                return self._claim_row(statements.CLAIM_FIRST, params)
        elif len(self._alone) < LABEL_SETS:
            self._alone.add(labels)
        return row

    def claim_many(
        self,
        worker: Worker,
        *,
        labels: Labels,
        max_jobs: int,
        now: datetime | None,
        max_leases: int,
    ) -> list[Job]:
        # One statement for all of them when that takes exactly what single
        # claims in a row would (CLAIM_MANY: no chores, the first batch
        # uncapped and without a rival), with one commit, one turn and one
        # counter shift per shard; the rest (the batch ran out, rows that
        # disagree or were taken) by single claims after it, as the ORM
        # backend makes them all.
        held = worker.live_leases
        if max_jobs > 1:
            tokens = [new_lease_token() for _ in range(max_jobs)]
            params = self._claim_params(worker, labels, "", now, max_leases)
            params.update(n=max_jobs, tokens=tokens, cancel_grace=CANCEL_GRACE)
            try:
                rows = self._fetchall(statements.CLAIM_MANY, params)
            except IntegrityError:  # a ledger row raced in: nothing was written
                rows = []
            if rows:
                expired, cancelling, first, capped, rival, at, turn = rows[0][:7]
                if turn is not None:
                    self._check_turn(worker, turn, max_leases)
                    held = turn
                if not (expired or cancelling or first):
                    return []  # nothing claimable: an idle claim, one statement
                now = at  # the single claims after it use its instant
                if not (expired or cancelling or capped or rival):
                    jobs = []
                    for *picked, token in (row[7:] for row in rows):
                        if picked[0] is None or token is None:
                            continue  # none picked, or left: rows disagree
                        job, _ = self._leased(picked, worker, token)
                        jobs.append(job)
                    if len(jobs) == max_jobs or held + len(jobs) >= max_leases:
                        return jobs
                    return self._claim_more(
                        jobs,
                        worker,
                        labels=labels,
                        max_jobs=max_jobs,
                        now=now,
                        max_leases=max_leases,
                        held=held,
                    )
        return self._claim_more(
            [],
            worker,
            labels=labels,
            max_jobs=max_jobs,
            now=now,
            max_leases=max_leases,
            held=held,
        )

    def _claim_plan(
        self, now: datetime, labels: Labels
    ) -> tuple[bool, bool, Iterable[Candidate]]:
        """The chores and the candidates in one probe (``CLAIM_PLAN``), the
        requirements matched in SQL (jsonb containment)."""
        rows = self._fetchall(
            statements.CLAIM_PLAN,
            {
                "now": now,
                "cancel_grace": CANCEL_GRACE,
                "limit": CLAIM_BATCH_CANDIDATES,
                "labels": json.dumps(labels),
            },
        )
        expired, cancelling = rows[0][:2]
        candidates = [
            Candidate(batch_id, priority, capped)
            for _, _, batch_id, priority, capped in rows
            if batch_id is not None
        ]
        return expired, cancelling, candidates

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
        if candidate.capped:  # claims of it take turns on its row: the ORM code
            return super()._claim_in_batch(
                candidate,
                worker,
                now,
                labels=labels,
                charge=charge,
                max_leases=max_leases,
            )
        # One statement, so atomic by itself. If the rows it found disagree it
        # wrote nothing, and the ORM code (which heals them) runs instead.
        token = new_lease_token()
        row = self._claim_row(
            statements.CLAIM,
            {
                **self._claim_params(worker, labels, token, now, max_leases),
                "batch": candidate.batch_id,
                "charge": charge,
            },
        )
        if row is not RACED:
            held, *picked = row
            self._check_turn(worker, held, max_leases)
            if picked[0] is None:
                return None
            job, written = self._leased(picked, worker, token)
            if written:
                return job
        return super()._claim_in_batch(
            candidate,
            worker,
            now,
            labels=labels,
            charge=charge,
            max_leases=max_leases,
        )

    @staticmethod
    def _check_turn(worker: Worker, held: int, max_leases: int) -> None:
        """Refuse the claim its turn answered for: -1 is a disabled worker."""
        if held < 0:
            raise WorkerDisabled(worker.name)
        if held >= max_leases:
            raise TooManyLeases(worker.name, held, max_leases)

    def _claim_params(
        self,
        worker: Worker,
        labels: Labels,
        token: str,
        now: datetime | None,
        max_leases: int,
    ) -> dict[str, Any]:
        return {
            "worker": worker.pk,
            # Matched against each batch's ``requires`` (jsonb containment:
            # exactly ``satisfies`` for flat maps of strings).
            "labels": json.dumps(labels),
            "token": token,
            "now": now,
            "lease_seconds": lease_duration().total_seconds(),
            "cap": max_leases,
        }

    def _claim_row(self, sql: str, params: dict[str, Any]) -> Any:
        """Run a claim statement and return its row, or RACED if its lease insert
        met an open ledger row committed after the statement's snapshot (one
        open row per job): nothing was written, and the ORM path, which closes
        such a row, runs instead."""
        try:
            return self._fetchone(sql, params)
        except IntegrityError:
            return RACED

    def _leased(self, row: Any, worker: Worker, token: str) -> tuple[Job, bool]:
        """The job a claim statement picked, as the claim left it (if True),
        with its item and batch: the fields the statement returns
        (``statements.CLAIMED_JOB_FIELDS``...) and those the claim wrote; the
        others, which no claim changes, deferred."""
        n, m = len(statements.CLAIMED_JOB_FIELDS), len(statements.CLAIMED_ITEM_FIELDS)
        job = self._from_db(Job, row[:n], statements.CLAIMED_JOB_FIELDS)
        item = self._from_db(BatchItem, row[n : n + m], statements.CLAIMED_ITEM_FIELDS)
        item.batch_id = job.batch_id
        job.item = item
        batch_name, stray_lease, at, expires = row[n + m :]
        job.batch = self._partial(Batch, id=job.batch_id, name=batch_name)
        if item.status != ItemStatus.QUEUED or stray_lease:
            return job, False
        job.status = JobStatus.LEASED
        job.lease_token, job.leased_by = token, worker
        job.lease_expires_at, job.heartbeat_at, job.updated_at = expires, at, at
        job.attempts += 1
        item.status, item.updated_at = ItemStatus.TRANSCRIBING, at
        return job, True

    # --- Heartbeat --------------------------------------------------------------

    def heartbeat(
        self, job_id: int, lease_token: str, *, worker: Worker, now: datetime | None
    ) -> datetime:
        # The job's deadline and its ledger row's in one statement (the most
        # frequent call of all: every worker, every few seconds).
        row = self._fetchone(
            statements.HEARTBEAT,
            {
                "job": job_id,
                "token": lease_token,
                "worker": worker.pk,
                "now": now,
                "lease_seconds": lease_duration().total_seconds(),
            },
        )
        if row is None:
            raise LeaseLost(lost_detail(job_id))
        return row[0]

    def heartbeat_many(
        self,
        leases: Sequence[tuple[int, str]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[datetime | str]:
        # One statement for all of a worker's leases: at fleet scale heartbeats
        # are most of the calls, and this is what makes a batch of them cheap.
        rows = self._fetchall(
            statements.HEARTBEAT_MANY,
            {
                "jobs": [job_id for job_id, _ in leases],
                "tokens": [token for _, token in leases],
                "worker": worker.pk,
                "now": now,
                "lease_seconds": lease_duration().total_seconds(),
            },
        )
        return [
            expires if expires is not None else LEASE_LOST if exists else NOT_FOUND
            for expires, exists in rows
        ]

    # --- Complete ---------------------------------------------------------------

    def complete(
        self,
        job_id: int,
        lease_token: str,
        *,
        worker: Worker,
        result: dict[str, Any],
        now: datetime | None,
    ) -> Job | None:
        row = self._fetchone(
            statements.COMPLETE,
            {
                "job": job_id,
                "token": lease_token,
                "worker": worker.pk,
                "result": json.dumps(result),
                "now": now,
                # The quality flags are decided in the statement, from these
                # and the item it locks (batches.flags, mirrored in COMPLETE).
                "words": words(result.get("text")),
                "heard": language_name(result.get("language")),
                "per_minute": settings.RECALL_MIN_WORDS_PER_MINUTE,
            },
        )
        if row is not None:
            item_status, lease_id, batch_id, attempts, at, tail = row
            clean = item_status == ItemStatus.TRANSCRIBING and lease_id is not None
            if clean and not tail:
                return self._partial(
                    Job,
                    id=job_id,
                    batch_id=batch_id,
                    attempts=attempts,
                    status=JobStatus.COMPLETED,
                    result=result,
                    finished_at=at,
                    updated_at=at,
                )
            now = at
        # Not live (a replay, a stale token), rows that disagree, or the batch's
        # tail (this completion may finish it): the ORM code decides, heals,
        # and checks the finish under the batch's lock.
        return super().complete(
            job_id, lease_token, worker=worker, result=result, now=now
        )

    def complete_many(
        self,
        completions: Sequence[tuple[int, str, dict[str, Any]]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[Job | str | None]:
        # One statement for every clean completion (COMPLETE_MANY); the others
        # (not live: a replay, a stale token, no such job; rows that disagree;
        # a batch in its tail) are decided by the ORM code afterwards, in a
        # transaction of its own, exactly as the single completion leaves
        # them to it. The statement commits by itself first: each entry is
        # judged alone either way, and the common case (all clean) costs no
        # BEGIN, COMMIT or savepoint round trips.
        rows = self._fetchall(
            statements.COMPLETE_MANY,
            {
                "jobs": [job_id for job_id, _, _ in completions],
                "tokens": [token for _, token, _ in completions],
                "results": [json.dumps(result) for _, _, result in completions],
                "words": [words(result.get("text")) for _, _, result in completions],
                "heard": [
                    language_name(result.get("language"))
                    for _, _, result in completions
                ],
                "worker": worker.pk,
                "now": now,
                "per_minute": settings.RECALL_MIN_WORDS_PER_MINUTE,
            },
        )
        answers: list[Job | str | None] = []
        rest: list[int] = []
        for n, ((job_id, _, result), row) in enumerate(
            zip(completions, rows, strict=True)
        ):
            _, _, _, batch_id, attempts, at, _, written = row
            if written:
                answers.append(
                    self._partial(
                        Job,
                        id=job_id,
                        batch_id=batch_id,
                        attempts=attempts,
                        status=JobStatus.COMPLETED,
                        result=result,
                        finished_at=at,
                        updated_at=at,
                    )
                )
                continue
            answers.append(None)
            rest.append(n)
            if at is not None:
                now = at  # the long way uses the statement's instant
        if rest:
            decided = super().complete_many(
                [completions[n] for n in rest], worker=worker, now=now
            )
            for n, answer in zip(rest, decided, strict=True):
                answers[n] = answer
        return answers

    # --- Reclaim ----------------------------------------------------------------

    def _reclaim_chunk(
        self,
        now: datetime,
        size: int,
        *,
        wait: bool,
        among: QuerySet[Job] | None = None,
    ) -> tuple[int, int, int]:
        if among is not None:  # a selection: the ORM code filters it
            return super()._reclaim_chunk(now, size, wait=wait, among=among)
        rows = self._fetchall(
            statements.RECLAIM_WAITING if wait else statements.RECLAIM_UNLESS_BUSY,
            {"now": now, "size": size, "expired": LEASE_EXPIRED},
        )
        requeued = failed = 0
        unclean = []
        for job_id, clean, attempts, worker_id, batch_id in rows:
            if not clean:
                unclean.append(job_id)
                continue
            requeued += 1
            log_lease(
                "reclaimed",
                Job(pk=job_id, batch_id=batch_id, attempts=attempts),
                worker_id=worker_id,
            )
        if unclean:
            _, healed_requeued, healed_failed = super()._reclaim_chunk(
                now, len(unclean), wait=wait, among=Job.objects.filter(pk__in=unclean)
            )
            requeued, failed = requeued + healed_requeued, failed + healed_failed
        return len(rows), requeued, failed

    # --- Intake -----------------------------------------------------------------

    def _insert_items(
        self, batch: Batch, items: Iterable[ItemRow], *, now: datetime
    ) -> None:
        """COPY: the driver's fastest bulk path."""
        columns = ", ".join(self.ITEM_COLUMNS)
        table = BatchItem._meta.db_table
        with (
            self.connection.cursor() as cursor,
            cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy,
        ):
            for row in self._item_rows(batch, items, now):
                copy.write_row(row)

    # --- Statements -------------------------------------------------------------

    def _fetchone(self, sql: str, params: dict[str, Any]) -> Any:
        cursor = self._cursor()
        self._execute(cursor, sql, params)
        return cursor.fetchone()

    def _fetchall(self, sql: str, params: dict[str, Any]) -> list[Any]:
        cursor = self._cursor()
        self._execute(cursor, sql, params)
        return cursor.fetchall()

    def _cursor(self) -> psycopg.RawCursor[Any]:
        """A cursor with server-side binding on Django's connection, so that each
        statement here is prepared once per connection and then only executed
        (Django's own cursors bind client-side: every query is planned anew).
        A raw cursor: the statements come with PostgreSQL's own placeholders
        (``native``), so psycopg has nothing to convert per execution.

        Django's own cursor() health-checks a reused connection first (a database
        restart leaves it dead); bypassing cursor(), this must do the same.

        One cursor serves every statement of the connection (the backend, like
        the connection, belongs to one thread): a new one per statement cost
        its set-up and its loaders' each time, about 3% of a claim and a
        completion. A reconnection (a new connection object) gets a new one."""
        self.connection.close_if_health_check_failed()
        self.connection.ensure_connection()
        raw = self.connection.connection
        cursor = self._raw_cursor
        if cursor is not None and cursor.connection is raw and not cursor.closed:
            return cursor
        if (
            raw.prepare_threshold is None
            and self.prepare
            and not self.connection.settings_dict["OPTIONS"].get("server_side_binding")
        ):
            # Django turns psycopg's statement preparation off. Its own cursors
            # bind client-side and are never prepared, so this turns it on only
            # for the cursors made here.
            raw.prepare_threshold = PREPARE_THRESHOLD
        self._raw_cursor = cursor = psycopg.RawCursor(raw)
        if self.connection.timezone is UTC and raw.info.timezone is UTC:
            # Django reads timestamps with a loader of its own, in Python, that
            # sets the zone Django expects on psycopg's result: when both are
            # UTC, psycopg's own loader (in C) gives the same datetimes. Each
            # value cost about 40,000 instructions in Python, and a claim and
            # its completion read nine: a third of the model layer's work.
            cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
        return cursor

    def _execute(
        self, cursor: psycopg.RawCursor[Any], sql: str, params: dict[str, Any]
    ) -> None:
        # Inside a caller's transaction, a savepoint: a failed statement must not
        # leave that transaction aborted (as Django's atomic() guarantees for the
        # ORM path). Errors surface as Django's (IntegrityError...).
        savepoint = (
            transaction.atomic(using=self.connection.alias)
            if self.connection.in_atomic_block
            else nullcontext()
        )
        text, names = native(sql)
        with savepoint, self.connection.wrap_database_errors:
            cursor.execute(text, [params[n] for n in names], prepare=self.prepare)

    def _from_db(
        self,
        model: type[Model],
        values: Sequence[Any],
        fields: tuple[str, ...] | None = None,
    ) -> Any:
        """A model instance from a row of its concrete columns (or of those of
        ``fields``, in the model's order: the others deferred), as the ORM
        builds it (``from_db`` plus the fields' converters: JSON arrives as
        text)."""
        attnames, converters = _columns(model, fields)
        if len(values) != len(attnames):
            raise ValueError(f"{len(values)} values for {len(attnames)} columns")
        row = list(values)
        for i, convert in converters:
            row[i] = convert(row[i], None, self.connection)
        return _loaded(model, self.connection.alias, attnames, row)

    def _partial(self, model: type[Model], **values: Any) -> Any:
        """An instance of ``model`` with just these fields (attnames), as a query
        that selected only them gives it: the others are deferred, read from the
        database if ever asked for. ``model(**values)`` would compute every other
        field's default on each call instead, several times the cost."""
        # from_db reads the values in the model's field order, whatever order
        # the names are given in: hand them over in that order.
        names = [f.attname for f in model._meta.concrete_fields if f.attname in values]
        return _loaded(
            model, self.connection.alias, names, [values[name] for name in names]
        )


def _loaded(
    model: type[Model], alias: str, names: Sequence[str], values: Sequence[Any]
) -> Any:
    """``model.from_db(alias, names, values)`` (``names`` in field order, the
    model's other fields deferred), with the values put in the instance's
    ``__dict__`` instead of passed through ``Model.__init__``: that is all
    ``__init__`` does with them for a model of plain fields (it skips a
    deferred field, and a foreign key's id, set on a new instance, clears no
    cached object), and taking each of some forty values through ``setattr``
    one by one cost a claim and its completion about 8% of the app's time
    (docs/development/benchmark-history.md). A model for which ``__init__``
    would do more (an ``__init__`` or ``from_db`` of its own, a field with a
    descriptor of its own, a receiver of ``pre_init`` or ``post_init``) goes
    through ``from_db``."""
    if not _plain(model) or pre_init.receivers or post_init.receivers:
        return model.from_db(alias, names, values)
    instance = model.__new__(model)
    instance.__dict__.update(zip(names, values, strict=True))
    instance._state = state = ModelState()
    state.adding, state.db = False, alias
    return instance


@functools.cache
def _plain(model: type[Model]) -> bool:
    """Whether ``Model.__init__`` only stores ``model``'s field values (see
    ``_loaded``)."""
    below_model = model.__mro__[: model.__mro__.index(Model)]
    return not any(
        "__init__" in vars(c) or "from_db" in vars(c) for c in below_model
    ) and all(
        type(model.__dict__.get(f.attname)) in _PLAIN_DESCRIPTORS
        for f in model._meta.concrete_fields
    )


_PLAIN_DESCRIPTORS = (DeferredAttribute, ForeignKeyDeferredAttribute)


@functools.cache
def _columns(
    model: type[Model], only: tuple[str, ...] | None = None
) -> tuple[list[str], list[tuple[int, Any]]]:
    """A model's concrete columns in order (attnames; those of fields ``only``,
    if given, which must come in the model's order), and the converter of
    each column that has one (its index and ``from_db_value``), found once."""
    fields = [f for f in model._meta.concrete_fields if only is None or f.name in only]
    if only is not None and tuple(f.name for f in fields) != only:
        raise ValueError(f"{only} are not {model.__name__}'s fields in its order")
    converters = [
        (i, _json_reader(f) if isinstance(f, JSONField) else f.from_db_value)
        for i, f in enumerate(fields)
        if hasattr(f, "from_db_value")
    ]
    return [f.attname for f in fields], converters


def _json_reader(field: JSONField) -> Callable[[Any, Any, Any], Any]:
    """``field.from_db_value`` with one decoder made for good: Django's
    ``json.loads(value, cls=field.decoder)`` makes a new decoder (and its
    scanner) for every value, two thirds of reading a small object (about
    5 µs of 7.5): a claim given a job reads three (the worker's labels, the
    job's requirements, the item's params), every request one. The decoder
    keeps no state between calls (its C scanner clears its memo, and holds
    the GIL throughout, when no parse hook is set, as none is on these
    columns), so the threads may share it. A value that is not text, or
    starts with a byte order mark (which json.loads refuses), goes to the
    field's own converter as before."""
    decoder = (field.decoder or json.JSONDecoder)()
    fallback = field.from_db_value

    def read(value: Any, expression: Any, connection: Any) -> Any:
        if not isinstance(value, str) or value.startswith("\ufeff"):
            return fallback(value, expression, connection)
        try:
            return decoder.decode(value)
        except json.JSONDecodeError:
            return value  # as from_db_value: text that is not JSON stays text

    return read
