"""A login ends after RECALL_SESSION_IDLE_SECONDS (8 hours by default) without
a request: the expiry slides with every page or action (at most one session
write a minute), but not with the pages' automatic refreshes. Idle time is
made by moving the stored expiry back, not by waiting."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.contrib.sessions.models import Session
from django.utils import timezone

from tests.support.clients import client_for

pytestmark = pytest.mark.django_db

EIGHT_HOURS = 8 * 3600
REFRESH = {"HTTP_X_REQUESTED_WITH": "recall-refresh"}


def session_of(client) -> Session:
    return Session.objects.get(session_key=client.cookies["sessionid"].value)


def idle_for(client, seconds: float) -> None:
    """As if the last request that counted was ``seconds`` ago: the stored
    expiry (the last save + the idle time) moved back."""
    Session.objects.filter(session_key=client.cookies["sessionid"].value).update(
        expire_date=timezone.now() + timedelta(seconds=EIGHT_HOURS - seconds)
    )


def test_a_session_lasts_eight_idle_hours_by_default(viewer):
    assert django_settings.RECALL_SESSION_IDLE_SECONDS == EIGHT_HOURS
    assert django_settings.SESSION_COOKIE_AGE == EIGHT_HOURS
    client = client_for(viewer)
    idle_for(client, 120)  # two minutes after the login

    before = timezone.now()
    page = client.get("/")

    assert page.status_code == 200
    assert page.cookies["sessionid"]["max-age"] == EIGHT_HOURS
    expiry = session_of(client).expire_date
    assert before + timedelta(seconds=EIGHT_HOURS) <= expiry
    assert expiry <= timezone.now() + timedelta(seconds=EIGHT_HOURS)


def test_every_page_moves_the_expiry_on_but_refreshes_do_not(viewer):
    client = client_for(viewer)
    client.get("/")
    idle_for(client, 7 * 3600)  # an hour left
    left = session_of(client).expire_date

    refreshed = client.get("/overview/live", **REFRESH)
    assert refreshed.status_code in (200, 286)
    assert "sessionid" not in refreshed.cookies  # no new cookie ...
    assert session_of(client).expire_date == left  # ... and no new expiry

    before = timezone.now()
    page = client.get("/workers/")
    assert page.status_code == 200
    assert page.cookies["sessionid"]["max-age"] == EIGHT_HOURS
    moved = session_of(client).expire_date
    assert moved >= before + timedelta(seconds=EIGHT_HOURS)

    # Within the minute, another page writes nothing.
    again = client.get("/")
    assert "sessionid" not in again.cookies
    assert session_of(client).expire_date == moved


def test_an_idle_session_has_ended(viewer):
    client = client_for(viewer)
    client.get("/")
    idle_for(client, EIGHT_HOURS + 1)

    page = client.get("/")
    live = client.get("/overview/live", **REFRESH)

    assert page.status_code == 302
    assert page["Location"].startswith("/accounts/login/")
    assert live.status_code == 302
    assert "X-Recall-Fragment" not in live  # the page's script stops and says so


def test_the_idle_time_is_a_setting(settings, viewer):
    settings.SESSION_COOKIE_AGE = 600  # what RECALL_SESSION_IDLE_SECONDS=600 sets
    client = client_for(viewer)
    Session.objects.update(expire_date=timezone.now() + timedelta(seconds=300))

    page = client.get("/")

    assert page.cookies["sessionid"]["max-age"] == 600
    assert session_of(client).expire_date <= timezone.now() + timedelta(seconds=600)
