"""Every state transition Recall makes, in one place.

This package is the only code that writes jobs, items, lease-ledger rows,
progress counters, throughput buckets, tallies, events and the webhook outbox
(events, their deliveries and attempts; ``outbox.py``, ``webhook_writes.py``). Each
function below is one transition: it runs in one transaction (or in bounded
transactions, for bulk actions) and moves, together, the job (``Job.status``
and its lease fields), its item (``item_status_for(job.status)``), the batch's
counters and throughput bucket, the job's ledger row and, when it finishes the
batch, the batch's ``batch.finished`` event; or writes nothing.

Two backends write the hot transitions (claim, complete, reclaim), chosen once
per connection (``choice.py``) behind one declared interface
(``backends/base.py``): the portable ORM backend (``backends/orm.py``, the
reference and PostgreSQL's healing path) and the PostgreSQL statement backend
(``backends/postgres.py`` with ``backends/statements.py``). The other
transitions are portable ORM code shared by both (``actions.py``,
``repairs.py``, ``purge.py``, ``webhook_writes.py``, ``workers.py``).
A differential test runs every transition through both and compares the rows.

Time: ``now=None`` means the database's clock on PostgreSQL (web nodes and
sweepers on different machines disagree; the database is the one clock they
share) and the process clock on SQLite. Tests pass ``now`` explicitly.

Callers (API views, UI views, admin actions, the sweep, commands) never write
those rows themselves; they call these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet

from batches.flags import parse_flag
from batches.labels import Labels, clean_labels
from batches.models import Batch
from jobs.models import Job, JobQuerySet, WebhookEndpoint, WebhookEvent, Worker

from . import actions, purge, repairs, rules, webhook_writes, workers
from .actions import Audit
from .backends import ItemRow
from .choice import backend
from .purge import Purged
from .rows import log_lease
from .webhook_writes import Claimed, Outcome

__all__ = [
    "Audit",
    "Claimed",
    "ItemRow",
    "Outcome",
    "Purged",
    "acquire_webhook_dispatcher",
    "authenticate_worker",
    "authenticate_workers",
    "backend",
    "cancel_batch",
    "cancel_batch_chunk",
    "cancel_job",
    "cancel_queued",
    "claim_many",
    "claim_next",
    "claim_webhook_deliveries",
    "close_stray_leases",
    "complete",
    "complete_many",
    "create_batch",
    "create_webhook_endpoint",
    "create_worker",
    "disable_and_reclaim",
    "drop_throughput",
    "fail",
    "fail_exhausted",
    "finish_cancel",
    "finish_interrupted_cancel",
    "force_reclaim",
    "force_reclaim_many",
    "hand_over_webhook_dispatcher",
    "heal_item",
    "heartbeat",
    "heartbeat_many",
    "now",
    "pause_batch",
    "purge_batch_chunk",
    "reclaim_expired",
    "record_webhook_attempt",
    "recount",
    "redeliver_webhooks",
    "reencrypt_webhook_secrets",
    "release",
    "release_webhook_dispatcher",
    "reopen_batch_of",
    "rerun",
    "restore_lease_row",
    "resume_batch",
    "retry_failed",
    "rotate_webhook_secret",
    "rotate_worker_token",
    "send_test_webhook",
    "set_requires",
    "set_share",
    "set_webhook_endpoint_active",
    "set_worker_active",
    "settle",
    "touch_worker",
    "webhook_signing_secrets",
]


def now() -> datetime:
    """Recall's clock: the database's on PostgreSQL, the process's on SQLite."""
    return backend().now()


def _now(at: datetime | None) -> datetime:
    return backend().now() if at is None else at


def _pk(job: Job | int) -> int:
    return job if isinstance(job, int) else job.pk


# --- Workers ---------------------------------------------------------------------


def authenticate_worker(token: str) -> tuple[Worker | None, datetime | None]:
    """The worker holding ``token`` (active or not) and the request's time,
    read together (one statement on PostgreSQL); (None, None) if unknown."""
    return backend().authenticate(token)


