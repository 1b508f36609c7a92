import pytest

from batches.models import ItemStatus
from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import JobStatus, Lease, LeaseEnd
from tests.support.factories import assert_consistent, claim, later, snapshot

pytestmark = pytest.mark.django_db


def test_release_queues_at_once_without_counting_the_attempt(
    worker, other_worker, batch
):
    job = claim(worker)
    token = job.lease_token

    transitions.release(job, token, worker=worker, now=later(5))

    job.refresh_from_db()
    assert (job.status, job.attempts, job.available_at) == (
        JobStatus.QUEUED,
        0,
        later(5),
    )
    assert job.item.status == ItemStatus.QUEUED
    lease = Lease.objects.get(token=token)
    assert (lease.end_reason, lease.ended_at, lease.attempt) == (
        LeaseEnd.RELEASED,
        later(5),
        1,
    )
    assert batch.counts()["queued"] == 3
    again = claim(other_worker, now=later(5))
    assert (again.pk, again.attempts) == (job.pk, 1)
    assert_consistent(later(5))


def test_release_without_the_live_lease_changes_nothing(worker, other_worker, batch):
    job = claim(worker)
    token = job.lease_token
    transitions.release(job, token, worker=worker, now=later(1))
    before = snapshot(job)

    with pytest.raises(LeaseLost):
        transitions.release(job.pk, token, worker=worker, now=later(2))

    assert snapshot(job) == before
