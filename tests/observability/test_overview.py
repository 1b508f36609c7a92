"""/overview/: the landing page after login, for every role; its figures are
the fleet's; its live region refreshes like the batch pages'; its cost does not
grow with the data."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from engine.sweep import sweep
from jobs import transitions
from jobs.models import Job, Worker
from tests.support.factories import make_batch, make_user, make_worker

pytestmark = pytest.mark.django_db

PAGES = ("/overview/", "/overview/live")


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def figure(page: str, name: str) -> str:
    found = re.search(rf'data-figure="{name}">([^<]*)<', page)
    assert found, name
    return found.group(1)


def test_every_role_sees_it_and_strangers_do_not(db):
    for user in (
        make_user("viewer", "Viewers"),
        make_user("operator", "Operators"),
        make_user("admin", superuser=True),
    ):
        for url in PAGES:
            assert client_for(user).get(url).status_code == 200, (user, url)
    stranger = client_for(make_user("stranger"))
    anonymous = Client()
    for url in PAGES:
        assert stranger.get(url).status_code == 403
        response = anonymous.get(url)
        assert response.status_code == 302
        assert response["Location"] == f"/accounts/login/?next={url}"


def test_it_is_read_only(viewer_client):
    for url in PAGES:
        assert viewer_client.post(url).status_code == 405
        assert (
            viewer_client.get(url, {"page": "\x00<script>", "x": "9" * 40}).status_code
            == 200
        )


def test_logging_in_lands_on_the_overview(db):
    make_user("viewer", "Viewers")
    client = Client()

    response = client.post("/accounts/login/", {"username": "viewer", "password": "pw"})

    assert response.status_code == 302
    assert response["Location"] == "/overview/"
    page = client.get("/overview/").content.decode()
    assert '<a href="/overview/" aria-current="page">Overview</a>' in page
    assert '<a class="brand" href="/overview/">Recall</a>' in page


def test_the_figures_are_the_fleets(viewer_client, settings):
    """On the real clock: the page reads the time from the database."""
    settings.RECALL_LEASE_SECONDS = 60
    now = timezone.now()
    busy, idle = make_worker("busy"), make_worker("idle")
    make_worker("off")
    make_batch(4, name="interviews", now=now - timedelta(hours=2))
    paused = make_batch(2, name="held", now=now)
    transitions.pause_batch(paused, now=now)
    stale = transitions.claim_next(busy, now=now - timedelta(minutes=5))
    sweep(now=now - timedelta(minutes=2))  # reclaims it: one expired lease
    assert Job.objects.get(pk=stale.pk).status == "queued"
    done = transitions.claim_next(busy, now=now - timedelta(minutes=1))
    transitions.complete(done, done.lease_token, worker=busy, result={"text": "x"})
    transitions.claim_next(busy, now=now)
    Worker.objects.filter(pk=idle.pk).update(last_seen=now)

    response = viewer_client.get("/overview/")
    page = response.content.decode()

    assert response.status_code == 200
    assert figure(page, "queued") == "4"  # 2 of interviews, 2 held
    assert figure(page, "in-flight") == "1"
    assert figure(page, "oldest").startswith("2 h 0")
    assert (figure(page, "busy"), figure(page, "idle"), figure(page, "offline")) == (
        "1",
        "1",
        "1",
    )
    assert figure(page, "expired-hour") == figure(page, "expired-day") == "1"
    assert figure(page, "forced-day") == figure(page, "repairs-day") == "0"
    assert figure(page, "throughput") == "0.0"  # 1 item in the hour: 1/60
    assert figure(page, "sweep").endswith(" ago")
    assert '<span class="state state-running">running</span>' in page
    assert '<span class="state state-paused">paused</span>' in page
    assert ">interviews</a>" in page and ">held</a>" in page
    assert 'data-live-url="/overview/live"' in page
    assert "The sweeper is not running" not in page
    assert '<a href="/?state=running">1 running</a>' in page


def test_a_missing_sweeper_is_called_out(viewer_client):
    page = viewer_client.get("/overview/").content.decode()

    assert "The sweeper is not running:</strong> no sweep has finished yet" in page
    assert figure(page, "sweep") == "never"
    assert "No batch is running, stalled or paused." in page


def test_the_live_region_keeps_refreshing(viewer_client):
    response = viewer_client.get("/overview/live")

    assert response.status_code == 200  # never 286: the fleet keeps changing
    assert response["X-Recall-Fragment"] == "1"
    assert response["Cache-Control"] == "no-store"
    assert response.content.decode().lstrip().startswith('<section id="overview-live"')


def test_flaky_workers_are_called_out(viewer_client):
    flaky = make_worker("gpu-flaky")
    make_batch(5)
    at = timezone.now() - timedelta(hours=1)
    for _ in range(3):
        transitions.claim_next(flaky, now=at)
        at += timedelta(minutes=5)
        sweep(now=at)

    page = viewer_client.get("/overview/").content.decode()

    assert "gpu-flaky (3 of 3 finished leases expired, 100%)" in page


def test_the_page_costs_the_same_with_more_data(viewer_client):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert viewer_client.get("/overview/live").status_code == 200
        return len(captured)

    make_batch(2)
    transitions.claim_next(make_worker("w"), now=timezone.now())
    few = queries()
    for i in range(8):
        make_batch(3, name=f"more-{i}")
        transitions.claim_next(make_worker(f"w-{i}"), now=timezone.now())

    assert queries() == few