def authenticate_workers(
    tokens: Sequence[str],
) -> list[tuple[Worker | None, datetime | None]]:
    """``authenticate_worker`` for each token, in order, read together (one
    statement on PostgreSQL): the woken long-poll claims of a server process."""
    return backend().authenticate_many(tokens)


def touch_worker(worker: Worker, *, now: datetime) -> None:
    """Record that the worker was seen at ``now`` (at most once per
    ``Worker.LAST_SEEN_RESOLUTION``): every API request does."""
    backend().touch(worker, now)


def create_worker(name: str) -> tuple[Worker, str]:
    """A new worker and its token (shown once: only its hash is stored)."""
    return workers.create_worker(name)


def rotate_worker_token(worker: Worker) -> str:
    return workers.rotate_token(worker)


def set_worker_active(worker: Worker, active: bool) -> bool:
    return workers.set_active(worker, active)


# --- A worker's lease ------------------------------------------------------------


def claim_next(
    worker: Worker,
    *,
    labels: Mapping[str, str] | None = None,
    now: datetime | None = None,
    max_leases: int | None = None,
) -> Job | None:
    """queued -> leased: the next claimable job for ``worker``, or None.

    ``labels`` are the labels the worker declares with this claim (cleaned
    by ``batches.labels.clean_labels``; None declares none): they become the
    worker's ``labels`` (written only when they changed), and the claim takes
    only jobs of batches whose ``requires`` they satisfy
    (``batches.labels.satisfies``). Priority, fair share and ``max_in_flight``
    decide among those batches as if the others did not exist.

    Expired leases are reclaimed and an interrupted batch cancel is finished
    first, so no expired lease stands while new work is handed out. Then the
    oldest claimable job of the first open batch by priority is leased (SKIP
    LOCKED: concurrent claims never take the same job).

    The worker's lease cap (``max_leases``, by default
    ``RECALL_MAX_LEASES_PER_WORKER``) is enforced here, in the claim's own
    transaction: the claims of one worker take turns on its row, and each
    counts the worker's live leases after its turn came, so simultaneous
    claims (plain or woken long-polls, on any number of processes) never
    lease it more. TooManyLeases when it holds that many already and there
    is a job it could take; nothing is written then. WorkerDisabled when the
    worker was disabled after its request was authenticated (the turn sees
    every disable committed before it): a disabled worker never gets a lease.
    """
    declared = _declare(worker, labels)
    limit = rules.max_leases() if max_leases is None else max_leases
    job = backend().claim_next(worker, labels=declared, now=now, max_leases=limit)
    if job is not None:
        log_lease("claimed", job, worker_id=worker.pk)
    return job


def claim_many(
    worker: Worker,
    *,
    labels: Mapping[str, str] | None = None,
    max_jobs: int,
    now: datetime | None = None,
    max_leases: int | None = None,
) -> list[Job]:
    """queued -> leased for up to ``max_jobs`` jobs: what ``claim_next`` up to
    ``max_jobs`` times in a row would lease, stopping at the first that finds
    nothing or at the worker's lease cap. The jobs leased, in claim order; []
    when none.

    The jobs are shared out among batches exactly as that many single claims
    in a row would share them (each is charged to its batch's fair share
    before the next one chooses), and each lease is all-or-nothing. How:

    * The ORM backend (the reference) makes exactly those single claims, one
      transaction each: no lock (the worker's turn, a job's, a counter
      shard's) is held from one job to the next.
    * On PostgreSQL, when single claims would take every job from one batch
      (nothing to do first, the first open batch in claim order is uncapped
      and no other open batch of its priority has work, so no claim is
      charged to anyone's share), one statement (``CLAIM_MANY``) leases them
      all: the chores probed once, the worker's turn taken once (its cap
      checked against its live leases counted after the turn came, so no
      number of simultaneous calls leases it past the cap), each counter
      shard and the commit once for all. The trade-off: the statement holds
      the worker's row, the jobs and those shards locked until it commits, a
      moment longer than one single claim does, and it is one transaction for
      the lot (all of them or none). Whatever it leaves (the batch ran out,
      rows taken meanwhile or disagreeing, a rival batch, chores, a capped
      batch) is taken by single claims after it, as the reference does.

    TooManyLeases (nothing written) only when the first claim finds the
    worker at its cap; after that, the cap just ends the run. The worker's
    ``live_leases`` (counted at its authentication) saves the claim that
    would be refused: the run stops once they and the new jobs reach the cap
    (each claim's turn still counts for itself, so a stale count never lets
    the worker over it). WorkerDisabled propagates: a disable reclaims the
    leases this run had already taken.
    """
    if max_jobs < 1:
        raise ValueError(f"max_jobs must be at least 1, not {max_jobs}")
    declared = _declare(worker, labels)
    limit = rules.max_leases() if max_leases is None else max_leases
    jobs = backend().claim_many(
        worker, labels=declared, max_jobs=max_jobs, now=now, max_leases=limit
    )
    for job in jobs:
        log_lease("claimed", job, worker_id=worker.pk)
    return jobs


