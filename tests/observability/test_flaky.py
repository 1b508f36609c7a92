"""Flaky workers (issue 27, item 6): the demo's gpu-flaky, SIGKILLed every 45 s
with 15 s leases while it completes plenty in between, is flagged at its third
kill; a healthy worker never is, not even after an outage that expires all its
leases at once. Time is passed in."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from engine import fleet
from jobs import transitions
from tests.support.factories import T0, make_batch, make_worker

pytestmark = pytest.mark.django_db


def test_incidents_group_expiries_within_a_lease():
    at = [T0 + timedelta(seconds=s) for s in (0, 4, 15, 16, 60, 200, 201)]
    assert fleet.incidents(at, timedelta(seconds=15)) == 4  # 0-15, 16, 60, 200-201
    assert fleet.incidents(at[:3], timedelta(seconds=15)) == 1
    assert fleet.incidents([], timedelta(seconds=15)) == 0


def _work(worker, n, at):
    for _ in range(n):
        job = transitions.claim_next(worker, now=at)
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=at
        )


def _flaky_names(now) -> list[str]:
    return [f.worker.name for f in fleet.flaky_workers(now)]


def test_the_demos_flaky_worker_is_flagged_at_its_third_kill(settings):
    settings.RECALL_LEASE_SECONDS = 15  # the demo's: a heartbeat every 5 s
    make_batch(400, now=T0)
    healthy, flaky = make_worker("gpu-1"), make_worker("gpu-flaky")
    flagged_at = []
    for kill in range(1, 9):
        start = T0 + timedelta(seconds=45 * (kill - 1))
        # Restarted, it completes ten items, then holds two leases when killed.
        _work(flaky, 10, start + timedelta(seconds=5))
        held = [transitions.claim_next(flaky, now=start + timedelta(seconds=40))]
        held.append(transitions.claim_next(flaky, now=start + timedelta(seconds=42)))
        _work(healthy, 12, start + timedelta(seconds=30))
        killed = start + timedelta(seconds=45)
        # Its leases run out 15 s after their claims; a claim or sweep takes
        # them back a little later.
        reclaimed = transitions.reclaim_expired(now=killed + timedelta(seconds=13))
        # (The same items come back to it and die again: some fail for good.)
        assert reclaimed["requeued"] + reclaimed["failed"] == 2
        if "gpu-flaky" in _flaky_names(killed + timedelta(seconds=14)):
            flagged_at.append(kill)
        assert "gpu-1" not in _flaky_names(killed + timedelta(seconds=14))

    assert flagged_at == [3, 4, 5, 6, 7, 8]
    # Two expired of every twelve finished: the share alone (20%) never flags it.
    [found] = fleet.flaky_workers(T0 + timedelta(minutes=6, seconds=15))
    assert (found.expired, found.ended, found.share, found.incidents) == (16, 96, 17, 8)
    assert not fleet.is_flaky(found.expired, found.ended)
    # An hour after the last kill it has only its share against it.
    assert _flaky_names(T0 + timedelta(hours=2)) == []


def test_one_outage_that_expires_every_lease_at_once_is_one_incident(settings):
    settings.RECALL_LEASE_SECONDS = 15
    make_batch(200, now=T0)
    healthy = make_worker("gpu-1")
    _work(healthy, 100, T0)
    for s in (0, 1, 2, 3):  # four leases, the server unreachable afterwards
        transitions.claim_next(healthy, now=T0 + timedelta(seconds=60 + s))
    reclaimed = transitions.reclaim_expired(now=T0 + timedelta(seconds=80))
    assert reclaimed["requeued"] == 4

    assert fleet.recent_incidents(T0 + timedelta(seconds=90)) == {healthy.pk: 1}
    assert _flaky_names(T0 + timedelta(seconds=90)) == []


def test_the_workers_page_says_the_rule_and_flags_the_worker(viewer_client):
    flaky, steady = make_worker("gpu-flaky"), make_worker("gpu-1")
    make_batch(60)
    now = timezone.now()
    for minutes in (50, 30, 10):  # three crashes in the last hour
        at = now - timedelta(minutes=minutes)
        _work(flaky, 8, at)
        _work(steady, 8, at)
        transitions.claim_next(flaky, now=at)
        transitions.reclaim_expired(now=at + timedelta(minutes=2))

    page = viewer_client.get("/workers/").content.decode()
    overview = viewer_client.get("/overview/").content.decode()

    rows = dict(re.findall(r'<th scope="row">([\w-]+)(.*?)</tr>', page, re.S))
    assert "flaky</span>" in rows["gpu-flaky"]
    assert "flaky</span>" not in rows["gpu-1"]
    assert "3 times in the last hour" in rows["gpu-flaky"]
    assert (
        "A worker is marked <strong>flaky</strong> when its leases ran out at 3 or "
        "more separate times in the last hour (leases that run out within one "
        "lease, 1 min, of each other count once: one crash), or when 3 or more of "
        "its leases ever expired and they are at least 20% of its finished leases."
    ) in page
    assert (
        "gpu-flaky (3 of 27 finished leases expired, 11%), leases lost 3 times in "
        "the last hour"
    ) in overview
