from datetime import timedelta

import pytest

from batches.models import ItemStatus
from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import Job, JobStatus, Lease, LeaseEnd
from jobs.transitions.rules import MAX_ERROR_CHARS
from tests.support.factories import (
    T0,
    assert_consistent,
    claim,
    later,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db


def test_retryable_failure_queues_again_with_backoff(worker, batch):
    job = claim(worker)
    token = job.lease_token

    status = transitions.fail(
        job, token, worker=worker, error="CUDA out of memory", now=later(10)
    )

    assert status == JobStatus.QUEUED
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED
    assert job.available_at == later(10) + timedelta(seconds=30)
    assert job.attempts == 1
    assert job.last_error == "CUDA out of memory"
    assert job.lease_token is None
    assert job.item.status == ItemStatus.QUEUED
    lease = Lease.objects.get(token=token)
    assert (lease.end_reason, lease.error, lease.ended_at) == (
        LeaseEnd.FAILED,
        "CUDA out of memory",
        later(10),
    )
    assert batch.counts()["queued"] == 3
    assert_consistent(later(10))


def test_backoff_doubles_per_attempt_and_is_capped(worker, db, settings):
    settings.RECALL_MAX_ATTEMPTS = 5
    settings.RECALL_RETRY_BACKOFF_MAX_SECONDS = 100
    make_batch(1)
    t, delays = 0, []
    for _ in range(4):
        job = claim(worker, now=later(t))
        transitions.fail(job, job.lease_token, worker=worker, error="x", now=later(t))
        job.refresh_from_db()
        delays.append((job.available_at - later(t)).total_seconds())
        t = (job.available_at - T0).total_seconds()

    assert delays == [30, 60, 100, 100]


def test_zero_backoff_retries_at_once(worker, batch, settings):
    settings.RECALL_RETRY_BACKOFF_SECONDS = 0
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="x", now=later(10))

    assert Job.objects.get(pk=job.pk).available_at == later(10)
    assert claim(worker, now=later(10)).pk == job.pk


def test_last_attempt_fails_for_good(worker, db):
    batch = make_batch(1)
    for attempt in (1, 2, 3):
        job = claim(worker, now=later(1000 * attempt))
        status = transitions.fail(
            job,
            job.lease_token,
            worker=worker,
            error=f"e{attempt}",
            now=later(1000 * attempt),
        )

    assert status == JobStatus.FAILED
    job.refresh_from_db()
    assert (job.status, job.attempts, job.last_error) == (JobStatus.FAILED, 3, "e3")
    assert job.finished_at == later(3000)
    assert job.item.status == ItemStatus.FAILED
    assert list(Lease.objects.filter(job=job).values_list("attempt", "end_reason")) == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]
    assert batch.counts()["failed"] == 1
    assert_consistent(later(3000))


def test_non_retryable_failure_fails_at_once(worker, batch):
    job = claim(worker)

    status = transitions.fail(
        job, job.lease_token, worker=worker, error="not audio", retryable=False, now=T0
    )

    assert status == JobStatus.FAILED
    assert Job.objects.get(pk=job.pk).attempts == 1
    assert batch.counts()["failed"] == 1


def test_a_long_error_is_kept_truncated_not_refused(worker, batch):
    job = claim(worker)
    error = "traceback line\n" * 5000  # 75,000 characters

    transitions.fail(
        job, job.lease_token, worker=worker, error=error, retryable=False, now=T0
    )

    job.refresh_from_db()
    assert len(job.last_error) == MAX_ERROR_CHARS
    assert job.last_error.startswith("traceback line\n")
    assert job.last_error.endswith("[… truncated]")
    assert Lease.objects.get(job=job).error == job.last_error


def test_fail_without_the_live_lease_changes_nothing(worker, other_worker, batch):
    job = claim(worker)
    before = snapshot(job)

    with pytest.raises(LeaseLost):
        transitions.fail(
            job.pk, job.lease_token, worker=other_worker, error="x", now=T0
        )
    with pytest.raises(LeaseLost):
        transitions.fail(job.pk, "stale", worker=worker, error="x", now=T0)

    assert snapshot(job) == before