def _declare(worker: Worker, labels: Mapping[str, str] | None) -> Labels:
    """The labels a claim declares (none: {}), kept as the worker's latest."""
    declared: Labels = {} if labels is None else dict(labels)
    workers.declare_labels(worker, declared)
    return declared


def heartbeat(
    job: Job | int, lease_token: str, *, worker: Worker, now: datetime | None = None
) -> datetime:
    """Extend a live lease; return its new expiry. LeaseLost if not live."""
    return backend().heartbeat(_pk(job), lease_token, worker=worker, now=now)


# Job ids a database column can hold; any other id names no job.
_MAX_DB_ID = 2**63 - 1


def heartbeat_many(
    leases: Sequence[tuple[int, str]],
    *,
    worker: Worker,
    now: datetime | None = None,
) -> list[datetime | str]:
    """Extend many leases of one worker at once, in one transaction (a worker
    with eight GPUs holds eight): ``leases`` are (job id, lease token) pairs,
    the job ids distinct. For each, in order, its new expiry, or why it was not
    renewed: ``rules.LEASE_LOST`` (the job is not leased to ``worker`` under
    that token) or ``rules.NOT_FOUND`` (there is no such job). Each is judged
    exactly as ``heartbeat`` judges it alone, and a lost one never stops the
    others being renewed."""
    ids = [job_id for job_id, _ in leases]
    if len(set(ids)) != len(ids):
        raise ValueError("a batched heartbeat names each job at most once")
    # An id no column can hold names no job (and must not reach the database).
    asked = [(job_id, token) for job_id, token in leases if 0 < job_id <= _MAX_DB_ID]
    answers = (
        dict(
            zip(
                (job_id for job_id, _ in asked),
                backend().heartbeat_many(asked, worker=worker, now=now),
                strict=True,
            )
        )
        if asked
        else {}
    )
    return [answers.get(job_id, rules.NOT_FOUND) for job_id in ids]


def complete(
    job: Job | int,
    lease_token: str,
    *,
    worker: Worker,
    result: dict[str, Any],
    now: datetime | None = None,
) -> None:
    """leased -> completed, with the result. Replaying the call with the token
    that completed it succeeds again and changes nothing (the worker may have
    lost the response). LeaseLost if the lease is not live.

    The item's quality flags (``batches.flags``) are decided by the backend
    from the result and the item's duration and requested language, and
    written with the completion."""
    done = backend().complete(
        _pk(job), lease_token, worker=worker, result=result, now=now
    )
    if done is not None:
        log_lease("completed", done, worker_id=worker.pk)


