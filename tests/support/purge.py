"""Retention's test rows: finished batches, and every row a batch owns,
counted."""

from __future__ import annotations

from datetime import timedelta

from batches.models import Batch, BatchCounter, BatchItem, BatchMinute
from jobs import transitions
from jobs.models import (
    Event,
    Job,
    Lease,
    WebhookEvent,
)
from tests.support.factories import T0, claim, make_batch

DAY = timedelta(days=1)


def finished_batch(worker, n=3, *, failed=0, name="old", at=T0) -> Batch:
    """A batch whose ``n`` jobs ran at ``at``: the last ``failed`` of them failed
    for good, the others completed (so the last transition finished it)."""
    batch = make_batch(n, name=name, now=at)
    for i in range(n):
        job = claim(worker, at)
        if i >= n - failed:
            transitions.fail(
                job, job.lease_token, worker=worker, error="bad", retryable=False,
                now=at,
            )  # fmt: skip
        else:
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": f"t{i}"}, now=at
            )
    batch.refresh_from_db()
    assert batch.finished_at == at
    return batch


def rows_of(batch_id: int) -> dict[str, int]:
    return {
        "batch": Batch.objects.filter(pk=batch_id).count(),
        "items": BatchItem.objects.filter(batch_id=batch_id).count(),
        "jobs": Job.objects.filter(batch_id=batch_id).count(),
        "leases": Lease.objects.filter(job__batch_id=batch_id).count(),
        "events": Event.objects.filter(batch_id=batch_id).count(),
        "counters": BatchCounter.objects.filter(batch_id=batch_id).count(),
        "minutes": BatchMinute.objects.filter(batch_id=batch_id).count(),
        "outbox": WebhookEvent.objects.filter(batch_id=batch_id).count(),
    }


GONE = dict.fromkeys(
    ("batch", "items", "jobs", "leases", "events", "counters", "minutes", "outbox"), 0
)
