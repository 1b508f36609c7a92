"""Run reconciliation now: the whole database is swept, what was healed is
shown, and the run is audited (who ran it, and each job it repaired)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.utils import timezone

from batches.models import Batch, BatchItem, ItemStatus
from engine.sweep import LOCK_TTL, acquire_lock
from jobs import transitions
from jobs.models import Event, Job, JobStatus, Lease
from tests.support.admin import act
from tests.support.factories import assert_consistent, jobs_of, make_batch

pytestmark = pytest.mark.django_db


def _drift(worker, other_worker):
    """Three things for a sweep to fix: an expired lease, an item out of line
    with its job, and an open ledger row behind a job that is not leased."""
    now = timezone.now()
    batch = make_batch(4)
    stray = transitions.claim_next(other_worker, now=now)
    # A claim reclaims expired leases first: this one is taken last.
    expired = transitions.claim_next(worker, now=now - timedelta(minutes=5))
    Job.objects.filter(pk=stray.pk).update(
        status=JobStatus.QUEUED, lease_token=None, leased_by=None, lease_expires_at=None
    )
    BatchItem.objects.filter(pk=stray.item_id).update(status=ItemStatus.QUEUED)
    drifted = jobs_of(batch)[3]
    BatchItem.objects.filter(pk=drifted.item_id).update(status=ItemStatus.DONE)
    return batch, expired, stray, drifted


def test_the_confirmation_says_what_a_run_will_do(
    staff, worker, other_worker, settings
):
    batch, *_ = _drift(worker, other_worker)
    _, client = staff("oncall", "jobs.view_job", "jobs.run_reconcile")

    page = act(client, "run_reconcile", [jobs_of(batch)[0].pk], confirm=False)

    confirmation = page.context["confirmation"]
    assert confirmation.summary == (
        "Run one sweep over the whole database now, whichever jobs are selected."
    )
    assert confirmation.counts == [
        ("Expired leases, to be reclaimed", 1),
        ("Live leases, to be checked", 1),
        ("Jobs the consistency scan checks (about)", 4),
        ("Jobs in all", 4),
        ("Batches waiting for a recount", 0),
        ("Cancelled batches with unfinished jobs", 0),
    ]
    assert confirmation.effects[2] == (
        "The consistency scan checks every job against its item and batch."
    )
    assert confirmation.button == "Run reconciliation"
    assert not Event.objects.exists()  # nothing ran yet
    assert Lease.objects.filter(ended_at__isnull=True).count() == 2


def test_a_run_heals_everything_shows_it_and_audits_it(staff, worker, other_worker):
    batch, expired, stray, drifted = _drift(worker, other_worker)
    user, client = staff(
        "oncall", "jobs.view_job", "jobs.view_event", "jobs.run_reconcile"
    )

    response = act(client, "run_reconcile", [expired.pk], confirm=True)

    assert response.status_code == 200
    assert response.context["reclaimed"] == {"requeued": 1, "failed": 0}
    assert dict(response.context["healed"]) == {
        "Items brought in line with their job": 1,
        "Stray lease-ledger rows closed": 1,
        "Missing lease-ledger rows restored": 0,
        "Queued jobs with no attempts left, failed": 0,
        "Jobs of interrupted batch cancels, cancelled": 0,
        "Batches wrongly marked finished, reopened": 0,
        "Batches whose progress counters were wrong, recounted": 1,
    }
    assert response.context["jobs_scanned"] == 4
    assert response.context["skipped"] is None
    repairs = list(Event.objects.repairs().order_by("pk"))
    assert [(e.job_id, e.batch_id) for e in repairs] == [
        (stray.pk, batch.pk),
        (drifted.pk, batch.pk),
        (None, batch.pk),
    ]
    assert response.context["repair_count"] == 3
    assert [e.pk for e in response.context["repairs"]] == [e.pk for e in repairs]
    assert b"Nothing needed repair." not in response.content
    # The link to all of them in the event log lists exactly these.
    listed = client.get(response.context["repairs_url"]).context["cl"].result_list
    assert sorted(e.pk for e in listed) == [e.pk for e in repairs]

    # The rows themselves.
    assert Job.objects.get(pk=expired.pk).status == JobStatus.QUEUED
    assert Lease.objects.get(job=expired).end_reason == "expired"
    assert Lease.objects.get(job=stray).end_reason == "expired"
    assert BatchItem.objects.get(pk=drifted.item_id).status == ItemStatus.QUEUED
    assert batch.counts()["queued"] == 4
    assert_consistent(timezone.now())

    # The admin log: the run, then each repaired job or batch.
    entries = list(
        LogEntry.objects.filter(user=user)
        .order_by("pk")
        .values_list("content_type", "object_id", "object_repr", "action_flag")
    )
    job_type = ContentType.objects.get_for_model(Job).pk
    batch_type = ContentType.objects.get_for_model(Batch).pk
    assert entries == [
        (job_type, None, "reconciliation", CHANGE),
        (job_type, str(stray.pk), f"job {stray.pk}", CHANGE),
        (job_type, str(drifted.pk), f"job {drifted.pk}", CHANGE),
        (batch_type, str(batch.pk), f"batch {batch.pk}", CHANGE),
    ]
    summary = LogEntry.objects.filter(user=user).order_by("pk").first()
    assert summary.change_message == (
        "Ran reconciliation: reclaimed 1 expired leases (queued) and 0 (failed); "
        "healed items_healed 1, leases_closed 1, leases_restored 0, "
        "exhausted_failed 0, cancels_finished 0, batches_reopened 0, "
        "counters_fixed 1, jobs_scanned 4; batches finished 0."
    )
    first_repair = LogEntry.objects.filter(user=user).order_by("pk")[1]
    assert first_repair.change_message == (
        f"Repaired by a reconciliation run from the admin: {repairs[0].message}"
    )


def test_a_clean_database_reports_nothing_to_repair(staff):
    batch = make_batch(2)
    user, client = staff("oncall", "jobs.view_job", "jobs.run_reconcile")

    response = act(client, "run_reconcile", [jobs_of(batch)[0].pk], confirm=True)

    assert response.context["reclaimed"] == {"requeued": 0, "failed": 0}
    assert {count for _, count in response.context["healed"]} == {0}
    assert response.context["repair_count"] == 0
    assert b"Nothing needed repair." in response.content
    assert LogEntry.objects.filter(user=user).count() == 1


def test_a_run_while_a_sweep_is_reconciling_says_so(staff, worker, other_worker):
    _, expired, _, drifted = _drift(worker, other_worker)
    acquire_lock("another-sweep", now=timezone.now(), ttl=LOCK_TTL)
    user, client = staff("oncall", "jobs.view_job", "jobs.run_reconcile")

    response = act(client, "run_reconcile", [expired.pk], confirm=True)

    assert response.context["skipped"] == "skipped: another sweep is reconciling"
    assert response.context["healed"] == []
    # Reclaiming expired leases is safe to share, so that part still ran.
    assert response.context["reclaimed"] == {"requeued": 1, "failed": 0}
    assert BatchItem.objects.get(pk=drifted.item_id).status == ItemStatus.DONE
    assert b"did not run: skipped: another sweep is reconciling" in response.content
    assert LogEntry.objects.get(user=user).change_message == (
        "Ran reconciliation: reclaimed 1 expired leases (queued) and 0 (failed); "
        "skipped: another sweep is reconciling."
    )


def test_a_big_database_is_scanned_a_slice_at_a_time(staff, settings):
    settings.RECALL_RECONCILE_SCAN_PER_SWEEP = 3
    batch = make_batch(5)
    _, client = staff("oncall", "jobs.view_job", "jobs.run_reconcile")

    page = act(client, "run_reconcile", [jobs_of(batch)[0].pk], confirm=False)

    confirmation = page.context["confirmation"]
    assert ("Jobs the consistency scan checks (about)", 3) in confirmation.counts
    assert confirmation.effects[2].startswith(
        "The consistency scan checks the next 3 jobs against their items and "
        "batches; the scheduled sweep checks the rest"
    )
