"""Admin pages stay fast on big tables: with 10,000 jobs (and their items, ledger
rows and events) every list page renders in a fixed, small number of queries,
whatever the rows on the page hold. PostgreSQL, as in production."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import transitions
from jobs.models import Job, Lease
from tests.support.admin import JOBS, VIEW_ALL, act
from tests.support.factories import make_batch, make_worker

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

JOB_COUNT = 10_000
ACTION_PERMS = (
    "jobs.force_reclaim",
    "jobs.requeue_job",
    "jobs.cancel_job",
    "jobs.run_reconcile",
    "jobs.disable_worker",
    "jobs.rotate_worker_token",
)


@pytest.fixture
def big(staff):
    """10,000 jobs in a few batches, 20 workers; some leased, done, failed and
    force-reclaimed (ledger rows, events and admin-log entries on the pages).
    Returns a client logged in as a staff user with every admin permission,
    and the big batch."""
    batch = make_batch(JOB_COUNT - 200, name="big")
    for n in range(4):
        make_batch(50, name=f"small-{n}")
    workers = [make_worker(f"gpu-{n}") for n in range(20)]
    now = timezone.now()
    leased = []
    for n in range(90):
        worker = workers[n % 20]
        job = transitions.claim_next(worker, now=now)
        if n % 3 == 0:
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": "x"}
            )
        elif n % 3 == 1:
            transitions.fail(
                job, job.lease_token, worker=worker, error="e", retryable=False
            )
        else:
            leased.append(job.pk)
    _, client = staff("admin", *VIEW_ALL, *ACTION_PERMS)
    act(client, "force_reclaim", leased[:10], confirm=True)
    assert Job.objects.count() == JOB_COUNT
    return client, batch


# Each list page renders in at most MAX_QUERIES: session, user, the user's and
# groups' permissions, then the page's own (filter choices, count, rows). The
# rows' related objects come in the rows' query, so a page of 100 rows costs
# what a page of one does.
MAX_QUERIES = 9
# The batch list also reads its rows' progress, as the operator UI's list does
# (engine.progress.progress_for_many): four queries for the whole page, and the
# time they are read at, from the database's clock on PostgreSQL: one more; and
# the labels of the workers online, for batches with queued items (whether
# they wait for a worker, issue 26): one more.
PAGE_PROGRESS_QUERIES = 6


def test_pages_render_in_a_fixed_number_of_queries(big, django_assert_max_num_queries):
    client, batch = big
    pages = [
        JOBS,
        f"{JOBS}?status__exact=leased",
        f"{JOBS}?status__exact=failed&attempts=1",
        f"{JOBS}?batch__id__exact={batch.pk}",
        f"{JOBS}?q=big-42.wav",
        "/admin/jobs/lease/",
        "/admin/jobs/lease/?open=no&end_reason__exact=forced",
        "/admin/jobs/event/",
        "/admin/jobs/worker/",
        "/admin/batches/batch/",
        "/admin/batches/batchitem/",
        f"/admin/batches/batchitem/?batch__id__exact={batch.pk}&status__exact=queued",
        "/admin/admin/logentry/",
    ]
    rows = {}
    for url in pages:
        extra = PAGE_PROGRESS_QUERIES if url == "/admin/batches/batch/" else 0
        with django_assert_max_num_queries(MAX_QUERIES + extra, info=url):
            response = client.get(url)
        assert response.status_code == 200, url
        rows[url] = len(response.context["cl"].result_list)

    assert rows == {
        JOBS: 100,
        f"{JOBS}?status__exact=leased": 20,
        f"{JOBS}?status__exact=failed&attempts=1": 30,
        f"{JOBS}?batch__id__exact={batch.pk}": 100,
        f"{JOBS}?q=big-42.wav": 1,
        "/admin/jobs/lease/": 90,
        "/admin/jobs/lease/?open=no&end_reason__exact=forced": 10,
        "/admin/jobs/event/": 10,
        "/admin/jobs/worker/": 20,
        "/admin/batches/batch/": 5,
        "/admin/batches/batchitem/": 100,
        f"/admin/batches/batchitem/?batch__id__exact={batch.pk}&status__exact=queued": 100,
        "/admin/admin/logentry/": 10,
    }

    # A job's own page, with its ledger rows and events inline.
    job = Lease.objects.filter(end_reason="forced").first().job
    with django_assert_max_num_queries(12, info="job change page"):
        assert client.get(f"{JOBS}{job.pk}/change/").status_code == 200


def test_a_big_unfiltered_list_shows_an_estimate_instead_of_counting(big, monkeypatch):
    client, _ = big
    monkeypatch.setattr("console.admin.support.ESTIMATE_ABOVE", 1_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")

    with CaptureQueriesContext(connection) as queries:
        page = client.get(JOBS)
    with CaptureQueriesContext(connection) as filtered_queries:
        filtered = client.get(f"{JOBS}?status__exact=leased")

    counts = [q["sql"] for q in queries if q["sql"].startswith("SELECT COUNT(*)")]
    assert counts == []
    assert page.context["cl"].paginator.estimated is True
    assert page.context["cl"].result_count == JOB_COUNT
    assert f"about {JOB_COUNT} jobs".encode() in page.content
    assert f"about {JOB_COUNT} results".encode() in page.content
    # A filtered list is counted exactly.
    assert filtered.context["cl"].paginator.estimated is False
    assert filtered.context["cl"].result_count == 20
    assert any(q["sql"].startswith("SELECT COUNT(*)") for q in filtered_queries)
    assert b"about" not in filtered.content.split(b'class="paginator"')[1]
