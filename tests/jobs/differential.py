"""Run one program of transitions through a backend and photograph every row.

A program is a list of operations (plain tuples, so Hypothesis can generate
them and a failure prints them). ``run(program, backend)`` starts from an empty
database with its id sequences reset, builds the same world (users, workers,
batches), applies the operations with explicit times, and returns what each
operation answered and a snapshot of every row Recall writes after each step.
Run on both backends, the two results must be equal: the only things
normalised are tokens (random by design), values the transitions do not
write (a worker's token hash, its creation time), and the ids of rows found by
a key of their own (tallies, throughput buckets), which only say which was
first written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any

from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test.utils import override_settings

from batches.labels import LabelError
from batches.models import Batch, BatchCounter, BatchItem, BatchMinute, ItemStatus
from engine.reconcile import reconcile
from engine.sweep import sweep
from jobs import transitions
from jobs.exceptions import BatchClosed, LeaseLost, RerunRefused, TooManyLeases
from jobs.models import (
    Event,
    Job,
    JobRun,
    Lease,
    SweepState,
    Tally,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    Worker,
)
from jobs.tokens import TOKEN_PREFIX_LENGTH
from tests.support.factories import T0, make_batch

BACKENDS = ("auto", "orm")  # the PostgreSQL statement backend, the ORM backend
WORKERS = 3
# (items, priority, durations known): one batch with durations for the ms sums.
BATCHES = ((4, 0, True), (3, 5, False), (2, 0, False))
# The labels claims declare and the requirements batches are given, by index:
# some satisfy some, none satisfies all.
LABELS = ({}, {"gpu": "a100"}, {"gpu": "a100", "model": "large-v3"}, {"cpu": "x86"})
REQUIRES = ({}, {"gpu": "a100"}, {"gpu": "a100", "model": "large-v3"}, {"gpu": "h100"})

TABLES = [
    WebhookDelivery,
    WebhookEvent,
    WebhookEndpoint,
    Event,
    Lease,
    JobRun,
    Job,
    BatchMinute,
    BatchCounter,
    BatchItem,
    Batch,
    Worker,
    Tally,
    SweepState,
]

Op = tuple[Any, ...]


@dataclass
class World:
    now: datetime = T0
    workers: list[Worker] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # each worker's current token
    replaced: list[str] = field(default_factory=list)  # tokens rotated away
    batches: list[Batch] = field(default_factory=list)
    actor: User | None = None
    # Every lease handed out, in order: (job id, worker index, token).
    leases: list[tuple[int, int, str]] = field(default_factory=list)
    strays: int = 0  # stray ledger rows written behind Recall's back
    max_leases: int | None = None  # the lease cap claims are given (None: setting)

    def job_ids(self) -> list[int]:
        return list(Job.objects.order_by("pk").values_list("pk", flat=True))


def reset() -> None:
    """Empty every table Recall writes and restart their id sequences (inside
    the test's transaction: PostgreSQL rolls the restart back with it)."""
    tables = ", ".join(model._meta.db_table for model in TABLES)
    with connection.cursor() as cursor:
        # Django's foreign keys are checked at commit; TRUNCATE refuses to run
        # while such checks are pending, so run them now.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def build() -> World:
    world = World()
    world.actor = User.objects.get_or_create(username="differential-admin")[0]
    for i in range(WORKERS):
        worker, token = transitions.create_worker(f"w{i}")
        world.workers.append(worker)
        world.tokens.append(token)
    # An endpoint for every event type, so the outbox's deliveries are compared.
    transitions.create_webhook_endpoint(
        "https://receiver.example/hooks",
        events=["batch.finished", "item.failed"],
        now=T0,
    )
    for n, (items, priority, timed) in enumerate(BATCHES):
        # 15 s steps: the 30 s boundary of the "short" flag is among them; and
        # languages asked for, so a completion's language may differ.
        durations = [15.0 * (i + 1) for i in range(items)] if timed else None
        languages = [("en", "de", "")[i % 3] for i in range(items)] if timed else None
        world.batches.append(
            make_batch(
                items,
                name=f"b{n}",
                priority=priority,
                durations=durations,
                languages=languages,
                now=T0,
            )
        )
    return world


def apply(world: World, op: Op) -> Any:
    """Carry out one operation; return what it answered (compared too)."""
    kind, *args = op
    try:
        return _APPLY[kind](world, *args)
    except LeaseLost:
        return "lease_lost"
    except NoLease:
        return "no lease handed out yet"
    except TooManyLeases as refused:
        return ("too_many_leases", refused.held, refused.limit)


class NoLease(Exception):
    """An operation on the k-th lease before any lease was handed out."""


def _claim(world: World, w: int, labels: int | None = None) -> Any:
    """A claim of worker ``w`` declaring ``LABELS[labels]`` (None: none)."""
    if not world.workers[w].is_active:
        return "forbidden"  # the API's 403: a disabled worker never claims
    job = transitions.claim_next(
        world.workers[w],
        labels=None if labels is None else LABELS[labels],
        now=world.now,
        max_leases=world.max_leases,
    )
    if job is None:
        return None
    return _leased(world, w, job)


def _claim_many(world: World, w: int, n: int, labels: int | None = None) -> Any:
    """Up to ``n`` jobs in one claim of worker ``w`` (``max_jobs``)."""
    if not world.workers[w].is_active:
        return "forbidden"
    jobs = transitions.claim_many(
        world.workers[w],
        labels=None if labels is None else LABELS[labels],
        max_jobs=n,
        now=world.now,
        max_leases=world.max_leases,
    )
    return [_leased(world, w, job) for job in jobs]


def _leased(world: World, w: int, job: Job) -> Any:
    world.leases.append((job.pk, w, job.lease_token))
    return (job.pk, job.attempts, job.lease_expires_at, job.batch_id)


def _require(world: World, b: int, r: int) -> None:
    """Batch ``b`` requires ``REQUIRES[r]`` from now on (an operator's edit)."""
    Batch.objects.filter(pk=_batch(world, b).pk).update(requires=REQUIRES[r])


def _lease(world: World, k: int) -> tuple[int, Worker, str]:
    if not world.leases:
        raise NoLease
    job_id, w, token = world.leases[k % len(world.leases)]
    return job_id, world.workers[w], token


def _heartbeat(world: World, k: int, stranger: int | None = None) -> Any:
    job_id, worker, token = _lease(world, k)
    if stranger is not None:
        worker = world.workers[stranger]
    return transitions.heartbeat(job_id, token, worker=worker, now=world.now)


def _heartbeat_many(
    world: World, ks: list[int], stranger: int | None = None, unknown: bool = False
) -> Any:
    """One batched heartbeat of the k-th leases (the first of each job: ids are
    distinct), as their holder or as ``stranger``, with a job that does not
    exist at the end if ``unknown``."""
    leases: dict[int, str] = {}
    worker = world.workers[0] if stranger is None else world.workers[stranger]
    for k in ks:
        job_id, holder, token = _lease(world, k)
        leases.setdefault(job_id, token)
        if stranger is None:
            worker = holder  # one worker's call: the last named lease's holder
    if unknown:
        leases[10_000] = "no-such-job"
    return transitions.heartbeat_many(
        list(leases.items()), worker=worker, now=world.now
    )


def _complete(
    world: World, k: int, text: str = "t", language: str | None = None
) -> Any:
    job_id, worker, token = _lease(world, k)
    result: dict[str, Any] = {
        "text": text,
        "segments": [{"start": 0.0, "end": 1.5, "text": text}],
    }
    if language is not None:
        result["language"] = language
    return transitions.complete(
        job_id, token, worker=worker, result=result, now=world.now
    )


# What the results of a batched completion say, by position: flagged every way.
MANY_RESULTS = (("t", None), ("", "en"), ("a b c", "de"), (" ".join(["w"] * 30), "DE"))


def _complete_many(
    world: World, ks: list[int], stranger: int | None = None, unknown: bool = False
) -> Any:
    """One batched completion of the k-th leases (the first of each job: ids
    are distinct), as their holder or as ``stranger``, with a job that does
    not exist at the end if ``unknown``; the n-th result ``MANY_RESULTS[n % 4]``."""
    entries: dict[int, tuple[str, dict[str, Any]]] = {}
    worker = world.workers[0] if stranger is None else world.workers[stranger]
    for n, k in enumerate(ks):
        job_id, holder, token = _lease(world, k)
        text, language = MANY_RESULTS[n % len(MANY_RESULTS)]
        result: dict[str, Any] = {"text": text}
        if language is not None:
            result["language"] = language
        entries.setdefault(job_id, (token, result))
        if stranger is None:
            worker = holder  # one worker's call: the last named lease's holder
    if unknown:
        entries[10_000] = ("no-such-job", {"text": "t"})
    return transitions.complete_many(
        [(job_id, token, result) for job_id, (token, result) in entries.items()],
        worker=worker,
        now=world.now,
    )


def _fail(world: World, k: int, retryable: bool) -> Any:
    job_id, worker, token = _lease(world, k)
    return transitions.fail(
        job_id,
        token,
        worker=worker,
        error=f"engine error {k}",
        retryable=retryable,
        now=world.now,
    )


def _release(world: World, k: int) -> Any:
    job_id, worker, token = _lease(world, k)
    return transitions.release(job_id, token, worker=worker, now=world.now)


def _authenticate(world: World) -> Any:
    """Every kind of token a request may bear (each worker's own, the ones
    rotated away, a known prefix with a wrong secret, an unknown one, one too
    short to look up), read one by one (a request) and together (a woken
    long-poll wave): who holds each, active or not, with how many live
    leases, and whether the request's time came with it."""
    tokens = [
        *world.tokens,
        *world.replaced,
        world.tokens[0][:TOKEN_PREFIX_LENGTH] + "-not-the-secret",
        "no-worker-holds-this-token",
        "short",
    ]
    one_by_one = [_holder(*transitions.authenticate_worker(t)) for t in tokens]
    together = [_holder(*answer) for answer in transitions.authenticate_workers(tokens)]
    return one_by_one, together


def _holder(worker: Worker | None, now: datetime | None) -> Any:
    if worker is None:
        return None if now is None else ("time without a worker", now)
    return worker.pk, worker.is_active, worker.live_leases, isinstance(now, datetime)


def _rotate(world: World, w: int) -> None:
    world.replaced.append(world.tokens[w])
    world.tokens[w] = transitions.rotate_worker_token(world.workers[w])


def _disable(world: World, w: int) -> Any:
    jobs = transitions.disable_and_reclaim(
        world.workers[w], actor=world.actor, now=world.now
    )
    return [job.pk for job in jobs]


def _enable(world: World, w: int) -> Any:
    return transitions.set_worker_active(world.workers[w], True)


def _set_requires(world: World, b: int, pairs: tuple[tuple[str, str], ...]) -> Any:
    try:
        return transitions.set_requires(
            _batch(world, b), dict(pairs), actor=world.actor, now=world.now
        )
    except BatchClosed:
        return "batch_closed"


def _cap(world: World, max_leases: int) -> None:
    """Claims from now on are given this lease cap."""
    world.max_leases = max_leases


def _tick(world: World, seconds: int) -> None:
    world.now += timedelta(seconds=seconds)


def _reclaim(world: World, limit: int | None = None) -> Any:
    return transitions.reclaim_expired(now=world.now, limit=limit)


def _sweep(world: World) -> Any:
    report = sweep(now=world.now)
    return report["reclaimed"], report["reconcile"], report.get("batches_finished")


def _reconcile(world: World) -> Any:
    return reconcile(now=world.now, recount=True).as_dict()


def _job(world: World, j: int) -> int:
    ids = world.job_ids()
    return ids[j % len(ids)]


def _force(world: World, j: int) -> Any:
    return transitions.force_reclaim(_job(world, j), actor=world.actor, now=world.now)


def _cancel_job(world: World, j: int) -> Any:
    return transitions.cancel_job(_job(world, j), actor=world.actor, now=world.now)


def _batch(world: World, b: int) -> Batch:
    return world.batches[b % len(world.batches)]


def _cancel_batch(world: World, b: int) -> Any:
    return transitions.cancel_batch(_batch(world, b), actor=world.actor, now=world.now)


def _cancel_queued(world: World, b: int) -> Any:
    jobs = Job.objects.filter(batch=_batch(world, b))
    return transitions.cancel_queued(jobs, actor=world.actor, now=world.now)


def _retry(world: World, b: int) -> Any:
    jobs = Job.objects.filter(batch=_batch(world, b))
    return transitions.retry_failed(jobs, actor=world.actor, now=world.now)


def _rerun(world: World, b: int, chosen: str, r: int = 0) -> Any:
    """Re-run batch ``b``'s items requiring ``REQUIRES[r]``: ``chosen`` is
    "all" (every item: refused while one is queued or in flight), "ended"
    (its done and failed items) or a quality flag."""
    batch = _batch(world, b)
    items = BatchItem.objects.filter(batch=batch).order_by("pk")
    if chosen == "ended":
        items = items.filter(status__in=[ItemStatus.DONE, ItemStatus.FAILED])
    selection: dict[str, Any] = (
        {"flag": chosen}
        if chosen not in ("all", "ended")
        else {"items": list(items.values_list("pk", flat=True))}
    )
    if selection.get("items") == []:
        return "nothing to name"
    try:
        return transitions.rerun(
            batch, requires=REQUIRES[r], actor=world.actor, now=world.now, **selection
        )
    except RerunRefused as refused:
        return ("refused", refused.missing, refused.busy)
    except BatchClosed:
        return "batch_closed"
    except LabelError:
        return "label_error"


def _pause(world: World, b: int) -> Any:
    return transitions.pause_batch(_batch(world, b), actor=world.actor, now=world.now)


def _resume(world: World, b: int) -> Any:
    return transitions.resume_batch(_batch(world, b), actor=world.actor, now=world.now)


def _share(world: World, b: int, priority: int, weight: int, cap: int | None) -> Any:
    return transitions.set_share(
        _batch(world, b),
        priority=priority,
        weight=weight,
        max_in_flight=cap,
        actor=world.actor,
        now=world.now,
    )


def _settle(world: World) -> Any:
    return transitions.settle(now=world.now)


# Drift, as a manual SQL edit, a restored backup or a bug would leave it: the
# transitions must heal it the same way on both backends.


def _drift_item(world: World, j: int, status: str) -> None:
    job = Job.objects.get(pk=_job(world, j))
    BatchItem.objects.filter(pk=job.item_id).update(status=status)


def _stray_lease(world: World, j: int, w: int) -> None:
    job_id = _job(world, j)
    if not Lease.objects.filter(job_id=job_id, ended_at__isnull=True).exists():
        world.strays += 1
        Lease.objects.create(
            job_id=job_id,
            worker=world.workers[w],
            token=f"stray-{world.strays}",
            attempt=1,
            claimed_at=world.now,
        )


def _drop_ledger_row(world: World, k: int) -> None:
    _, _, token = _lease(world, k)
    Lease.objects.filter(token=token, ended_at__isnull=True).delete()


def _exhaust(world: World, j: int) -> None:
    Job.objects.filter(pk=_job(world, j), status="queued").update(
        attempts=Job.objects.get(pk=_job(world, j)).max_attempts
    )


_APPLY = {
    "claim": _claim,
    "claim_many": _claim_many,
    "require": _require,
    "heartbeat": _heartbeat,
    "heartbeat_many": _heartbeat_many,
    "complete": _complete,
    "complete_many": _complete_many,
    "fail": _fail,
    "release": _release,
    "tick": _tick,
    "cap": _cap,
    "reclaim": _reclaim,
    "sweep": _sweep,
    "reconcile": _reconcile,
    "force": _force,
    "cancel_job": _cancel_job,
    "cancel_batch": _cancel_batch,
    "cancel_queued": _cancel_queued,
    "retry": _retry,
    "rerun": _rerun,
    "pause": _pause,
    "resume": _resume,
    "settle": _settle,
    "share": _share,
    "drift_item": _drift_item,
    "stray_lease": _stray_lease,
    "drop_ledger_row": _drop_ledger_row,
    "exhaust": _exhaust,
    "authenticate": _authenticate,
    "rotate": _rotate,
    "disable": _disable,
    "enable": _enable,
    "set_requires": _set_requires,
}
ITEM_STATUSES = tuple(ItemStatus.values)


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row of every table the transitions write, normalised."""
    tokens: dict[str, str] = {}

    def token(value: str | None) -> str | None:
        if value is None:
            return None
        return tokens.setdefault(value, f"token-{len(tokens)}")

    rows: dict[str, list[dict[str, Any]]] = {}
    for model in TABLES:
        rows[model._meta.db_table] = list(model.objects.order_by("pk").values())
    for row in rows[Lease._meta.db_table]:
        row["token"] = token(row["token"])
    for row in rows[Job._meta.db_table]:
        row["lease_token"] = token(row["lease_token"])
    for row in rows[Worker._meta.db_table]:
        # Made by create_worker from a random token and the process clock.
        row.update(token_prefix="-", token_hash="-", created_at="-")
    for row in rows[WebhookEvent._meta.db_table]:
        row["webhook_id"] = "-"  # random by design: never repeats
    for row in rows[WebhookEndpoint._meta.db_table]:
        row["secret_encrypted"] = "-"  # a random secret, encrypted with a nonce
    for row in rows[SweepState._meta.db_table]:
        # The sweep's start plus however long it took: the moment of the clock.
        row.update(last_finished_at="-")
    # A tally is a counter found by its name; its id only says which backend
    # first counted it (a claim that reclaims an expired lease and repairs its
    # ledger row on the way counts both, in either order). Compare name and count.
    _by_key(rows, Tally, "name")
    # A throughput bucket is found by (batch, minute, shard), its one unique key;
    # its id only says in which order the buckets were first written. A batched
    # completion on PostgreSQL writes its clean results' buckets in one
    # statement and then those it leaves to the ORM code (a batch's tail, rows
    # that disagree), where the ORM backend writes them all in (batch, shard)
    # order. Compare the buckets by their key.
    _by_key(rows, BatchMinute, "batch_id", "minute", "shard")
    return rows


def _by_key(rows: dict[str, list[dict[str, Any]]], model, *key: str) -> None:
    """``model``'s rows without their ids, in the order of their unique ``key``."""
    table = model._meta.db_table
    rows[table] = sorted(
        ({k: v for k, v in row.items() if k != "id"} for row in rows[table]),
        key=itemgetter(*key),
    )


def _normalise_answer(answer: Any) -> Any:
    """Answers are compared too; a Job stands for its id."""
    if isinstance(answer, Job):
        return ("job", answer.pk)
    return answer


def run(program: list[Op], backend: str) -> list[tuple[Op, Any, dict[str, Any]]]:
    """The program's steps through ``backend``: (operation, answer, rows after)."""
    # A savepoint: an unexpected error fails this program without leaving the
    # test's transaction aborted for the next one.
    with override_settings(RECALL_TRANSITIONS_BACKEND=backend), transaction.atomic():
        reset()
        world = build()
        steps = [(("build",), None, snapshot())]
        for op in program:
            answer = _normalise_answer(apply(world, op))
            steps.append((op, answer, snapshot()))
    return steps


def first_difference(
    a: list[tuple[Op, Any, dict[str, Any]]], b: list[tuple[Op, Any, dict[str, Any]]]
) -> str | None:
    """Where two runs part (a readable account), or None if they never do."""
    for (op, answer_a, rows_a), (_, answer_b, rows_b) in zip(a, b, strict=True):
        if answer_a != answer_b:
            return f"after {op}: answered {answer_a!r} vs {answer_b!r}"
        for table, table_rows in rows_a.items():
            other = rows_b[table]
            if table_rows != other:
                for row_a, row_b in zip(table_rows, other, strict=False):
                    if row_a != row_b:
                        diff = {
                            k: (row_a[k], row_b.get(k))
                            for k in row_a
                            if row_a[k] != row_b.get(k)
                        }
                        return f"after {op}: {table} row {row_a.get('id')}: {diff}"
                return f"after {op}: {table} has {len(table_rows)} vs {len(other)} rows"
    return None
