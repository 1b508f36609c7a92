"""Every multi-row transition is all or nothing.

A real database trigger makes one write fail (the job, the item, the counters,
the lease ledger or the event log); the transition must raise and leave every
row exactly as it was.
"""

import pytest
from django.db import DatabaseError

from batches.models import Batch, BatchMinute
from engine.reconcile import reconcile
from jobs import transitions
from jobs.models import Job, JobStatus, Lease
from tests.support.factories import (
    T0,
    claim,
    failpoint,
    jobs_of,
    later,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db

JOB = ("jobs_job", "UPDATE")
ITEM = ("batches_batchitem", "UPDATE")
COUNTERS = ("batches_batchcounter", "UPDATE")
LEDGER_CLOSE = ("jobs_lease", "UPDATE")
LEDGER_OPEN = ("jobs_lease", "INSERT")
EVENT = ("jobs_event", "INSERT")
BATCH = ("batches_batch", "UPDATE")
THROUGHPUT = ("batches_batchminute", "INSERT")  # the per-minute finish buckets


def _leased(worker):
    make_batch(2)
    return claim(worker)


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_OPEN])
def test_claim(write, worker):
    batch = make_batch(2)
    jobs = jobs_of(batch)
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.claim_next(worker, now=T0)

    assert snapshot(*jobs) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE, THROUGHPUT])
def test_complete(write, worker):
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=later(1)
        )

    assert snapshot(job) == before
    assert not BatchMinute.objects.exists()


@pytest.mark.parametrize(
    ("write", "retryable"),
    [(w, r) for w in (JOB, ITEM, COUNTERS, LEDGER_CLOSE) for r in (True, False)]
    # Only a failure for good finishes the item, and so counts in the buckets.
    + [(THROUGHPUT, False)],
)
def test_fail(write, retryable, worker):
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.fail(
            job,
            job.lease_token,
            worker=worker,
            error="e",
            retryable=retryable,
            now=later(1),
        )

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE])
def test_release(write, worker):
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.release(job, job.lease_token, worker=worker, now=later(1))

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE])
def test_reclaim_expired_chunk(write, worker):
    batch = make_batch(3)
    jobs = [claim(worker) for _ in range(3)]
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.reclaim_expired(now=later(61))

    assert snapshot(*jobs) == before
    assert Job.objects.filter(batch=batch, status=JobStatus.LEASED).count() == 3


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE, THROUGHPUT])
def test_reclaim_that_gives_up(write, worker, settings):
    settings.RECALL_MAX_ATTEMPTS = 1
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.reclaim_expired(now=later(61))

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE, EVENT])
def test_force_reclaim(write, worker):
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.force_reclaim(job, now=later(1))

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [ITEM, COUNTERS, EVENT, BATCH])
def test_reconcile_item_repair(write, worker):
    job = _leased(worker)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.COMPLETED,
        result={"text": "x"},
        lease_token=None,
        leased_by=None,
        lease_expires_at=None,
    )
    Lease.objects.filter(job=job).delete()
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        reconcile(now=later(1))

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [LEDGER_CLOSE, EVENT])
def test_reconcile_ledger_repair(write, worker):
    job = _leased(worker)
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.QUEUED, lease_token=None, leased_by=None, lease_expires_at=None
    )
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.close_stray_leases(job.pk, now=later(1))

    assert snapshot(job) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE])
def test_batch_cancel_chunk(write, worker):
    batch = make_batch(4)
    claim(worker)
    Batch.objects.filter(pk=batch.pk).update(cancelled_at=T0)
    jobs = jobs_of(batch)
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.cancel_batch_chunk(batch.pk, now=later(1))

    assert snapshot(*jobs) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, EVENT, BATCH])
def test_retry_failed_chunk(write, worker):
    batch = make_batch(2)
    for _ in range(2):
        job = claim(worker)
        transitions.fail(
            job, job.lease_token, worker=worker, error="e", retryable=False, now=T0
        )
    transitions.settle(now=T0)
    jobs = jobs_of(batch)
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.retry_failed(Job.objects.filter(batch=batch), now=later(1))

    assert snapshot(*jobs) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, EVENT])
def test_cancel_queued_chunk(write, worker):
    batch = make_batch(3)
    claim(worker)
    jobs = jobs_of(batch)
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.cancel_queued(Job.objects.filter(batch=batch), now=later(1))

    assert snapshot(*jobs) == before


@pytest.mark.parametrize("write", [JOB, ITEM, COUNTERS, LEDGER_CLOSE, EVENT])
def test_bulk_force_reclaim_of_one_job(write, worker):
    job = _leased(worker)
    before = snapshot(job)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        transitions.force_reclaim_many(Job.objects.filter(pk=job.pk), now=later(1))

    assert snapshot(job) == before
