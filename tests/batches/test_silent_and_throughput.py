"""Silent leases and the throughput figures (issue 27, items 4 and 5): the pure
rules, then the same figures read from a real database and on the pages."""

from __future__ import annotations

from datetime import timedelta

import pytest

from engine import fleet
from engine.progress import (
    RetryWait,
    apart_silent,
    is_silent,
    progress_for,
    run_text,
    segments,
    throughput_per_minute,
    window_text,
)
from jobs import transitions
from jobs.transitions.rules import heartbeat_interval, silent_after
from tests.support.factories import T0, claim, later, make_batch

COUNTS = {"queued": 2, "transcribing": 8, "done": 5, "failed": 1, "cancelled": 0}

# --- Pure rules ----------------------------------------------------------------------


def test_a_lease_is_silent_when_its_heartbeat_is_overdue_by_more_than_an_interval(
    settings,
):
    settings.RECALL_LEASE_SECONDS = 15
    assert heartbeat_interval() == 5
    assert silent_after() == timedelta(seconds=10)  # due at 5 s, overdue by 5 s
    assert not is_silent(T0, later(10), silent_after())
    assert is_silent(T0, later(10.001), silent_after())
    assert not is_silent(None, later(60), silent_after())


def test_silent_leases_are_counted_apart_from_transcribing():
    assert apart_silent(COUNTS, 2) == {**COUNTS, "transcribing": 6, "silent": 2}
    # Never more silent than transcribing, never negative.
    assert apart_silent(COUNTS, 9)["silent"] == 8
    assert apart_silent(COUNTS, -1)["silent"] == 0
    assert segments(COUNTS, 16, 2) == [
        ("done", 5, 31.2),
        ("failed", 1, 6.2),
        ("transcribing", 6, 37.5),
        ("silent", 2, 12.5),
        ("queued", 2, 12.5),
        ("cancelled", 0, 0.0),
    ]
    # Listed only when there are some.
    assert [s for s, _, _ in segments(COUNTS, 16)] == [
        "done", "failed", "transcribing", "queued", "cancelled"
    ]  # fmt: skip


def test_one_throughput_figure_and_its_window_in_words():
    assert throughput_per_minute(249, 600) == 24.9
    assert throughput_per_minute(0, 600) == 0.0
    assert throughput_per_minute(5, 0) == 0.0
    assert window_text(600) == "last 10 min"
    assert window_text(45) == "last 45 s"
    assert window_text(3630) == "last hour"
    assert run_text(2520) == "average over its 42 min run"


# --- From the database -----------------------------------------------------------------


@pytest.mark.django_db
def test_progress_counts_silent_leases_at_the_given_time(worker, settings):
    settings.RECALL_LEASE_SECONDS = 15  # a heartbeat every 5 s, silent after 10 s
    batch = make_batch(4)
    quiet, busy = claim(worker, now=T0), claim(worker, now=T0)
    transitions.heartbeat(busy, busy.lease_token, worker=worker, now=later(9))

    assert progress_for(batch, now=later(10)).silent == 0
    progress = progress_for(batch, now=later(11))

    assert progress.silent == 1
    assert progress.counts["transcribing"] == 2  # the items' state is unchanged
    assert progress.as_json()["silent"] == 1
    assert progress.as_json()["in_flight"] == 2
    assert [(s, n) for s, n, _ in progress.segments if n] == [
        ("transcribing", 1),
        ("silent", 1),
        ("queued", 2),
    ]
    assert fleet.silent_leases(later(11)) == 1
    # A heartbeat brings it back.
    transitions.heartbeat(quiet, quiet.lease_token, worker=worker, now=later(12))
    assert progress_for(batch, now=later(12)).silent == 0


@pytest.mark.django_db
def test_a_finished_batch_shows_its_run_average_fixed_and_no_eta(worker):
    batch = make_batch(4, now=T0)
    for at in (later(60), later(200), later(300), later(420)):
        job = claim(worker, now=at)
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=at
        )

    batch.refresh_from_db()  # finished_at, as the pages read it
    shown = [progress_for(batch, now=later(s)) for s in (421, 425, 3600)]

    # 4 items in the 7 minutes from creation to the last finish.
    assert {(p.state, p.throughput_per_minute) for p in shown} == {("finished", 0.6)}
    assert {p.throughput_window for p in shown} == {"average over its 7 min run"}
    assert {(p.eta_seconds, p.eta_text) for p in shown} == {(0, "—")}


@pytest.mark.django_db
def test_a_running_batch_names_its_window(worker):
    batch = make_batch(10, now=T0)
    # Seen by its claim's request (issue 26: else the batch waits for a worker).
    transitions.touch_worker(worker, now=later(100))
    for _ in range(3):
        job = claim(worker, now=later(100))
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=later(100)
        )

    young = progress_for(batch, now=later(120))
    old = progress_for(batch, now=later(650))

    assert (young.throughput_per_minute, young.throughput_window) == (1.5, "last 2 min")
    assert (old.throughput_per_minute, old.throughput_window) == (0.3, "last 10 min")
    assert young.eta_text != "—"


@pytest.mark.django_db
def test_the_overview_and_the_batch_give_the_same_throughput(worker):
    batch = make_batch(10, now=T0)
    idle = make_batch(3, name="idle", now=T0 + timedelta(minutes=1))
    transitions.pause_batch(idle, now=T0 + timedelta(minutes=1))
    for _ in range(6):
        job = claim(worker, now=later(200))
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": "t"}, now=later(200)
        )

    # Both windows (the batch's last 10 min, the overview's last hour) are
    # capped at the batches' age: while it is shorter, the figures agree.
    for seconds in (240, 500):
        progress = progress_for(batch, now=later(seconds))
        per_minute, window = fleet.throughput(later(seconds))
        assert per_minute == progress.throughput_per_minute
        assert window_text(window) == progress.throughput_window


# --- Waiting out a retry backoff (item 8) -------------------------------------------


@pytest.mark.django_db
def test_a_batch_whose_queued_items_all_back_off_says_how_long(worker, settings):
    settings.RECALL_RETRY_BACKOFF_SECONDS = 30
    batch = make_batch(3, now=T0)
    first = claim(worker, now=T0)
    second = claim(worker, now=T0)
    transitions.fail(first, first.lease_token, worker=worker, error="e", now=later(10))
    transitions.fail(
        second, second.lease_token, worker=worker, error="e", now=later(14)
    )

    # The third item can still be claimed: nothing to say.
    assert progress_for(batch, now=later(15), retry=True).retry is None
    third = claim(worker, now=later(15))
    transitions.complete(
        third, third.lease_token, worker=worker, result={"text": "t"}, now=later(16)
    )

    waiting = progress_for(batch, now=later(18), retry=True)
    assert waiting.retry == RetryWait(waiting=2, in_seconds=22)  # due at 40 s
    assert waiting.as_json()["retry"] == {"waiting": 2, "in_seconds": 22}
    # Read only for the JSON, and gone once one may be claimed.
    assert progress_for(batch, now=later(18)).retry is None
    assert progress_for(batch, now=later(40), retry=True).retry is None
    # A paused batch waits for its operator, not for time.
    transitions.pause_batch(batch, now=later(20))
    batch.refresh_from_db()
    assert progress_for(batch, now=later(21), retry=True).retry is None
