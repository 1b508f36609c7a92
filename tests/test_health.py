"""Health probes: /healthz (alive) and /readyz (database and sweeper)."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from engine.reconcile import sweep_state
from engine.sweep import sweep


def test_healthz_needs_no_database_and_no_known_host():
    response = Client(HTTP_HOST="10.1.2.3:8000").get("/healthz")

    assert (response.status_code, response.json()) == (200, {"status": "ok"})


@pytest.mark.django_db
def test_readyz_before_any_sweep_is_503_with_a_reason():
    response = Client().get("/readyz")

    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "last_sweep": None,
        "reasons": ["no sweep has finished yet (is the django-q2 cluster running?)"],
    }


@pytest.mark.django_db
def test_readyz_after_a_sweep_is_200_even_for_an_unknown_host():
    sweep()

    response = Client(HTTP_HOST="10.1.2.3").get("/readyz")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["last_sweep"] == sweep_state().last_finished_at.isoformat()


@pytest.mark.django_db
def test_readyz_with_a_stale_sweep_is_503(settings):
    settings.RECALL_READY_MAX_SWEEP_AGE_SECONDS = 300
    sweep(now=timezone.now() - timedelta(minutes=10))

    response = Client().get("/readyz")

    assert response.status_code == 503
    [reason] = response.json()["reasons"]
    assert reason.startswith("the last sweep finished 60")
    assert reason.endswith("s ago (limit 300 s): is the django-q2 cluster running?")


@pytest.mark.django_db
def test_probes_are_not_redirected_to_https(settings):
    settings.SECURE_SSL_REDIRECT = True
    sweep()
    client = Client()

    assert client.get("/").status_code == 301
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
