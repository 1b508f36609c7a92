"""The job actions: force reclaim, requeue failed, cancel queued.

Each action is driven through the admin as a user does it (list page, then the
confirmation page) by a staff user holding exactly the permissions it needs, and
its effect is checked on every row it touches: job, item, lease ledger,
counters, event log and Django's admin log.
"""

from __future__ import annotations

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db import DatabaseError
from django.utils import timezone

from batches.models import Batch, ItemStatus
from console.admin.job_actions import CANCEL_QUEUED, FORCE_RECLAIM, REQUEUE_FAILED
from jobs import transitions
from jobs.models import Event, Job, JobStatus, Lease, LeaseEnd
from tests.support.admin import JOBS, act, messages_of
from tests.support.factories import (
    assert_consistent,
    failpoint,
    jobs_of,
    make_batch,
    snapshot,
)

pytestmark = pytest.mark.django_db

JOB = ("jobs_job", "UPDATE")
ITEM = ("batches_batchitem", "UPDATE")
COUNTERS = ("batches_batchcounter", "UPDATE")
LEDGER_CLOSE = ("jobs_lease", "UPDATE")
EVENT = ("jobs_event", "INSERT")
BATCH = ("batches_batch", "UPDATE")
ADMIN_LOG = ("django_admin_log", "INSERT")


def _claim(api) -> dict:
    response = api.claim()
    assert response.status_code == 200, response.content
    return response.json()["job"]


def _fail_for_good(worker, now) -> Job:
    job = transitions.claim_next(worker, now=now)
    transitions.fail(
        job, job.lease_token, worker=worker, error="bad audio", retryable=False
    )
    return job


def _admin_log(user) -> list[tuple]:
    job_type = ContentType.objects.get_for_model(Job)
    return list(
        LogEntry.objects.filter(user=user)
        .order_by("object_id")
        .values_list("content_type", "object_id", "action_flag", "change_message")
        .filter(content_type=job_type)
    )


def _logged(user, jobs, message) -> None:
    job_type = ContentType.objects.get_for_model(Job)
    assert _admin_log(user) == sorted(
        (job_type.pk, str(j.pk), CHANGE, message) for j in jobs
    )


# --- Force reclaim ----------------------------------------------------------------


def test_force_reclaim_confirms_then_ends_each_lease_and_audits_it(
    staff, api, other_api
):
    batch = make_batch(3)
    first, second = _claim(api), _claim(other_api)
    queued = Job.objects.get(batch=batch, status=JobStatus.QUEUED)
    jobs = jobs_of(batch)
    ids = [first["id"], second["id"], queued.pk]
    user, client = staff("oncall", "jobs.view_job", "jobs.force_reclaim")
    before = snapshot(*jobs)

    page = act(client, "force_reclaim", ids, confirm=False)

    assert page.status_code == 200
    confirmation = page.context["confirmation"]
    assert confirmation.summary == "End the leases of the selected leased jobs now."
    assert confirmation.counts == [
        ("Jobs selected", 3),
        ("Leased: force-reclaimed", 2),
        ("Skipped: not leased (any more)", 1),
    ]
    assert confirmation.button == "Force reclaim 2 jobs"
    assert confirmation.changing == 2
    assert len(confirmation.sample) == 2
    assert snapshot(*jobs) == before  # the confirmation page changes nothing
    assert not Event.objects.exists()
    assert not LogEntry.objects.exists()

    response = act(client, "force_reclaim", ids, confirm=True)

    assert response.status_code == 302
    assert messages_of(response) == [
        "Force-reclaimed 2 jobs: queued again, their old workers fenced out.",
        f"Skipped 1 job of the selection: not leased (any more): "
        f"job {queued.pk} (queued).",
    ]
    for claimed in (first, second):
        job = Job.objects.select_related("item").get(pk=claimed["id"])
        assert (job.status, job.attempts, job.lease_token, job.leased_by) == (
            JobStatus.QUEUED,
            0,
            None,
            None,
        )
        assert job.item.status == ItemStatus.QUEUED
        lease = Lease.objects.get(token=claimed["lease_token"])
        assert lease.end_reason == LeaseEnd.FORCED
        assert lease.ended_at is not None
        assert lease.error == "The lease was ended by an administrator."
    assert batch.counts()["queued"] == 3
    assert batch.counts()["transcribing"] == 0
    events = Event.objects.order_by("job_id")
    assert [(e.kind, e.job_id, e.actor) for e in events] == [
        (Event.Kind.FORCE_RECLAIMED, first["id"], user),
        (Event.Kind.FORCE_RECLAIMED, second["id"], user),
    ]
    _logged(user, [Job(pk=first["id"]), Job(pk=second["id"])], FORCE_RECLAIM.audit)
    assert_consistent(timezone.now())


