"""The admin's batch list and batch page show the operator UI's progress (state,
bar, counts, throughput, ETA: the same function and fragments) in live regions;
its state filter is the operator list's; bad input is never a 500."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from batches.models import Batch
from engine.progress import BatchState, format_duration, progress_for
from jobs import transitions
from tests.support.factories import make_batch, make_user

pytestmark = pytest.mark.django_db

LIST = "/admin/batches/batch/"


def counts_shown(html: str) -> dict[str, int]:
    return {s: int(n) for s, n in re.findall(r'data-count="(\w+)">(\d+)<', html)}


@pytest.fixture
def half_done(worker) -> Batch:
    batch = make_batch(5, name="half done")
    now = timezone.now()
    # Seen, as its API calls would record (issue 26: else the batch waits for
    # a worker, without an ETA).
    transitions.touch_worker(worker, now=now)
    done = transitions.claim_next(worker, now=now)
    transitions.complete(done, done.lease_token, worker=worker, result={"text": "x"})
    failed = transitions.claim_next(worker, now=now)
    transitions.fail(
        failed, failed.lease_token, worker=worker, error="e", retryable=False
    )
    transitions.claim_next(worker, now=now)
    return batch


def test_the_list_shows_each_batchs_progress(superuser_client, half_done):
    make_batch(1, name="other")

    response = superuser_client.get(LIST)

    [row] = [b for b in response.context["cl"].result_list if b.pk == half_done.pk]
    expected = {"queued": 2, "transcribing": 1, "done": 1, "failed": 1, "cancelled": 0}
    assert row.progress.counts == expected
    assert {s: half_done.counts()[s] for s in expected} == expected
    html = response.content.decode()
    region = html[html.index('<div id="batch-results"') :]
    assert region.startswith(
        '<div id="batch-results" class="recall-live" '
        'data-live-url="/admin/batches/batch/live/?p=1">'
    )
    first_row = region[region.index(f">{half_done.pk}</a>") :]
    first_row = first_row[: first_row.index("</tr>")]
    assert '<span class="state state-running">running</span>' in first_row
    assert counts_shown(first_row) == expected
    # The bar is SVG geometry (the CSP allows no inline style): done is the
    # first fifth.
    assert '<path class="seg seg-done" d="M0.000 0h20.000v1H0.000z">' in first_row
    assert ">20.0%<" in first_row
    assert f">{row.progress.throughput_per_minute:.1f}/min<" in first_row
    assert f">{format_duration(row.progress.eta_seconds)}<" in first_row
    # The operator UI's refresh control and script, the admin's look.
    assert 'id="refresh-interval"' in html
    assert "/static/js/recall.js" in html
    assert "/static/css/recall-admin.css" in html


def test_the_batch_page_shows_the_operator_uis_summary(superuser_client, half_done):
    response = superuser_client.get(f"{LIST}{half_done.pk}/change/")

    html = response.content.decode()
    assert response.status_code == 200
    assert (
        f'<div id="batch-progress" class="recall-live" '
        f'data-live-url="/admin/batches/batch/{half_done.pk}/progress/">' in html
    )
    assert counts_shown(html) == {
        "done": 1,
        "failed": 1,
        "transcribing": 1,
        "queued": 2,
        "cancelled": 0,
    }
    assert '<strong class="big" data-percent>20.0% done</strong>' in html
    assert "<dt>ETA</dt>" in html and "How the ETA is computed" in html
    assert 'id="refresh-interval"' in html
    # Only the name, the share (priority, weight, max in flight) and, while
    # the batch is open, what it requires of workers (issue 26) can change.
    assert set(response.context["adminform"].form.fields) == {
        "name",
        "priority",
        "weight",
        "max_in_flight",
        "requires",
    }


def test_the_live_regions_answer_fragments(superuser_client, half_done, worker):
    progress = superuser_client.get(f"{LIST}{half_done.pk}/progress/")
    listing = superuser_client.get(f"{LIST}live/?state=running&p=1")

    assert progress.status_code == 200
    assert progress["X-Recall-Fragment"] == "1"
    assert progress.content.decode().startswith(
        f'<div id="batch-progress" class="recall-live" '
        f'data-live-url="/admin/batches/batch/{half_done.pk}/progress/">'
    )
    assert listing.status_code == 200
    assert listing["X-Recall-Fragment"] == "1"
    assert [b.pk for b in listing.context["cl"].result_list] == [half_done.pk]
    assert listing.content.decode().startswith(
        '<div id="batch-results" class="recall-live" '
        'data-live-url="/admin/batches/batch/live/?p=1&amp;state=running">'
    )

    # Once nothing will change, 286 tells the script to stop.
    transitions.cancel_batch(half_done)
    stopped = superuser_client.get(f"{LIST}{half_done.pk}/progress/")
    assert stopped.status_code == 286
    assert 'data-live-final="1"' in stopped.content.decode()
    assert superuser_client.get(f"{LIST}live/").status_code == 286


def test_the_state_filter_is_the_operator_lists(superuser_client, worker, settings):
    settings.RECALL_LEASE_SECONDS = 3600
    settings.RECALL_STALLED_AFTER_SECONDS = 180
    now = timezone.now()
    make_batch(1, name="running", now=now)
    transitions.claim_next(worker, now=now)
    make_batch(1, name="stalled", now=now - timedelta(minutes=15))
    transitions.claim_next(worker, now=now - timedelta(minutes=10))
    transitions.pause_batch(make_batch(1, name="paused"))
    finished = make_batch(1, name="finished")
    job = transitions.claim_next(worker, now=now)
    transitions.complete(job, job.lease_token, worker=worker, result={"text": ""})
    assert job.batch_id == finished.pk
    transitions.cancel_batch(make_batch(1, name="cancelled"))
    operator = Client()
    operator.force_login(make_user("viewer", "Viewers"))

    for state in BatchState.ALL:
        admin = superuser_client.get(LIST, {"state": state}).context["cl"].result_list
        operators = re.findall(
            r'<a href="/batches/(\d+)/">', operator.get("/", {"state": state}).text
        )
        assert [b.name for b in admin] == [state]
        assert [b.pk for b in admin] == [int(pk) for pk in operators]
        assert admin[0].progress.state == state


def test_bad_input_is_never_a_500(superuser_client, half_done):
    assert superuser_client.get(f"{LIST}999999/progress/").status_code == 404
    assert superuser_client.get(f"{LIST}abc/progress/").status_code == 404
    assert superuser_client.get(f"{LIST}live/?nope=1").status_code == 400
    assert superuser_client.get(f"{LIST}live/?p=999").status_code in (200, 286)
    bogus = superuser_client.get(LIST, {"state": "bogus"})
    assert list(bogus.context["cl"].result_list) == []


def test_the_live_regions_need_the_view_permission(staff, half_done):
    urls = [f"{LIST}live/", f"{LIST}{half_done.pk}/progress/"]
    _, outsider = staff("outsider", "jobs.view_job")
    _, viewer = staff("viewer", "batches.view_batch")

    for url in urls:
        assert Client().get(url).status_code == 302  # to the admin's login
        assert outsider.get(url).status_code == 403
        assert viewer.get(url).status_code == 200


def test_the_progress_is_the_operator_uis(superuser_client, half_done):
    """One function: the admin's numbers are progress_for's."""
    page = superuser_client.get(f"{LIST}{half_done.pk}/change/").content.decode()
    expected = progress_for(half_done, now=timezone.now())

    assert counts_shown(page) == expected.counts
    assert f"{expected.percent_done:.1f}% done" in page
    assert expected.eta_basis in page
