"""Exactly one batch.finished event under real concurrency: threads with their
own connections and real commits (PostgreSQL: READ COMMITTED, row locks;
SQLite: BEGIN IMMEDIATE serialises writers)."""

from __future__ import annotations

import pytest

from batches.models import Batch
from jobs import transitions
from jobs.models import WebhookDelivery, WebhookEvent
from tests.support.factories import (
    assert_consistent,
    finished_events,
    later,
    make_batch,
    make_endpoint,
    make_worker,
)
from tests.support.threads import run_threads

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8
ROUNDS = 6


def test_the_last_completions_racing_write_exactly_one_event():
    """Each round, a batch's last items (one per counter shard region) are all
    completed at once: every completion is in the tail, and each would see the
    others' items still in flight without the batch lock."""
    make_endpoint()
    workers = [make_worker(f"w{i}") for i in range(THREADS)]
    batches = []
    for r in range(ROUNDS):
        batch = make_batch(THREADS, name=f"round-{r}")
        batches.append(batch)
        leases = [transitions.claim_next(w, now=later(r)) for w in workers]
        assert {job.batch_id for job in leases} == {batch.pk}

        def complete(i, barrier, leases=leases, r=r):
            job = leases[i]
            barrier.wait()
            transitions.complete(
                job.pk,
                job.lease_token,
                worker=workers[i],
                result={"text": f"t{i}"},
                now=later(r + 1),
            )

        run_threads(complete, THREADS)

    for batch in batches:
        [event] = finished_events(batch)
        assert event.generation == 1
        batch.refresh_from_db()
        assert batch.finishes == 1
        assert batch.finished_at is not None
    assert WebhookEvent.objects.count() == ROUNDS
    assert WebhookDelivery.objects.count() == ROUNDS
    assert_consistent(later(ROUNDS + 1))


def test_completions_racing_sweeps_write_exactly_one_event():
    """The last completions and several sweeps' settle, all at once."""
    workers = [make_worker(f"w{i}") for i in range(4)]
    batch = make_batch(4)
    leases = [transitions.claim_next(w, now=later(0)) for w in workers]

    def act(i, barrier):
        barrier.wait()
        if i < 4:
            job = leases[i]
            transitions.complete(
                job.pk, job.lease_token, worker=workers[i], result={"text": "x"}
            )
        else:
            for _ in range(20):
                transitions.settle(Batch.objects.filter(pk=batch.pk))

    run_threads(act, 8)

    assert [e.generation for e in finished_events(batch)] == [1]
    assert Batch.objects.get(pk=batch.pk).finishes == 1
