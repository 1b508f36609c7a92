"""What the pages say, for issue 27's items that need no browser: a done item's
earlier errors (12), the admin's lease times with seconds (13), the favicon
(15), and the live workers fragment (11)."""

from __future__ import annotations

import pytest

from jobs import transitions
from tests.support.factories import T0, later, make_batch

pytestmark = pytest.mark.django_db


def test_a_done_items_earlier_error_is_in_its_history_not_its_state(
    viewer_client, worker
):
    batch = make_batch(1)
    job = transitions.claim_next(worker, now=T0)
    transitions.fail(job, job.lease_token, worker=worker, error="CUDA OOM", now=T0)
    job = transitions.claim_next(worker, now=later(3600))
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "hi"}, now=later(3600)
    )
    item = batch.items.get()

    page = viewer_client.get(f"/items/{item.pk}/").content.decode()

    assert "Last error" not in page
    assert 'class="error-text"' in page  # the attempt's error, in the history
    history = page.split("<h2>Attempts</h2>", 1)[1]
    assert "CUDA OOM" in history
    assert page.index("CUDA OOM") > page.index("<h2>Attempts</h2>")


def test_a_failed_item_still_shows_its_last_error(viewer_client, worker):
    batch = make_batch(1)
    job = transitions.claim_next(worker, now=T0)
    transitions.fail(
        job, job.lease_token, worker=worker, error="bad file", retryable=False, now=T0
    )

    page = viewer_client.get(f"/items/{batch.items.get().pk}/").content.decode()

    assert '<h2>Last error</h2>\n<pre class="error-text">bad file</pre>' in page


def test_the_admins_job_page_shows_lease_times_with_seconds(superuser_client, worker):
    make_batch(1)
    job = transitions.claim_next(worker, now=later(7))  # T0 is 12:00:00

    page = superuser_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()

    expires = job.lease_expires_at.strftime("%H:%M:%S")
    assert f"Jan. 1, 2026, {expires}" in page  # the lease's expiry, to the second
    assert "Jan. 1, 2026, 12:00:07" in page  # heartbeat and claim
    assert "p.m." not in page and "noon" not in page


def test_the_favicon_is_served(client):
    response = client.get("/favicon.ico")

    assert response.status_code == 200
    assert response["Content-Type"] == "image/x-icon"
    assert response.content[:4] == b"\x00\x00\x01\x00"  # an ICO file


def test_the_workers_fragment_is_live(viewer_client, worker):
    response = viewer_client.get("/workers/live")

    assert response.status_code == 200
    assert response["X-Recall-Fragment"] == "1"
    page = response.content.decode().strip()
    assert page.startswith('<section id="workers-live" data-live-url="/workers/live">')
    assert f'<th scope="row">{worker.name}</th>' in page
    assert "<h1>" not in page  # the region alone
