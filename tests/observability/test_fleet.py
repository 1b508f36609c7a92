"""The fleet's history and workers as the overview reads them: windows on the
ledger and the event log, throughput per minute, flaky workers by the workers
page's own rule. Time is passed in."""

from __future__ import annotations

from datetime import timedelta

import pytest

from engine import fleet
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Event
from tests.support.factories import T0, make_batch, make_worker

pytestmark = pytest.mark.django_db

NOW = T0 + timedelta(days=3)


def ago(**delta) -> object:
    return NOW - timedelta(**delta)


def expire(worker, at) -> None:
    """A lease claimed two minutes before ``at``, reclaimed as expired at ``at``."""
    assert transitions.claim_next(worker, now=at - timedelta(minutes=2))
    reclaimed = sweep(now=at)["reclaimed"]
    assert reclaimed["requeued"] + reclaimed["failed"] == 1


def force(worker, at) -> None:
    job = transitions.claim_next(worker, now=at)
    assert transitions.force_reclaim(job, now=at)


def complete(worker, at) -> None:
    job = transitions.claim_next(worker, now=at)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": ""}, now=at
    )


def test_lease_endings_and_repairs_in_the_last_hour_and_day(worker):
    make_batch(10, now=T0)
    expire(worker, ago(days=2))
    force(worker, ago(hours=20))
    expire(worker, ago(hours=5))
    force(worker, ago(hours=1))  # exactly an hour ago: in the last hour
    expire(worker, ago(minutes=30))
    force(worker, ago(minutes=10))
    for created_at in (ago(days=2), ago(hours=3), ago(minutes=30)):
        Event.objects.create(kind=Event.Kind.REPAIR, message="x", created_at=created_at)
    Event.objects.create(
        kind=Event.Kind.BATCH_PAUSED, message="not a repair", created_at=ago(minutes=1)
    )

    assert fleet.lease_endings(NOW) == {
        "expired": {"hour": 1, "day": 2},
        "forced": {"hour": 2, "day": 3},
    }
    assert fleet.repairs(NOW) == {"hour": 1, "day": 2}


def test_leases_past_expiry_await_reclaim(worker, other_worker):
    make_batch(3, now=T0)
    # (Claimed in this order: a claim reclaims the expired leases it finds.)
    transitions.claim_next(other_worker, now=ago(seconds=30))
    transitions.claim_next(worker, now=ago(minutes=2))

    assert fleet.leases_past_expiry(NOW) == 1
    sweep(now=NOW)
    assert fleet.leases_past_expiry(NOW) == 0


def test_items_done_per_minute_over_all_batches(worker):
    make_batch(3, name="a", now=T0)
    make_batch(3, name="b", now=T0)
    for at in (ago(minutes=70), ago(minutes=59), ago(minutes=5), ago(minutes=5)):
        complete(worker, at)
    complete(worker, ago(minutes=5, seconds=-30))  # the same minute
    complete(worker, NOW)

    bars = fleet.done_per_minute(NOW)

    assert len(bars) == 60
    assert bars[0][0] == ago(minutes=59)
    assert bars[-1][0] == NOW
    assert {minute: n for minute, n in bars if n} == {
        ago(minutes=59): 1,
        ago(minutes=5): 3,
        NOW: 1,
    }


def test_flaky_workers_are_the_workers_pages(viewer_client):
    flaky, steady, fresh = (make_worker(n) for n in ("flaky", "steady", "fresh"))
    make_batch(40, now=T0)
    at = T0 + timedelta(hours=1)
    for worker, expired, completed in ((flaky, 3, 2), (steady, 3, 20), (fresh, 2, 0)):
        for _ in range(expired):
            at += timedelta(minutes=5)
            expire(worker, at)
        for _ in range(completed):
            complete(worker, at)

    found = fleet.flaky_workers()

    assert [(f.worker.name, f.expired, f.ended, f.share) for f in found] == [
        ("flaky", 3, 5, 60)
    ]
    page = viewer_client.get("/workers/")
    assert [row["worker"].name for row in page.context["rows"] if row["flaky"]] == [
        "flaky"
    ]
