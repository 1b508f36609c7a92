import pytest

from batches.models import Batch, BatchItem, ItemStatus
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Event, Job, JobStatus, Lease, LeaseEnd
from tests.support.factories import (
    T0,
    assert_consistent,
    claim,
    jobs_of,
    later,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db


def test_reclaim_requeues_expired_leases_with_item_and_ledger(worker, batch):
    expired = claim(worker)
    alive = claim(worker, now=later(30))

    report = transitions.reclaim_expired(now=later(61))

    assert report == {"requeued": 1, "failed": 0}
    expired.refresh_from_db()
    assert (expired.status, expired.lease_token, expired.leased_by) == (
        JobStatus.QUEUED,
        None,
        None,
    )
    assert expired.attempts == 1
    assert expired.available_at == later(61)
    assert expired.item.status == ItemStatus.QUEUED
    lease = Lease.objects.get(job=expired)
    assert (lease.end_reason, lease.ended_at) == (LeaseEnd.EXPIRED, later(61))
    assert Job.objects.get(pk=alive.pk).status == JobStatus.LEASED
    assert batch.counts()["queued"] == 2
    assert batch.counts()["transcribing"] == 1
    assert_consistent(later(61))


def test_a_job_that_used_its_last_attempt_fails_instead(worker, db):
    batch = make_batch(1)
    for attempt in (1, 2, 3):
        claim(worker, now=later(100 * attempt))
        transitions.reclaim_expired(now=later(100 * attempt + 61))

    job = jobs_of(batch)[0]
    assert (job.status, job.attempts) == (JobStatus.FAILED, 3)
    assert job.last_error.startswith(
        "Gave up: the lease expired on the last allowed attempt (3 of 3)"
    )
    assert job.item.status == ItemStatus.FAILED
    assert (
        list(Lease.objects.filter(job=job).values_list("end_reason", flat=True))
        == ["expired"] * 3
    )
    assert batch.counts()["failed"] == 1
    assert_consistent(later(400))


def test_reclaim_is_bounded_by_its_limit(worker, db):
    make_batch(5)
    for _ in range(5):
        claim(worker)

    assert transitions.reclaim_expired(now=later(61), limit=2) == {
        "requeued": 2,
        "failed": 0,
    }
    assert Job.objects.filter(status=JobStatus.LEASED).count() == 3
    assert transitions.reclaim_expired(now=later(61)) == {"requeued": 3, "failed": 0}


def test_reclaim_works_in_chunks(worker, db, settings):
    settings.RECALL_CHUNK_SIZE = 2
    make_batch(5)
    for _ in range(5):
        claim(worker)

    assert transitions.reclaim_expired(now=later(61)) == {"requeued": 5, "failed": 0}
    assert_consistent(later(61))


def test_force_reclaim_ends_a_live_lease_and_fences_the_worker(
    worker, other_worker, batch
):
    job = claim(worker)
    token = job.lease_token

    assert transitions.force_reclaim(job.pk, now=later(5)) is True

    job.refresh_from_db()
    assert (job.status, job.attempts) == (JobStatus.QUEUED, 0)
    assert job.item.status == ItemStatus.QUEUED
    lease = Lease.objects.get(token=token)
    assert (lease.end_reason, lease.ended_at) == (LeaseEnd.FORCED, later(5))
    event = Event.objects.get(job=job)
    assert event.kind == Event.Kind.FORCE_RECLAIMED
    from jobs.exceptions import LeaseLost

    with pytest.raises(LeaseLost):
        transitions.heartbeat(job.pk, token, worker=worker, now=later(6))
    assert claim(other_worker, now=later(6)).pk == job.pk
    assert_consistent(later(6))


def test_force_reclaim_of_a_job_that_is_not_leased_does_nothing(worker, batch):
    job = jobs_of(batch)[0]
    before = snapshot(job)

    assert transitions.force_reclaim(job.pk, now=T0) is False

    assert snapshot(job) == before


def test_retry_failed_queues_again_with_fresh_attempts_and_reopens_the_batch(
    worker, db
):
    batch = make_batch(2)
    for _ in range(2):
        job = claim(worker)
        transitions.fail(
            job, job.lease_token, worker=worker, error="bad", retryable=False, now=T0
        )
    # The last failure finished the batch itself (issue 13).
    assert Batch.objects.get(pk=batch.pk).finished_at == T0
    assert transitions.settle(now=T0) == 0

    assert transitions.retry_failed(Job.objects.filter(batch=batch), now=later(1)) == 2

    assert set(Job.objects.filter(batch=batch).values_list("status", "attempts")) == {
        (JobStatus.QUEUED, 0)
    }
    assert Batch.objects.get(pk=batch.pk).finished_at is None
    assert batch.counts()["queued"] == 2
    assert Event.objects.filter(kind=Event.Kind.RETRIED).count() == 2
    assert claim(worker, now=later(1)).batch_id == batch.pk
    assert_consistent(later(1))


def test_retry_leaves_failed_jobs_of_a_cancelled_batch_alone(worker, db):
    batch = make_batch(2)
    job = claim(worker)
    transitions.fail(
        job, job.lease_token, worker=worker, error="bad", retryable=False, now=T0
    )
    transitions.cancel_batch(batch, now=T0)

    assert transitions.retry_failed(Job.objects.filter(batch=batch), now=later(1)) == 0
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED


def test_bulk_force_reclaim_ends_each_live_lease_and_skips_the_rest(
    worker, other_worker, django_user_model
):
    admin = django_user_model.objects.create(username="ops")
    batch = make_batch(4)
    first, second = claim(worker), claim(other_worker)
    done = claim(worker)
    transitions.complete(
        done, done.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    tokens = {first.pk: first.lease_token, second.pk: second.lease_token}
    audited = []

    reclaimed = transitions.force_reclaim_many(
        Job.objects.filter(batch=batch),
        actor=admin,
        now=later(5),
        audit=lambda jobs: audited.extend(jobs),
    )

    assert reclaimed == 2
    assert [(j.pk, j.status) for j in audited] == [
        (first.pk, JobStatus.QUEUED),
        (second.pk, JobStatus.QUEUED),
    ]
    for pk, token in tokens.items():
        job = Job.objects.select_related("item").get(pk=pk)
        assert (job.status, job.attempts, job.item.status) == (
            JobStatus.QUEUED,
            0,
            ItemStatus.QUEUED,
        )
        lease = Lease.objects.get(token=token)
        assert (lease.end_reason, lease.ended_at) == (LeaseEnd.FORCED, later(5))
    assert Job.objects.get(pk=done.pk).status == JobStatus.COMPLETED
    events = Event.objects.filter(kind=Event.Kind.FORCE_RECLAIMED).order_by("job_id")
    assert [(e.job_id, e.actor) for e in events] == [
        (first.pk, admin),
        (second.pk, admin),
    ]
    assert batch.counts()["queued"] == 3
    assert batch.counts()["transcribing"] == 0
    assert_consistent(later(5))


def test_bulk_force_reclaim_pages_through_large_selections(worker, settings):
    settings.RECALL_CHUNK_SIZE = 2
    make_batch(5)
    for _ in range(5):
        claim(worker)

    assert transitions.force_reclaim_many(Job.objects.all(), now=later(1)) == 5
    assert not Job.objects.filter(status=JobStatus.LEASED).exists()
    assert_consistent(later(1))


def test_reclaim_heals_a_drifted_item_and_still_reclaims_the_rest(worker, batch):
    # On PostgreSQL the SQL chunk leaves the drifted job to the ORM path.
    drifted, clean = claim(worker), claim(worker)
    BatchItem.objects.filter(pk=drifted.item_id).update(status=ItemStatus.DONE)

    report = transitions.reclaim_expired(now=later(61))

    assert report == {"requeued": 2, "failed": 0}
    for job in (drifted, clean):
        assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED
        assert BatchItem.objects.get(pk=job.item_id).status == ItemStatus.QUEUED
    repair = Event.objects.repairs().get()
    assert repair.job_id == drifted.pk
    assert repair.message == "Item was done while its job was leased; set to queued."
    sweep(now=later(61))  # the repair asked for a recount
    assert batch.counts()["queued"] == 3
    assert_consistent(later(61))


def test_reclaim_writes_the_missing_ledger_row_of_an_expired_lease(worker, batch):
    job = claim(worker)
    Lease.objects.filter(token=job.lease_token).delete()

    transitions.reclaim_expired(now=later(61))

    lease = Lease.objects.get(job=job)
    assert (lease.end_reason, lease.ended_at) == (LeaseEnd.EXPIRED, later(61))
    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED
    assert_consistent(later(61))


def test_reclaim_of_a_filtered_queryset_touches_only_its_jobs(worker, db):
    mine, other = make_batch(1, name="mine"), make_batch(1, name="other")
    a, b = claim(worker), claim(worker)

    transitions.reclaim_expired(now=later(61), among=Job.objects.filter(batch=mine))

    assert Job.objects.get(pk=a.pk).status == JobStatus.QUEUED
    assert Job.objects.get(pk=b.pk).status == JobStatus.LEASED
    assert other.counts()["transcribing"] == 1