def test_the_reclaimed_worker_is_fenced_out_through_the_api(staff, api, other_api):
    make_batch(1)
    job = _claim(api)
    _, client = staff("oncall", "jobs.view_job", "jobs.force_reclaim")

    act(client, "force_reclaim", [job["id"]], confirm=True)

    heartbeat = api.heartbeat(job["id"], job["lease_token"])
    complete = api.complete(job["id"], job["lease_token"])
    assert (heartbeat.status_code, heartbeat.json()["error"]) == (409, "lease_lost")
    assert (complete.status_code, complete.json()["error"]) == (409, "lease_lost")
    assert Job.objects.get(pk=job["id"]).status == JobStatus.QUEUED
    # The job is handed out again, to whoever claims next.
    again = _claim(other_api)
    assert again["id"] == job["id"]
    assert again["lease_token"] != job["lease_token"]
    assert_consistent(timezone.now())


def test_a_lease_that_ended_after_the_confirmation_page_is_skipped(staff, api):
    make_batch(1)
    job = _claim(api)
    user, client = staff("oncall", "jobs.view_job", "jobs.force_reclaim")
    act(client, "force_reclaim", [job["id"]], confirm=False)
    api.complete(job["id"], job["lease_token"])  # the worker finishes meanwhile

    response = act(client, "force_reclaim", [job["id"]], confirm=True)

    assert messages_of(response) == [
        f"Skipped 1 job of the selection: not leased (any more): "
        f"job {job['id']} (completed).",
    ]
    assert Job.objects.get(pk=job["id"]).status == JobStatus.COMPLETED
    assert not Event.objects.exists()
    assert _admin_log(user) == []


# --- Requeue failed -----------------------------------------------------------------


def test_requeue_failed_gives_fresh_attempts_and_reopens_the_batch(staff, worker):
    now = timezone.now()
    batch = make_batch(3)
    failed = [_fail_for_good(worker, now), _fail_for_good(worker, now)]
    done = transitions.claim_next(worker, now=now)
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "ok"})
    # The last completion finished the batch itself (issue 13), so the sweep's
    # settle has nothing left to mark.
    assert Batch.objects.get(pk=batch.pk).finished_at is not None
    assert transitions.settle(now=now) == 0
    cancelled_batch = make_batch(1, name="dropped")
    in_cancelled = _fail_for_good(worker, now)
    transitions.cancel_batch(cancelled_batch, now=now)
    ids = [*(j.pk for j in failed), done.pk, in_cancelled.pk]
    user, client = staff("oncall", "jobs.view_job", "jobs.requeue_job")

    page = act(client, "requeue_failed", ids, confirm=False)

    assert page.context["confirmation"].counts == [
        ("Jobs selected", 4),
        ("Failed: queued again", 2),
        (
            "Skipped: not failed, or in a cancelled batch (retry leaves those failed)",
            2,
        ),
    ]

    response = act(client, "requeue_failed", ids, confirm=True)

    assert messages_of(response) == [
        "Queued 2 jobs again with fresh attempts.",
        "Skipped 2 jobs of the selection: not failed, or in a cancelled batch "
        f"(retry leaves those failed): job {done.pk} (completed), "
        f"job {in_cancelled.pk} (failed).",
    ]
    for job in failed:
        job = Job.objects.select_related("item").get(pk=job.pk)
        assert (job.status, job.attempts, job.item.status) == (
            JobStatus.QUEUED,
            0,
            ItemStatus.QUEUED,
        )
        # The ledger keeps the failed attempt as it was.
        assert list(job.leases.values_list("end_reason", flat=True)) == ["failed"]
    assert Batch.objects.get(pk=batch.pk).finished_at is None
    assert batch.counts()["queued"] == 2
    assert batch.counts()["failed"] == 0
    assert Job.objects.get(pk=in_cancelled.pk).status == JobStatus.FAILED
    retried = Event.objects.filter(kind=Event.Kind.RETRIED).order_by("job_id")
    assert [(e.job_id, e.actor, e.message) for e in retried] == [
        (j.pk, user, "Queued again with fresh attempts.") for j in failed
    ]
    _logged(user, failed, REQUEUE_FAILED.audit)
    assert_consistent(timezone.now())


