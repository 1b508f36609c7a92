import pytest

from batches.models import BatchItem, ItemStatus
from engine.sweep import sweep
from jobs import transitions
from jobs.exceptions import LeaseLost
from jobs.models import Event, Job, JobStatus, Lease, LeaseEnd
from tests.support.factories import (
    assert_consistent,
    claim,
    later,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db

RESULT = {
    "text": "hello world",
    "language": "en",
    "segments": [{"start": 0.0, "end": 1.5, "text": "hello world"}],
}


def test_complete_finishes_job_item_and_ledger_together(worker, batch):
    job = claim(worker)
    token = job.lease_token

    transitions.complete(job, token, worker=worker, result=RESULT, now=later(30))

    job.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert job.result == RESULT
    assert (job.lease_token, job.leased_by, job.lease_expires_at) == (None, None, None)
    assert job.finished_at == later(30)
    assert job.item.status == ItemStatus.DONE
    lease = Lease.objects.get(token=token)
    assert (lease.ended_at, lease.end_reason) == (later(30), LeaseEnd.COMPLETED)
    assert batch.counts()["done"] == 1
    assert batch.counts()["transcribing"] == 0
    assert_consistent(later(30))


def test_replaying_complete_with_the_same_token_succeeds_and_changes_nothing(
    worker, batch
):
    job = claim(worker)
    token = job.lease_token
    transitions.complete(job, token, worker=worker, result=RESULT, now=later(30))
    before = snapshot(job)

    transitions.complete(
        job.pk, token, worker=worker, result={"text": "other"}, now=later(40)
    )

    assert snapshot(job) == before
    assert Job.objects.get(pk=job.pk).result == RESULT


def test_complete_with_a_different_token_after_completion_is_refused(
    worker, other_worker, batch
):
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result=RESULT, now=later(30)
    )
    before = snapshot(job)

    with pytest.raises(LeaseLost):
        transitions.complete(
            job.pk, "guess", worker=worker, result=RESULT, now=later(31)
        )
    with pytest.raises(LeaseLost):  # the right token, the wrong worker
        transitions.complete(
            job.pk,
            job.lease_token or "",
            worker=other_worker,
            result=RESULT,
            now=later(31),
        )

    assert snapshot(job) == before


def test_a_stale_worker_cannot_complete_after_reclaim(worker, other_worker, db):
    make_batch(1)
    job = claim(worker)
    stale_token = job.lease_token
    transitions.reclaim_expired(now=later(61))
    fresh = claim(other_worker, now=later(62))
    before = snapshot(job)

    with pytest.raises(LeaseLost):
        transitions.complete(
            job.pk, stale_token, worker=worker, result=RESULT, now=later(63)
        )

    assert snapshot(job) == before
    transitions.complete(
        fresh, fresh.lease_token, worker=other_worker, result=RESULT, now=later(64)
    )
    assert Job.objects.get(pk=job.pk).status == JobStatus.COMPLETED
    assert Lease.objects.filter(job=job, end_reason=LeaseEnd.COMPLETED).count() == 1
    assert_consistent(later(64))


def test_worker_b_cannot_complete_worker_a_job(worker, other_worker, batch):
    job = claim(worker)
    before = snapshot(job)

    with pytest.raises(LeaseLost):
        transitions.complete(
            job.pk, job.lease_token, worker=other_worker, result=RESULT, now=later(5)
        )

    assert snapshot(job) == before


def test_complete_after_expiry_but_before_reclaim_is_accepted(worker, batch):
    job = claim(worker)

    transitions.complete(
        job, job.lease_token, worker=worker, result=RESULT, now=later(600)
    )

    assert Job.objects.get(pk=job.pk).status == JobStatus.COMPLETED
    assert transitions.reclaim_expired(now=later(601)) == {"requeued": 0, "failed": 0}


def test_complete_heals_a_drifted_item(worker, batch):
    # On PostgreSQL the SQL fast path sees the drift and leaves it to the ORM path.
    job = claim(worker)
    BatchItem.objects.filter(pk=job.item_id).update(status=ItemStatus.QUEUED)

    transitions.complete(
        job, job.lease_token, worker=worker, result=RESULT, now=later(5)
    )

    assert BatchItem.objects.get(pk=job.item_id).status == ItemStatus.DONE
    repair = Event.objects.repairs().get(job=job)
    assert repair.message == "Item was queued while its job was leased; set to done."
    sweep(now=later(5))
    assert batch.counts()["done"] == 1
    assert_consistent(later(5))


def test_complete_writes_the_missing_ledger_row_of_its_lease(worker, batch):
    job = claim(worker)
    token = job.lease_token
    Lease.objects.filter(token=token).delete()

    transitions.complete(job, token, worker=worker, result=RESULT, now=later(5))

    lease = Lease.objects.get(token=token)
    assert (lease.ended_at, lease.end_reason) == (later(5), LeaseEnd.COMPLETED)
    assert Event.objects.repairs().get(job=job).message == (
        "The live lease had no ledger row; wrote it, closed."
    )
    assert Job.objects.get(pk=job.pk).status == JobStatus.COMPLETED
    assert batch.counts()["done"] == 1
    assert_consistent(later(5))


def test_the_completed_job_handed_back_has_its_own_fields(worker, batch):
    # The PostgreSQL backend builds it from the statement's answer, not a read:
    # each value must land in its own field (the log line reads the attempt).
    job = claim(worker)

    done = transitions.backend().complete(
        job.pk, job.lease_token, worker=worker, result=RESULT, now=later(5)
    )

    assert done is not None
    assert (done.pk, done.status, done.attempts, done.batch_id) == (
        job.pk,
        JobStatus.COMPLETED,
        1,
        batch.pk,
    )
    assert (done.finished_at, done.updated_at) == (later(5), later(5))
