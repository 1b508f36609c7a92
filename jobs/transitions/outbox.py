"""The webhook outbox: events written by the transitions that cause them.

A batch finishes when no item is queued or transcribing. Its counters are
sharded, so under READ COMMITTED two concurrent last completions in different
shards would each see the other's item still in flight, and neither would
notice the finish. So only the tail is serialised: a transition that moved an
item into a final status and, after its own change, sees no queued item in the
batch's counters takes the batch row's lock, re-reads the counters in a new
statement (which sees everything committed before the lock was granted), and
if nothing is queued or transcribing and the batch is not marked finished,
marks it finished, counts the finish (``Batch.finishes``) and writes the
``batch.finished`` event of that generation, unique on (batch, generation).
All in the transition's own transaction: if the event cannot be written, the
transition changes nothing. Everything that reopens a batch (retry failed,
reconciliation's reopen) writes the batch row too, so it serialises with the
check; ``settle`` (the sweep, a cancel) runs the same check for every
unfinished batch, which heals a finish nobody noticed.

A transition that may finish batches runs in ``finishing(now)`` instead of a
bare ``transaction.atomic()``: the moves register the batches they may have
finished (``may_finish``) and the checks run last, after every counter the
transition shifts, so every transition takes its locks in one order (jobs,
items, counters, throughput, batches) and none can deadlock another.

``item.failed`` events are written for items that failed for good, when an
active endpoint subscribes to them. Each event gets one delivery row per
subscribed endpoint; the first attempts are queued for the django-q2 cluster
when the transaction commits (ids only).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django_q.tasks import async_task

from batches.models import Batch, BatchCounter, ItemStatus
from jobs.models import (
    Job,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookEventType,
)

log = logging.getLogger("recall.webhooks")

# The django-q2 task that makes first attempts (named, not imported: the
# transition layer does not import the doors above it).
DELIVER_TASK = "engine.tasks.deliver_webhooks"

_finishing: ContextVar[set[int] | None] = ContextVar("recall_finishing", default=None)


class NotFinishing(RuntimeError):
    """An item moved into a final status outside ``finishing()`` (a bug)."""


@contextmanager
def finishing(now: datetime) -> Iterator[None]:
    """A transaction whose moves may finish batches; the finish checks run at
    its end, inside it."""
    with transaction.atomic():
        token = _finishing.set(set())
        try:
            yield
            candidates = _finishing.get() or set()
            if candidates:
                finish_tails(candidates, now=now)
        finally:
            _finishing.reset(token)


def may_finish(batch_ids: Iterable[int]) -> None:
    """Note batches an item just left for a final status (``finishing()``)."""
    ids = set(batch_ids)
    if not ids:
        return
    pending = _finishing.get()
    if pending is None:
        raise NotFinishing(
            "an item moved into a final status outside finishing(): the batch's "
            "finish would go unnoticed"
        )
    pending.update(ids)


def finish_tails(batch_ids: Iterable[int], *, now: datetime) -> int:
    """Run the locked finish check for the batches with nothing queued in the
    counters this transaction sees (the tail); return how many finished."""
    ids = sorted(set(batch_ids))
    queued = dict(
        BatchCounter.objects.filter(batch_id__in=ids)
        .values("batch_id")
        .annotate(n=Sum(ItemStatus.QUEUED))
        .values_list("batch_id", "n")
        .order_by()
    )
    return sum(finish_if_done(b, now=now) for b in ids if not queued.get(b))


def finish_if_done(batch_id: int, *, now: datetime) -> bool:
    """Mark the batch finished and write its ``batch.finished`` event if it has
    nothing queued or in flight and is not marked finished; in the caller's
    transaction. True if it finished now."""
    batch = (
        Batch.objects.select_for_update(no_key=True)
        .filter(pk=batch_id, finished_at__isnull=True)
        .first()
    )
    if batch is None:
        return False
    # A new statement, after the lock: it sees every transition committed
    # before the lock was granted, including the last completions of others.
    counts = BatchCounter.objects.filter(batch_id=batch_id).totals()
    if counts[ItemStatus.QUEUED] or counts[ItemStatus.TRANSCRIBING]:
        return False
    batch.finished_at = now
    batch.finishes += 1
    Batch.objects.filter(pk=batch_id).update(finished_at=now, finishes=batch.finishes)
    emit(
        WebhookEventType.BATCH_FINISHED,
        {"batch": batch_data(batch, counts)},
        now=now,
        batch_id=batch_id,
        generation=batch.finishes,
        endpoints=WebhookEndpoint.objects.subscribed_to(
            WebhookEventType.BATCH_FINISHED
        ),
    )
    log.info(
        "batch %s finished (finish %s)",
        batch_id,
        batch.finishes,
        extra={"batch": batch_id},
    )
    return True


def batch_data(batch: Batch, counts: dict[str, int]) -> dict[str, Any]:
    """The ``data.batch`` of a ``batch.finished`` event. ``state`` is the word
    the operator UI shows for a batch with nothing left to do."""
    return {
        "id": batch.pk,
        "name": batch.name,
        "state": "cancelled" if batch.cancelled_at else "finished",
        "total": batch.total,
        "counts": {status: counts[status] for status in ItemStatus.values},
        "finished_at": batch.finished_at.isoformat() if batch.finished_at else None,
        "url": settings.RECALL_PUBLIC_URL + batch.get_absolute_url(),
    }


def items_failed(jobs: Sequence[Job], *, now: datetime) -> None:
    """``item.failed`` events for jobs that just failed for good (their
    ``last_error`` set), if an active endpoint subscribes to them."""
    endpoints = WebhookEndpoint.objects.subscribed_to(WebhookEventType.ITEM_FAILED)
    if not endpoints or not jobs:
        return
    for job in jobs:
        emit(
            WebhookEventType.ITEM_FAILED,
            {
                "batch": {"id": job.batch_id},
                "item": {
                    "id": job.item_id,
                    "source": job.item.source,
                    "attempts": job.attempts,
                    "last_error": job.last_error,
                },
            },
            now=now,
            batch_id=job.batch_id,
            item_id=job.item_id,
            endpoints=endpoints,
        )


def emit(
    event_type: str,
    data: dict[str, Any],
    *,
    now: datetime,
    endpoints: Sequence[WebhookEndpoint],
    batch_id: int | None = None,
    generation: int | None = None,
    item_id: int | None = None,
) -> WebhookEvent:
    """Write one event and its deliveries; queue their first attempts for
    after the commit."""
    body = json.dumps(
        {"type": event_type, "timestamp": now.isoformat(), "data": data},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    event = WebhookEvent.objects.create(
        webhook_id=new_webhook_id(),
        type=event_type,
        batch_id=batch_id,
        generation=generation,
        item_id=item_id,
        created_at=now,
        body=body,
    )
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(event=event, endpoint=e, next_attempt_at=now, created_at=now)
        for e in endpoints
    )
    enqueue_on_commit([d.pk for d in deliveries])
    return event


def new_webhook_id() -> str:
    """The ``webhook-id`` of a new event: random, so it never repeats, even
    across databases (the receiver deduplicates on it)."""
    return "msg_" + uuid.uuid4().hex


def enqueue_on_commit(delivery_ids: list[int]) -> None:
    """Hand the deliveries to the cluster once the transaction commits. If the
    broker is unreachable, the error is logged and the transition that wrote
    them still succeeds: the dispatcher finds them due anyway.

    A function of its own, not a ``functools.partial``: Django names a robust
    hook that failed by its ``__qualname__``, which a partial lacks, and the
    AttributeError of that log line turned a committed completion into a 500
    (chaos through PgBouncer, a database restart)."""
    if not delivery_ids:
        return

    def enqueue_deliveries() -> None:
        async_task(DELIVER_TASK, delivery_ids)

    transaction.on_commit(enqueue_deliveries, robust=True)