# --- Cancel queued --------------------------------------------------------------------


def test_cancel_queued_cancels_job_item_and_counters_and_audits_it(staff, worker):
    batch = make_batch(4)
    leased = transitions.claim_next(worker, now=timezone.now())
    queued = [j for j in jobs_of(batch) if j.pk != leased.pk]
    user, client = staff("oncall", "jobs.view_job", "jobs.cancel_job")
    ids = [j.pk for j in jobs_of(batch)]

    page = act(client, "cancel_queued", ids, confirm=False)

    assert page.context["confirmation"].counts == [
        ("Jobs selected", 4),
        ("Queued: cancelled", 3),
        ("Skipped: not queued", 1),
    ]

    response = act(client, "cancel_queued", ids, confirm=True)

    assert messages_of(response) == [
        "Cancelled 3 jobs.",
        f"Skipped 1 job of the selection: not queued: job {leased.pk} (leased).",
    ]
    for job in queued:
        job = Job.objects.select_related("item").get(pk=job.pk)
        assert (job.status, job.item.status) == (
            JobStatus.CANCELLED,
            ItemStatus.CANCELLED,
        )
        assert job.finished_at is not None
    lease = Lease.objects.get(job=leased)
    assert (lease.ended_at, lease.end_reason) == (None, None)
    assert Job.objects.get(pk=leased.pk).status == JobStatus.LEASED
    assert batch.counts()["cancelled"] == 3
    assert batch.counts()["queued"] == 0
    assert batch.counts()["transcribing"] == 1
    cancelled = Event.objects.filter(kind=Event.Kind.CANCELLED).order_by("job_id")
    assert [(e.job_id, e.actor, e.message) for e in cancelled] == [
        (j.pk, user, "Job cancelled.") for j in queued
    ]
    _logged(user, queued, CANCEL_QUEUED.audit)
    assert_consistent(timezone.now())


def test_all_matching_acts_on_the_filtered_list_in_chunks(staff, settings):
    settings.RECALL_CHUNK_SIZE = 2
    target, other = make_batch(5, name="target"), make_batch(3, name="other")
    user, client = staff("oncall", "jobs.view_job", "jobs.cancel_job")
    url = f"{JOBS}?batch__id__exact={target.pk}&status__exact=queued"
    page_ids = [jobs_of(target)[-1].pk]  # the admin posts the page's ticked rows too

    page = act(
        client, "cancel_queued", page_ids, confirm=False, url=url, select_across=True
    )

    assert page.context["confirmation"].counts == [
        ("Jobs selected", 5),
        ("Queued: cancelled", 5),
        ("Skipped: not queued", 0),
    ]
    assert page.context["select_across"] == "1"

    response = act(
        client, "cancel_queued", page_ids, confirm=True, url=url, select_across=True
    )

    assert response.status_code == 302
    assert response["Location"] == url
    assert messages_of(response) == ["Cancelled 5 jobs."]
    assert {j.status for j in jobs_of(target)} == {JobStatus.CANCELLED}
    assert {j.status for j in jobs_of(other)} == {JobStatus.QUEUED}
    assert LogEntry.objects.filter(user=user).count() == 5
    assert_consistent(timezone.now())


