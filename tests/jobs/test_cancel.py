"""Cancelling queued jobs one by one and in bulk (the admin's cancel action)."""

import pytest

from batches.models import ItemStatus
from jobs import transitions
from jobs.models import Event, Job, JobStatus, Lease
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


def test_cancel_queued_cancels_jobs_items_and_counters_and_logs_each(
    worker, django_user_model
):
    admin = django_user_model.objects.create(username="ops")
    batch = make_batch(4)
    leased = claim(worker)
    queued = [j for j in jobs_of(batch) if j.pk != leased.pk]

    cancelled = transitions.cancel_queued(
        Job.objects.filter(batch=batch), actor=admin, now=later(1)
    )

    assert cancelled == 3
    for job in jobs_of(batch):
        if job.pk == leased.pk:
            assert (job.status, job.item.status) == (
                JobStatus.LEASED,
                ItemStatus.TRANSCRIBING,
            )
        else:
            assert (job.status, job.item.status, job.finished_at) == (
                JobStatus.CANCELLED,
                ItemStatus.CANCELLED,
                later(1),
            )
    assert batch.counts()["cancelled"] == 3
    assert batch.counts()["queued"] == 0
    assert batch.counts()["transcribing"] == 1
    events = Event.objects.filter(kind=Event.Kind.CANCELLED).order_by("job_id")
    assert [(e.job_id, e.batch_id, e.actor, e.message) for e in events] == [
        (j.pk, batch.pk, admin, "Job cancelled.") for j in queued
    ]
    assert Lease.objects.count() == 1  # queued jobs have no ledger rows to touch
    assert_consistent(later(1))


def test_cancel_queued_leaves_every_other_status_alone(worker):
    batch = make_batch(3)
    done = claim(worker)
    transitions.complete(
        done, done.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    failed = claim(worker)
    transitions.fail(
        failed, failed.lease_token, worker=worker, error="e", retryable=False, now=T0
    )
    leased = claim(worker)
    before = snapshot(done, failed, leased)

    assert transitions.cancel_queued(Job.objects.filter(batch=batch), now=later(1)) == 0

    assert snapshot(done, failed, leased) == before
    assert not Event.objects.exists()


def test_cancel_queued_works_in_chunks_and_audits_each_chunk(settings):
    settings.RECALL_CHUNK_SIZE = 2
    batch = make_batch(5)
    audited = []

    cancelled = transitions.cancel_queued(
        Job.objects.filter(batch=batch),
        now=later(1),
        audit=lambda jobs: audited.append([j.pk for j in jobs]),
    )

    ids = [j.pk for j in jobs_of(batch)]
    assert cancelled == 5
    assert audited == [ids[0:2], ids[2:4], ids[4:5]]
    assert_consistent(later(1))


def test_an_audit_that_fails_undoes_its_chunk_only(settings):
    settings.RECALL_CHUNK_SIZE = 2
    batch = make_batch(4)
    calls = []

    def audit(jobs):
        calls.append(len(jobs))
        if len(calls) == 2:
            raise RuntimeError("audit store down")

    with pytest.raises(RuntimeError, match="audit store down"):
        transitions.cancel_queued(
            Job.objects.filter(batch=batch), now=later(1), audit=audit
        )

    assert [j.status for j in jobs_of(batch)] == [
        JobStatus.CANCELLED,
        JobStatus.CANCELLED,
        JobStatus.QUEUED,
        JobStatus.QUEUED,
    ]
    assert Event.objects.count() == 2
    assert_consistent(later(1))


def test_a_single_job_cancel_refuses_a_job_that_is_not_queued(worker, batch):
    job = claim(worker)
    before = snapshot(job)

    assert transitions.cancel_job(job.pk, now=later(1)) is False

    assert snapshot(job) == before