def complete_many(
    completions: Sequence[tuple[int, str, dict[str, Any]]],
    *,
    worker: Worker,
    now: datetime | None = None,
) -> list[str]:
    """leased -> completed for many jobs of one worker at once (a worker with
    several GPUs reports several results in one call): ``completions`` are
    (job id, lease token, result) triples, the job ids distinct. For each, in
    order: ``rules.COMPLETED`` (completed now, or already with this token: a
    replay, as ``complete`` accepts it), ``rules.LEASE_LOST`` (not this
    worker's live lease under that token) or ``rules.NOT_FOUND`` (no such
    job). Each is judged exactly as ``complete`` judges it alone, quality
    flags included, and one that is not live never stops the others.

    One transaction for them all on the ORM backend (jobs and items locked in
    id order, counters and throughput minutes shifted once per shard, the
    finish checks last, so a batch they finish gets its one
    ``batch.finished`` event as after as many single completions). On
    PostgreSQL one statement completes every clean one, and those it leaves
    (not live, drifted rows, a batch in its tail) are decided by the ORM code
    right after in a transaction of their own: each entry is all-or-nothing
    and judged alone either way, and the common case costs one round trip."""
    ids = [job_id for job_id, _, _ in completions]
    if len(set(ids)) != len(ids):
        raise ValueError("a batched completion names each job at most once")
    # An id no column can hold names no job (and must not reach the database).
    asked = [entry for entry in completions if 0 < entry[0] <= _MAX_DB_ID]
    answers = (
        dict(
            zip(
                (job_id for job_id, _, _ in asked),
                backend().complete_many(asked, worker=worker, now=now),
                strict=True,
            )
        )
        if asked
        else {}
    )
    outcomes = []
    for job_id in ids:
        answer = answers.get(job_id, rules.NOT_FOUND)
        if isinstance(answer, Job):
            log_lease("completed", answer, worker_id=worker.pk)
            answer = rules.COMPLETED
        elif answer is None:
            answer = rules.COMPLETED
        outcomes.append(answer)
    return outcomes


def fail(
    job: Job | int,
    lease_token: str,
    *,
    worker: Worker,
    error: str,
    retryable: bool = True,
    now: datetime | None = None,
) -> str:
    """leased -> queued (retryable, attempts left: after a backoff) or failed.
    Returns the job's new status. LeaseLost if the lease is not live."""
    failed = backend().fail(
        _pk(job),
        lease_token,
        worker=worker,
        error=error,
        retryable=retryable,
        now=now,
    )
    log_lease(f"failed ({failed.status})", failed, worker_id=worker.pk)
    return failed.status


def release(
    job: Job | int, lease_token: str, *, worker: Worker, now: datetime | None = None
) -> None:
    """leased -> queued at once, the attempt not counted (a clean shutdown)."""
    released = backend().release(_pk(job), lease_token, worker=worker, now=now)
    log_lease("released", released, worker_id=worker.pk, attempt=released.attempts + 1)


def reclaim_expired(
    *,
    now: datetime | None = None,
    limit: int | None = None,
    wait: bool = True,
    among: JobQuerySet | None = None,
) -> dict[str, int]:
    """leased -> queued (or failed, on the last attempt) for expired leases (of
    ``among`` only, if given), in bounded transactions. ``wait=False``: return
    at once if another process is reclaiming (a claim must not queue behind a
    sweep). Returns ``{"requeued": n, "failed": n}``."""
    return backend().reclaim_expired(now=now, limit=limit, wait=wait, among=among)


# --- Operators and admins --------------------------------------------------------


def force_reclaim(
    job: Job | int, *, actor: Any = None, now: datetime | None = None
) -> bool:
    """End a live lease now: job and item queued again, the ledger row closed
    as ``forced``, the attempt not counted, the old worker fenced out. False if
    the job was not leased."""
    return actions.force_reclaim(_pk(job), now=_now(now), actor=actor) is not None


def force_reclaim_many(
    jobs: JobQuerySet,
    *,
    actor: Any = None,
    now: datetime | None = None,
    audit: Audit | None = None,
) -> int:
    """``force_reclaim`` for every leased job of ``jobs``, one transaction each."""
    return actions.force_reclaim_many(jobs, now=_now(now), actor=actor, audit=audit)


def disable_and_reclaim(
    worker: Worker,
    *,
    actor: Any = None,
    now: datetime | None = None,
    audit: Audit | None = None,
) -> list[Job]:
    """Disable a worker and force-reclaim its live leases, in one transaction;
    the jobs whose leases ended."""
    return actions.disable_and_reclaim(worker, now=_now(now), actor=actor, audit=audit)