def test_nothing_to_do_shows_no_button(staff):
    batch = make_batch(1)
    _, client = staff("oncall", "jobs.view_job", "jobs.force_reclaim")

    page = act(client, "force_reclaim", [jobs_of(batch)[0].pk], confirm=False)

    assert page.context["confirmation"].button is None
    assert b'name="post"' in page.content
    assert b'<input type="submit"' not in page.content
    assert b"Nothing to do." in page.content


# --- All or nothing -----------------------------------------------------------------


def _leased_pair(worker, other_worker):
    batch = make_batch(2)
    now = timezone.now()
    transitions.claim_next(worker, now=now)
    transitions.claim_next(other_worker, now=now)
    return jobs_of(batch)


def _failed_pair(worker, other_worker):
    batch = make_batch(2)
    now = timezone.now()
    _fail_for_good(worker, now)
    _fail_for_good(other_worker, now)
    transitions.settle(now=now)
    return jobs_of(batch)


def _queued_pair(worker, other_worker):
    return jobs_of(make_batch(2))


@pytest.mark.parametrize(
    ("action", "perm", "setup", "write"),
    [
        *(
            ("force_reclaim", "jobs.force_reclaim", _leased_pair, w)
            for w in (JOB, ITEM, COUNTERS, LEDGER_CLOSE, EVENT, ADMIN_LOG)
        ),
        *(
            ("requeue_failed", "jobs.requeue_job", _failed_pair, w)
            for w in (JOB, ITEM, COUNTERS, EVENT, BATCH, ADMIN_LOG)
        ),
        *(
            ("cancel_queued", "jobs.cancel_job", _queued_pair, w)
            for w in (JOB, ITEM, COUNTERS, EVENT, ADMIN_LOG)
        ),
    ],
)
def test_an_action_whose_write_fails_changes_nothing(
    action, perm, setup, write, staff, worker, other_worker
):
    jobs = setup(worker, other_worker)
    _, client = staff("oncall", "jobs.view_job", perm)
    events = Event.objects.count()
    before = snapshot(*jobs)

    with failpoint(*write), pytest.raises(DatabaseError, match="failpoint"):
        act(client, action, [j.pk for j in jobs], confirm=True)

    assert snapshot(*jobs) == before
    assert Event.objects.count() == events
    assert not LogEntry.objects.exists()


def test_a_long_run_stops_at_the_time_limit_and_the_next_run_goes_on(
    staff, settings, monkeypatch
):
    settings.RECALL_CHUNK_SIZE = 2
    monkeypatch.setattr("console.admin.job.ACTION_SECONDS", 0)  # stop after one chunk
    batch = make_batch(5)
    user, client = staff("oncall", "jobs.view_job", "jobs.cancel_job")
    url = f"{JOBS}?batch__id__exact={batch.pk}"
    ids = [j.pk for j in jobs_of(batch)]

    first = act(
        client, "cancel_queued", ids[:1], confirm=True, url=url, select_across=True
    )

    assert messages_of(first) == [
        "Cancelled 2 jobs.",
        "Stopped after 0 seconds to keep this request short; still queued: 3 jobs "
        "of the selection. Run the action again to go on.",
    ]
    assert [j.status for j in jobs_of(batch)] == ["cancelled"] * 2 + ["queued"] * 3
    assert_consistent(timezone.now())
    client.get(first["Location"])

    second = act(
        client, "cancel_queued", ids[:1], confirm=True, url=url, select_across=True
    )

    assert messages_of(second) == [
        "Cancelled 2 jobs.",
        "Stopped after 0 seconds to keep this request short; still queued: 1 job "
        "of the selection. Run the action again to go on.",
        "Skipped 2 jobs of the selection: not queued.",
    ]
    client.get(second["Location"])
    third = act(
        client, "cancel_queued", ids[:1], confirm=True, url=url, select_across=True
    )

    assert messages_of(third) == [
        "Cancelled 1 job.",
        "Skipped 4 jobs of the selection: not queued.",
    ]
    assert {j.status for j in jobs_of(batch)} == {"cancelled"}
    assert LogEntry.objects.filter(user=user).count() == 5
    assert_consistent(timezone.now())
