"""The admin's pages: read-only where state lives, progress from the counters,
a job's history on its page, links between rows, search and filters."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.utils import timezone

from batches.models import Batch, BatchItem
from console.admin.support import RECENT_BATCHES
from jobs import transitions
from jobs.models import Event, Lease
from tests.support.admin import JOBS, VIEW_ALL, act
from tests.support.factories import is_postgres, jobs_of, make_batch, snapshot

pytestmark = pytest.mark.django_db

READ_ONLY = {
    "job": "/admin/jobs/job/",
    "lease": "/admin/jobs/lease/",
    "event": "/admin/jobs/event/",
    "item": "/admin/batches/batchitem/",
    "admin log": "/admin/admin/logentry/",
}


def _one_of_everything(worker, superuser_client) -> dict:
    batch = make_batch(2)
    job = transitions.claim_next(worker, now=timezone.now())
    act(superuser_client, "force_reclaim", [job.pk], confirm=True)
    return {
        "job": job.pk,
        "lease": Lease.objects.get(job=job).pk,
        "event": Event.objects.get(job=job).pk,
        "item": job.item_id,
        "admin log": LogEntry.objects.get().pk,
        "batch": batch,
    }


@pytest.mark.parametrize("model", READ_ONLY)
def test_no_one_adds_changes_or_deletes_state_rows(model, superuser_client, worker):
    rows = _one_of_everything(worker, superuser_client)
    url, pk = READ_ONLY[model], rows[model]
    before = snapshot(*jobs_of(rows["batch"]))
    events, entries = Event.objects.count(), LogEntry.objects.count()

    assert superuser_client.get(f"{url}add/").status_code == 403
    assert superuser_client.post(f"{url}add/", {}).status_code == 403
    view = superuser_client.get(f"{url}{pk}/change/")
    assert view.status_code == 200
    assert b'name="_save"' not in view.content
    assert b"deletelink" not in view.content
    assert (
        superuser_client.post(
            f"{url}{pk}/change/", {"status": "completed", "attempts": "0"}
        ).status_code
        == 403
    )
    assert (
        superuser_client.post(f"{url}{pk}/delete/", {"post": "yes"}).status_code == 403
    )
    listing = superuser_client.get(url)
    assert b'value="delete_selected"' not in listing.content
    assert snapshot(*jobs_of(rows["batch"])) == before
    assert (Event.objects.count(), LogEntry.objects.count()) == (events, entries)


def test_a_batch_edits_only_its_name_and_priority(superuser_client, worker):
    batch = make_batch(3)
    transitions.claim_next(worker, now=timezone.now())
    before = Batch.objects.filter(pk=batch.pk).values().get()
    url = f"/admin/batches/batch/{batch.pk}/change/"

    response = superuser_client.post(
        url,
        {
            "name": "Renamed",
            "priority": "5",
            "total": "999",
            "finished_at_0": "2026-01-01",
            "finished_at_1": "00:00:00",
            "cancelled_at_0": "2026-01-01",
            "cancelled_at_1": "00:00:00",
        },
    )

    assert response.status_code == 302
    after = Batch.objects.filter(pk=batch.pk).values().get()
    assert after == {**before, "name": "Renamed", "priority": 5}
    assert superuser_client.get("/admin/batches/batch/add/").status_code == 403
    assert (
        superuser_client.post(
            f"/admin/batches/batch/{batch.pk}/delete/", {"post": "yes"}
        ).status_code
        == 403
    )


def test_a_jobs_page_shows_its_history_and_links(staff, worker, superuser_client):
    batch = make_batch(1)
    job = transitions.claim_next(worker, now=timezone.now())
    act(superuser_client, "force_reclaim", [job.pk], confirm=True)
    again = transitions.claim_next(worker, now=timezone.now())
    _, client = staff("viewer", *VIEW_ALL)

    page = client.get(f"{JOBS}{job.pk}/change/")

    assert page.status_code == 200
    leases, events = page.context["inline_admin_formsets"]
    assert [(f.form.instance.attempt, f.form.instance.end_reason) for f in leases] == [
        (1, "forced"),
        (1, None),
    ]
    assert [(f.form.instance.kind, f.form.instance.actor.username) for f in events] == [
        ("force_reclaimed", "root-admin")
    ]
    content = page.content.decode()
    assert f'href="/admin/batches/batchitem/{job.item_id}/change/"' in content
    assert f'href="/admin/batches/batch/{batch.pk}/change/"' in content
    assert f'href="/admin/jobs/worker/{worker.pk}/change/"' in content
    assert f'href="/admin/jobs/lease/?job__id__exact={job.pk}"' in content
    assert f'href="/admin/jobs/event/?job__id__exact={job.pk}"' in content
    assert f'href="/admin/jobs/job/{job.pk}/history/"' in content
    assert again.lease_token not in content  # only a prefix of the live token
    assert again.lease_token[:8] in content
    history = client.get(f"{JOBS}{job.pk}/history/")
    assert [e.change_message for e in history.context["action_list"]] == [
        "Force reclaim: lease ended (ledger row closed as forced), job queued "
        "again; the old worker is fenced out."
    ]


def test_the_item_page_links_its_batch_and_job(superuser_client):
    batch = make_batch(1)
    job = jobs_of(batch)[0]

    page = superuser_client.get(f"/admin/batches/batchitem/{job.item_id}/change/")

    content = page.content.decode()
    assert f'href="/admin/jobs/job/{job.pk}/change/"' in content
    assert f'href="/admin/batches/batch/{batch.pk}/change/"' in content


def _listed(client, url) -> list[int]:
    response = client.get(url)
    assert response.status_code == 200, response.content
    return sorted(row.pk for row in response.context["cl"].result_list)


def test_search_finds_jobs_by_id_token_or_source(superuser_client, worker):
    batch = make_batch(3, name="talks")
    jobs = jobs_of(batch)
    leased = transitions.claim_next(worker, now=timezone.now())

    assert _listed(superuser_client, f"{JOBS}?q={jobs[1].pk}") == [jobs[1].pk]
    assert _listed(superuser_client, f"{JOBS}?q={leased.lease_token}") == [leased.pk]
    assert _listed(superuser_client, f"{JOBS}?q=talks-2.wav") == [jobs[2].pk]
    if is_postgres():  # SQLite's LIKE ignores case anyway
        assert _listed(superuser_client, f"{JOBS}?q=TALKS-2") == []
    assert _listed(superuser_client, f"{JOBS}?q={10**30}") == []
    assert _listed(superuser_client, f"/admin/jobs/lease/?q={leased.pk}") == [
        Lease.objects.get(job=leased).pk
    ]
    assert _listed(superuser_client, "/admin/batches/batchitem/?q=talks-0") == [
        jobs[0].item_id
    ]
    assert _listed(superuser_client, f"/admin/batches/batch/?q={batch.pk}") == [
        batch.pk
    ]


def test_filters_by_status_batch_worker_and_attempts(
    superuser_client, worker, other_worker
):
    first, second = make_batch(3, name="first"), make_batch(2, name="second")
    now = timezone.now()
    mine = transitions.claim_next(worker, now=now)
    theirs = transitions.claim_next(other_worker, now=now)
    ids = lambda batch: [j.pk for j in jobs_of(batch)]  # noqa: E731

    assert _listed(superuser_client, f"{JOBS}?status__exact=leased") == sorted(
        [mine.pk, theirs.pk]
    )
    assert _listed(superuser_client, f"{JOBS}?batch__id__exact={second.pk}") == ids(
        second
    )
    assert _listed(superuser_client, f"{JOBS}?leased_by__id__exact={worker.pk}") == [
        mine.pk
    ]
    assert _listed(superuser_client, f"{JOBS}?attempts=1") == sorted(
        [mine.pk, theirs.pk]
    )
    assert _listed(superuser_client, f"{JOBS}?attempts=0") == sorted(
        set(ids(first) + ids(second)) - {mine.pk, theirs.pk}
    )
    assert _listed(superuser_client, f"{JOBS}?attempts=3%2B") == []
    assert _listed(superuser_client, f"{JOBS}?batch__id__exact=nope") == []
    assert _listed(superuser_client, "/admin/jobs/lease/?open=yes") == sorted(
        Lease.objects.values_list("pk", flat=True)
    )


def test_the_batch_filter_offers_the_newest_batches_and_the_chosen_one(
    superuser_client,
):
    oldest = make_batch(1, name="oldest")
    for n in range(RECENT_BATCHES):
        make_batch(1, name=f"b{n}")

    offered = superuser_client.get(JOBS).context["cl"].filter_specs[1].lookup_choices
    chosen = superuser_client.get(f"{JOBS}?batch__id__exact={oldest.pk}")

    assert len(offered) == RECENT_BATCHES
    assert str(oldest.pk) not in dict(offered)
    choices = chosen.context["cl"].filter_specs[1].lookup_choices
    assert choices[-1] == (str(oldest.pk), f"#{oldest.pk} oldest")
    assert [j.pk for j in chosen.context["cl"].result_list] == [
        j.pk for j in jobs_of(oldest)
    ]
    assert BatchItem.objects.count() == RECENT_BATCHES + 1


def test_the_admin_changes_a_batch_share_through_its_transition(
    superuser_client, worker
):
    batch = make_batch(3)
    url = f"/admin/batches/batch/{batch.pk}/change/"

    response = superuser_client.post(
        url, {"name": batch.name, "priority": "0", "weight": "4", "max_in_flight": "2"}
    )

    assert response.status_code == 302
    batch.refresh_from_db()
    assert (batch.weight, batch.max_in_flight) == (4, 2)
    event = Event.objects.get(kind=Event.Kind.BATCH_CHANGED, batch=batch)
    assert event.message == "Changed weight 1 -> 4, max in flight unlimited -> 2."

    response = superuser_client.post(
        url, {"name": batch.name, "priority": "0", "weight": "0", "max_in_flight": ""}
    )
    assert response.status_code == 200  # the form again, with the error
    assert (
        "Ensure this value is greater than or equal to 1." in response.content.decode()
    )
    assert Batch.objects.get(pk=batch.pk).weight == 4