def cancel_job(
    job: Job | int, *, actor: Any = None, now: datetime | None = None
) -> bool:
    """queued -> cancelled for one job. False if it was not queued."""
    return actions.cancel_job(_pk(job), now=_now(now), actor=actor)


def cancel_queued(
    jobs: JobQuerySet,
    *,
    actor: Any = None,
    now: datetime | None = None,
    audit: Audit | None = None,
) -> int:
    """queued -> cancelled for the queued jobs of ``jobs``, in chunks."""
    return actions.cancel_queued(jobs, now=_now(now), actor=actor, audit=audit)


def retry_failed(
    jobs: JobQuerySet,
    *,
    actor: Any = None,
    now: datetime | None = None,
    audit: Audit | None = None,
) -> int:
    """failed -> queued with fresh attempts for the failed jobs of ``jobs``
    (not those of cancelled batches), reopening their batches, in chunks."""
    return actions.retry_failed(jobs, now=_now(now), actor=actor, audit=audit)


def rerun(
    batch: Batch | int,
    *,
    items: Sequence[int] | None = None,
    flag: str | None = None,
    requires: Mapping[str, str] | None = None,
    actor: Any = None,
    now: datetime | None = None,
) -> int:
    """done/failed -> queued as a new run, for the chosen ``items`` (item
    ids) of a batch or every done item with quality flag ``flag`` (exactly
    one of the two); returns how many.

    Attempts count afresh, the previous run is kept (``JobRun``: result,
    flags, worker, requirement) and the item's flags and flag counts are
    cleared until it completes again; ``requires`` (worker labels, checked by
    ``batches.labels.clean_labels``: LabelError) applies to these jobs only,
    on top of the batch's. A finished batch runs again and finishes again,
    with a new ``batch.finished`` event, as after ``retry_failed``. One
    transaction, audited by one event (who, how many, which requirement).
    RerunRefused when a named item is not the batch's or is not done or
    failed, BatchClosed for a cancelled batch, UnknownFlag for a flag that
    is not one; nothing is written then."""
    if (items is None) == (flag is None):
        raise ValueError("a re-run names either items or a flag")
    if flag is not None:
        flag = parse_flag(flag)
    return actions.rerun(
        batch if isinstance(batch, int) else batch.pk,
        items=items,
        flag=flag,
        requires=clean_labels(requires, what="requires"),
        now=_now(now),
        actor=actor,
    )


def cancel_batch(
    batch: Batch,
    *,
    actor: Any = None,
    now: datetime | None = None,
    time_limit: float | None = None,
) -> int:
    """Cancel a batch and its queued and in-flight jobs (in bounded
    transactions; after ``time_limit`` seconds reconciliation finishes the
    rest). Returns how many jobs this call cancelled."""
    return actions.cancel_batch(
        batch, now=_now(now), actor=actor, time_limit=time_limit
    )


def cancel_batch_chunk(
    batch_id: int, *, now: datetime | None = None, wait: bool = False
) -> int:
    """One transaction of a batch cancel: up to a chunk of its unfinished jobs."""
    return actions.cancel_batch_chunk(batch_id, now=_now(now), wait=wait)


def pause_batch(
    batch: Batch, *, actor: Any = None, now: datetime | None = None
) -> bool:
    """Stop handing out the batch's jobs. False if it was already paused."""
    return actions.pause_batch(batch, now=_now(now), actor=actor)


def resume_batch(
    batch: Batch, *, actor: Any = None, now: datetime | None = None
) -> bool:
    """Hand out the batch's jobs again. False if it was not paused."""
    return actions.resume_batch(batch, now=_now(now), actor=actor)


