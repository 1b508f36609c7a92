"""Batches waiting for a worker (issue 26): open work that no worker online
offers the labels for. The rule (pure), then progress and the fleet figure
read from a real database, with time passed in."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from engine import fleet
from engine.manifests import create_batch
from engine.progress import progress_for, progress_for_many, waiting_text
from engine.waiting import Offers, offered_labels, seen_recently, unoffered
from jobs import transitions
from jobs.models import Worker
from tests.support.factories import T0, claim, later, make_batch, make_worker

A100 = {"gpu": "a100"}
LARGE = {"model": "large-v3"}
BOTH = {"gpu": "a100", "model": "large-v3"}

# --- The rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requires", "offered", "expected"),
    [
        ({}, [{}], None),  # any worker online serves a batch requiring nothing
        ({}, [], {}),  # ... and with none online it waits, naming no label
        (A100, [BOTH], None),  # extra labels never hurt
        (BOTH, [A100, {"gpu": "a100", "model": "large-v3", "x": "y"}], None),
        (BOTH, [], BOTH),
        (BOTH, [A100], LARGE),  # the label nobody offers
        (BOTH, [{"gpu": "t4"}, {"gpu": "a100", "model": "tiny"}], LARGE),
        # Each pair is offered by someone, but no worker offers both: all.
        (BOTH, [A100, LARGE], BOTH),
        (A100, [{"gpu": "A100"}], A100),  # values match exactly
    ],
)
def test_unoffered(requires, offered, expected):
    assert unoffered(requires, offered) == expected


def test_waiting_text_names_the_labels_or_the_window():
    window = timedelta(seconds=120)
    assert waiting_text(LARGE, window) == "Waiting for a worker with model=large-v3"
    assert (
        waiting_text(BOTH, window)
        == "Waiting for a worker with gpu=a100, model=large-v3"
    )
    assert waiting_text({}, window) == (
        "Waiting for a worker: none was seen in the last 2 min"
    )


# --- From the database ------------------------------------------------------------


def batch_requiring(requires: dict, n: int = 3, *, name: str = "routed"):
    lines = [f"file:///audio/{name}-{i}.wav\n" for i in range(n)]
    return create_batch(name, lambda: iter(lines), now=T0, requires=requires)


def online(name: str, labels: dict, *, at=T0, active: bool = True) -> Worker:
    """A worker that declared ``labels`` and was seen at ``at`` (a claim
    records both; the claim path is not what this tests)."""
    worker = make_worker(name)
    Worker.objects.filter(pk=worker.pk).update(
        labels=labels, last_seen=at, is_active=active
    )
    return worker


@pytest.mark.django_db
def test_offered_labels_are_those_of_active_workers_seen_recently(settings):
    settings.RECALL_LEASE_SECONDS = 60
    online("a", A100)
    online("b", A100)  # the same set: read once
    online("c", LARGE, at=T0 - timedelta(seconds=120))  # at the window's edge
    online("d", {"model": "tiny"}, at=T0 - timedelta(seconds=121))  # too long ago
    online("e", {"gpu": "h100"}, active=False)  # disabled
    make_worker("never")  # never seen

    assert seen_recently() == timedelta(seconds=120)
    assert sorted(offered_labels(T0), key=str) == [A100, LARGE]


@pytest.mark.django_db
def test_a_batch_no_worker_online_can_take_waits_without_an_eta():
    routed = batch_requiring(BOTH, name="routed")
    anyone = make_batch(3, name="anyone")
    online("a100-small", {"gpu": "a100", "model": "small"})

    progress = progress_for_many([routed, anyone], now=later(30))

    waiting = progress[routed.pk]
    assert (waiting.state, waiting.waiting_for_worker) == ("running", True)
    assert waiting.unoffered == LARGE
    assert waiting.waiting_text == "Waiting for a worker with model=large-v3"
    assert (waiting.eta_seconds, waiting.eta_text) == (None, "—")
    assert waiting.eta_basis == "Unknown: waiting for a worker with model=large-v3."
    json = waiting.as_json()
    assert (json["requires"], json["waiting_for_worker"], json["eta_seconds"]) == (
        BOTH,
        True,
        None,
    )
    served = progress[anyone.pk]
    assert (served.waiting_for_worker, served.unoffered) == (False, None)
    assert served.as_json()["requires"] == {}
    assert served.as_json()["waiting_for_worker"] is False


@pytest.mark.django_db
def test_a_matching_worker_coming_online_ends_the_wait(settings):
    settings.RECALL_LEASE_SECONDS = 60
    batch = batch_requiring(A100)
    worker = online("a100", {"gpu": "a100", "zone": "eu"}, at=T0)

    assert progress_for(batch, now=later(120)).waiting_for_worker is False
    # Silent for longer than the workers page's "online" window: waiting again.
    assert progress_for(batch, now=later(121)).waiting_for_worker is True
    transitions.touch_worker(worker, now=later(200))
    assert progress_for(batch, now=later(200)).waiting_for_worker is False
    transitions.set_worker_active(worker, False)
    assert progress_for(batch, now=later(200)).waiting_for_worker is True


@pytest.mark.django_db
def test_a_batch_requiring_nothing_waits_only_when_no_worker_is_online():
    batch = make_batch(3)

    alone = progress_for(batch, now=T0)
    assert (alone.waiting_for_worker, alone.unoffered) == (True, {})
    assert alone.eta_basis == (
        "Unknown: waiting for a worker: none was seen in the last 2 min."
    )
    online("anything", {"model": "tiny"})
    assert progress_for(batch, now=T0).waiting_for_worker is False


@pytest.mark.django_db
def test_only_open_batches_with_queued_items_wait(worker):
    paused = batch_requiring(LARGE, name="paused")
    transitions.pause_batch(paused, now=T0)
    cancelled = batch_requiring(LARGE, name="cancelled")
    transitions.cancel_batch(cancelled, now=T0)
    # All of its items in flight (claimed before the requirement was set): it
    # has no claimable work left to wait with.
    in_flight = make_batch(1, name="in flight", priority=5)
    claim(worker, now=T0)
    transitions.set_requires(in_flight, LARGE, now=T0)
    finished = make_batch(1, name="finished", priority=4)
    job = claim(worker, now=T0)
    transitions.complete(job, job.lease_token, worker=worker, result={}, now=T0)

    shown = progress_for_many([paused, cancelled, in_flight, finished], now=T0)

    assert {p.batch.name: p.state for p in shown.values()} == {
        "paused": "paused",
        "cancelled": "cancelled",
        "in flight": "running",
        "finished": "finished",
    }
    assert not any(p.waiting_for_worker for p in shown.values())
    assert shown[paused.pk].eta_basis == "Unknown while the batch is paused."
    assert fleet.waiting_for_worker(T0) == 0


@pytest.mark.django_db
def test_the_fleet_counts_the_waiting_batches():
    for i in range(3):
        batch_requiring(LARGE, name=f"large-{i}")
    batch_requiring(A100, name="a100")
    make_batch(2, name="anyone")
    assert fleet.waiting_for_worker(T0) == 5  # nobody online

    online("a100", A100)
    assert fleet.waiting_for_worker(T0) == 3  # a100 and anyone are served
    online("large", LARGE)
    assert fleet.waiting_for_worker(T0) == 0


@pytest.mark.django_db
def test_it_costs_one_query_however_many_batches_and_workers():
    """The labels of the workers online are read once per request, and each
    distinct requirement set judged once: never per batch, worker or item."""
    batches = [batch_requiring(LARGE, name=f"b-{i}") for i in range(2)]
    online("w-0", A100)

    def queries(batches) -> int:
        with CaptureQueriesContext(connection) as captured:
            progress_for_many(batches, now=T0)
        return len(captured)

    few = queries(batches)
    batches += [batch_requiring(A100, name=f"more-{i}") for i in range(10)]
    batches += [make_batch(2, name=f"any-{i}") for i in range(5)]
    for i in range(10):
        online(f"w-{i + 1}", {"gpu": "a100", "n": str(i)})
    assert queries(batches) == few

    with CaptureQueriesContext(connection) as captured:
        assert fleet.waiting_for_worker(T0) == 2
    assert len(captured) == 2


@pytest.mark.django_db
def test_one_reading_of_the_workers_serves_a_whole_request():
    batch = batch_requiring(A100)
    offers = Offers(T0)
    progress_for(batch, now=T0, offers=offers)
    online("a100", A100)  # after the reading: this request does not see it

    with CaptureQueriesContext(connection) as captured:
        assert progress_for(batch, now=T0, offers=offers).waiting_for_worker
        assert fleet.waiting_for_worker(T0, offers) == 1
    assert not any("jobs_worker" in q["sql"] for q in captured.captured_queries)
