"""Reconciliation: build each inconsistent state directly, assert it is healed
and counted, and that a consistent database is left alone."""

import pytest

from batches.models import Batch, BatchCounter, BatchItem, ItemStatus
from engine.reconcile import reconcile, sweep_state
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
)

pytestmark = pytest.mark.django_db

NO_LEASE = {"lease_token": None, "leased_by": None, "lease_expires_at": None}


def _set_job(job, **fields):
    Job.objects.filter(pk=job.pk).update(**fields)


def test_a_consistent_database_needs_no_repair(worker, batch):
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    claim(worker)

    report = reconcile(now=T0, recount=True)

    assert report.repairs == 0
    assert report.jobs_scanned == 3
    assert not Event.objects.repairs().exists()


def _completed(worker, job):
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )


def _failed(worker, job):
    job = claim(worker)
    transitions.fail(
        job, job.lease_token, worker=worker, error="e", retryable=False, now=T0
    )


def _cancelled(worker, job):
    transitions.cancel_job(job, now=T0)


@pytest.mark.parametrize(
    ("make_state", "drifted_item", "healed_item"),
    [
        (_completed, ItemStatus.TRANSCRIBING, ItemStatus.DONE),
        (None, ItemStatus.TRANSCRIBING, ItemStatus.QUEUED),
        (_failed, ItemStatus.DONE, ItemStatus.FAILED),
        (_cancelled, ItemStatus.QUEUED, ItemStatus.CANCELLED),
    ],
    ids=[
        "completed-transcribing",
        "queued-transcribing",
        "failed-done",
        "cancelled-queued",
    ],
)
def test_item_disagreeing_with_its_job_is_healed(
    make_state, drifted_item, healed_item, worker, batch
):
    job = jobs_of(batch)[0]
    if make_state:
        make_state(worker, job)
    BatchItem.objects.filter(pk=job.item_id).update(status=drifted_item)

    report = reconcile(now=later(1))

    assert report.items_healed == 1
    assert BatchItem.objects.get(pk=job.item_id).status == healed_item
    assert Event.objects.repairs().filter(job=job).count() == 1
    # The raw edit bypassed the counters; the same pass recounted the batch.
    assert report.counters_fixed == 1
    assert_consistent(later(1))


def test_leased_job_whose_item_is_not_transcribing_is_healed(worker, batch):
    job = claim(worker)
    BatchItem.objects.filter(pk=job.item_id).update(status=ItemStatus.QUEUED)

    report = reconcile(now=later(1))

    assert report.items_healed == 1
    assert BatchItem.objects.get(pk=job.item_id).status == ItemStatus.TRANSCRIBING
    assert_consistent(later(1))


def test_open_ledger_row_without_a_live_lease_is_closed(worker, batch):
    job = claim(worker)
    # The job was requeued behind Recall's back; its ledger row stayed open.
    _set_job(job, status=JobStatus.QUEUED, **NO_LEASE)
    BatchItem.objects.filter(pk=job.item_id).update(status=ItemStatus.QUEUED)
    transitions.recount(batch.pk)

    report = reconcile(now=later(1))

    assert report.leases_closed == 1
    lease = Lease.objects.get(job=job)
    assert (lease.end_reason, lease.ended_at) == (LeaseEnd.EXPIRED, later(1))
    assert lease.error == "Closed by reconciliation: the job is queued."
    assert_consistent(later(1))


def test_live_lease_without_a_ledger_row_gets_one(worker, batch):
    job = claim(worker)
    Lease.objects.filter(job=job).delete()

    report = reconcile(now=later(1))

    assert report.leases_restored == 1
    lease = Lease.objects.get(job=job)
    assert (lease.token, lease.worker, lease.ended_at) == (
        job.lease_token,
        worker,
        None,
    )
    assert_consistent(later(1))


def test_queued_job_with_no_attempts_left_is_failed(worker, batch):
    job = jobs_of(batch)[0]
    _set_job(job, attempts=3)

    report = reconcile(now=later(1))

    assert report.exhausted_failed == 1
    job.refresh_from_db()
    assert (job.status, job.item.status) == (JobStatus.FAILED, ItemStatus.FAILED)
    assert job.last_error == "Failed by reconciliation: queued with no attempts left."
    assert_consistent(later(1))


def test_interrupted_batch_cancel_is_finished(worker, batch):
    in_flight = claim(worker)
    # The cancel marked the batch, then the process died before any chunk.
    Batch.objects.filter(pk=batch.pk).update(cancelled_at=T0)

    report = reconcile(now=later(1))

    assert report.cancels_finished == 3
    assert set(Job.objects.filter(batch=batch).values_list("status", flat=True)) == {
        "cancelled"
    }
    assert Lease.objects.get(job=in_flight).end_reason == LeaseEnd.FORCED
    batch.refresh_from_db()
    assert batch.finished_at == later(1)
    assert batch.counts()["cancelled"] == 3
    assert_consistent(later(1))


def test_claims_finish_an_interrupted_cancel_after_a_grace_period(worker, db):
    batch = make_batch(3)
    Batch.objects.filter(pk=batch.pk).update(cancelled_at=T0)

    assert transitions.finish_interrupted_cancel(now=later(10)) == 0  # still in grace
    assert transitions.finish_interrupted_cancel(now=later(31)) == 3
    assert batch.counts()["cancelled"] == 3


def test_finished_batch_with_unfinished_work_is_reopened(worker, db):
    batch = make_batch(2)
    Batch.objects.filter(pk=batch.pk).update(finished_at=T0)
    assert transitions.claim_next(worker, now=T0) is None  # stranded

    report = reconcile(now=later(1))

    assert report.batches_reopened == 1
    assert Batch.objects.get(pk=batch.pk).finished_at is None
    assert claim(worker, now=later(1)).batch_id == batch.pk


def test_wrong_counters_are_fixed_by_a_full_recount(batch):
    BatchCounter.objects.filter(batch=batch).update(queued=7, done=3)

    report = reconcile(now=T0, recount=True)

    assert report.counters_fixed == 1
    assert batch.counts()["queued"] == 3
    assert batch.counts()["done"] == 0
    assert_consistent()


def test_the_sweep_scan_is_bounded_and_resumes_where_it_stopped(
    db, settings, monkeypatch
):
    monkeypatch.setattr("engine.reconcile.SCAN_WINDOW", 2)
    batch = make_batch(5)
    last = jobs_of(batch)[-1]
    BatchItem.objects.filter(pk=last.item_id).update(status=ItemStatus.DONE)

    first = reconcile(now=T0, scan_budget=2)
    second = reconcile(now=T0, scan_budget=2)
    third = reconcile(now=T0, scan_budget=2)

    assert [r.items_healed for r in (first, second, third)] == [0, 0, 1]
    assert sweep_state().scan_cursor == 0  # wrapped around
    assert_consistent()


def test_sweep_reports_what_it_did(worker, batch):
    claim(worker)
    BatchItem.objects.filter(pk=jobs_of(batch)[1].item_id).update(
        status=ItemStatus.FAILED
    )

    report = sweep(now=later(61))

    assert report["reclaimed"] == {"requeued": 1, "failed": 0}
    assert report["reconcile"]["items_healed"] == 1
    assert report["reconcile"]["counters_fixed"] == 1
    assert report["batches_finished"] == 0
    state = sweep_state()
    assert state.last_started_at == later(61)
    assert state.last_report == report
    assert_consistent(later(61))