def create_batch(
    *,
    name: str,
    items: Iterable[ItemRow],
    priority: int = 0,
    weight: int = 1,
    max_in_flight: int | None = None,
    created_by: Any = None,
    now: datetime | None = None,
    on_created: Callable[[Batch], None] | None = None,
    requires: Mapping[str, str] | None = None,
) -> Batch:
    """The batch, its items (``(source, params, duration_ms)``), their jobs and
    counters, in one transaction. ``items`` may raise to abandon it all. The
    batch joins the fair-share rotation of its priority where the others are.
    ``requires``: the worker labels a worker must offer to claim its jobs
    (``batches.labels``; LabelError, nothing written, if they break the
    rules), stored with the batch. ``on_created(batch)`` runs last in the
    same transaction (a background intake marks itself done there, so the
    two commit together)."""
    return backend().create_batch(
        name=name,
        items=items,
        priority=priority,
        weight=weight,
        max_in_flight=max_in_flight,
        created_by=created_by,
        now=_now(now),
        on_created=on_created,
        requires=clean_labels(requires, what="requires"),
    )


def set_share(
    batch: Batch,
    *,
    priority: int,
    weight: int,
    max_in_flight: int | None,
    actor: Any = None,
    now: datetime | None = None,
) -> list[str]:
    """Change a batch's priority, weight and max in flight (effective for the
    next claim); records what changed as an event. Returns the changes."""
    return actions.set_share(
        batch,
        priority=priority,
        weight=weight,
        max_in_flight=max_in_flight,
        now=_now(now),
        actor=actor,
    )


def set_requires(
    batch: Batch,
    requires: Mapping[str, str],
    *,
    actor: Any = None,
    now: datetime | None = None,
) -> str | None:
    """Change the worker labels a batch requires (effective for the next
    claim); records what changed as an event. Returns the change in words,
    None when there was nothing to change. LabelError for requirements that
    break the rules; BatchClosed for a finished or cancelled batch (nothing
    is written either way)."""
    return actions.set_requires(
        batch,
        clean_labels(requires, what="requires"),
        now=_now(now),
        actor=actor,
    )


def settle(
    batches: QuerySet[Batch] | None = None, *, now: datetime | None = None
) -> int:
    """Mark finished the batches (all, by default) with nothing left to do,
    each with its ``batch.finished`` event (the safety net: the transition
    that finishes a batch normally marks it itself)."""
    return actions.settle(
        Batch.objects.all() if batches is None else batches, now=_now(now)
    )


# --- Repairs (reconciliation decides; each is one transaction) --------------------


def heal_item(job: Job | int, *, now: datetime | None = None) -> bool:
    return repairs.heal_item(_pk(job), now=_now(now))


def close_stray_leases(job: Job | int, *, now: datetime | None = None) -> int:
    return repairs.close_stray_leases(_pk(job), now=_now(now))


def restore_lease_row(job: Job | int, *, now: datetime | None = None) -> bool:
    return repairs.restore_lease_row(_pk(job), now=_now(now))


def fail_exhausted(job: Job | int, *, now: datetime | None = None) -> bool:
    return repairs.fail_exhausted(_pk(job), now=_now(now))


def reopen_batch_of(job: Job | int, *, now: datetime | None = None) -> bool:
    return repairs.reopen_batch_of(_pk(job), now=_now(now))


def recount(
    batch_id: int,
    *,
    now: datetime | None = None,
    requested_at: datetime | None = None,
) -> bool:
    """Make a batch's counters equal a fresh count of its items; True if they
    were wrong. Clears the batch's recount request if still ``requested_at``."""
    return repairs.recount(batch_id, now=_now(now), requested_at=requested_at)


def finish_cancel(
    batch_id: int, *, now: datetime | None = None, chunks: int | None = None
) -> int:
    return actions.finish_cancel(batch_id, now=_now(now), chunks=chunks)


def finish_interrupted_cancel(*, now: datetime | None = None) -> int:
    """The claim's share of reconciliation: one chunk of the oldest batch cancel
    left unfinished for longer than ``rules.CANCEL_GRACE``; how many jobs."""
    return actions.finish_interrupted_cancel(now=_now(now))


def drop_throughput(*, before: datetime) -> int:
    return repairs.drop_throughput(before=before)


# --- Retention ---------------------------------------------------------------------


def purge_batch_chunk(
    batch_id: int, *, finished_before: datetime, limit: int | None = None
) -> Purged:
    """One transaction of a purge: up to ``limit`` (``RECALL_CHUNK_SIZE``) of a
    batch's jobs with their items, ledger rows, events and outbox rows, off
    the counters; the batch itself once none is left. Only a batch finished
    (or cancelled and settled) before ``finished_before``, re-checked under
    its lock; otherwise nothing is deleted and ``refused`` says why."""
    return purge.purge_chunk(
        batch_id,
        finished_before=finished_before,
        limit=settings.RECALL_CHUNK_SIZE if limit is None else limit,
    )


# --- Webhooks (events are written by the transitions above: outbox.py) ------------


def create_webhook_endpoint(
    url: str,
    *,
    events: Sequence[str],
    description: str = "",
    now: datetime | None = None,
) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its secret (shown once, stored encrypted). The caller
    has checked the destination (``engine.webhooks.endpoints``)."""
    return webhook_writes.create_endpoint(
        url, events=events, description=description, now=_now(now)
    )


def rotate_webhook_secret(
    endpoint: WebhookEndpoint | int, *, now: datetime | None = None
) -> str:
    """A new secret (shown once); the old one is signed with too for
    ``RECALL_WEBHOOK_ROTATION_HOURS``."""
    pk = endpoint if isinstance(endpoint, int) else endpoint.pk
    return webhook_writes.rotate_secret(pk, now=_now(now))


def reencrypt_webhook_secrets() -> webhook_writes.Reencrypted:
    """Every endpoint's secrets under the current ``SECRET_KEY`` (those a
    ``SECRET_KEY_FALLBACKS`` key decrypts are encrypted again); see
    ``manage.py reencrypt_webhook_secrets``."""
    return webhook_writes.reencrypt_secrets()


def set_webhook_endpoint_active(
    endpoint: WebhookEndpoint | int,
    active: bool,
    *,
    reason: str = "",
    now: datetime | None = None,
) -> bool:
    pk = endpoint if isinstance(endpoint, int) else endpoint.pk
    return webhook_writes.set_endpoint_active(pk, active, reason=reason, now=_now(now))


def send_test_webhook(
    endpoint: WebhookEndpoint, *, now: datetime | None = None
) -> WebhookEvent:
    return webhook_writes.send_test_event(endpoint, now=_now(now))


def redeliver_webhooks(event_ids: Iterable[int], *, now: datetime | None = None) -> int:
    """Make every delivery of these events due now; how many."""
    return webhook_writes.redeliver(event_ids, now=_now(now))


def webhook_signing_secrets(
    endpoint: WebhookEndpoint, *, now: datetime | None = None
) -> list[str]:
    return webhook_writes.signing_secrets(endpoint, now=_now(now))


def claim_webhook_deliveries(
    *,
    limit: int,
    lease: timedelta,
    ids: Sequence[int] | None = None,
    now: datetime | None = None,
) -> list[Claimed]:
    """Take due deliveries, each under a lease (compare-and-set)."""
    return webhook_writes.claim_deliveries(
        now=_now(now), limit=limit, lease=lease, ids=ids
    )


def record_webhook_attempt(
    claimed: Claimed, outcome: Outcome, *, now: datetime | None = None
) -> str | None:
    return webhook_writes.record_attempt(claimed, outcome, now=_now(now))


def acquire_webhook_dispatcher(
    owner: str, *, ttl: timedelta, handover: str = "", now: datetime | None = None
) -> bool:
    return webhook_writes.acquire_dispatcher(
        owner, now=_now(now), ttl=ttl, handover=handover
    )


def hand_over_webhook_dispatcher(
    owner: str, token: str, *, now: datetime | None = None
) -> bool:
    return webhook_writes.hand_over_dispatcher(owner, token, now=_now(now))


def release_webhook_dispatcher(owner: str) -> None:
    webhook_writes.release_dispatcher(owner)
