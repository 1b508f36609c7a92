"""Progress maths (pure functions) and progress read from a real database."""

import math
from datetime import timedelta

import pytest

from batches.models import Batch
from engine.progress import (
    BatchState,
    bar_geometry,
    batch_state,
    chart_bars,
    eta_seconds,
    format_duration,
    is_stalled,
    percent,
    progress_for,
    rate_per_second,
    segments,
    window_seconds,
)
from jobs import transitions
from jobs.models import Job
from tests.support.factories import T0, claim, later, make_batch

# --- Pure functions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "rate", "expected"),
    [
        (100, 2.0, 50),
        (101, 2.0, 51),  # rounds up: never promise early
        (0, 2.0, 0),
        (0, None, 0),
        (-5, 1.0, 0),
        (10, None, None),
        (10, 0.0, None),
        (10, -1.0, None),
        (10, math.inf, None),
        (10, math.nan, None),
        (10**12, 1e-9, 10**21),
    ],
)
def test_eta_seconds(remaining, rate, expected):
    assert eta_seconds(remaining, rate) == expected


@pytest.mark.parametrize(
    ("finished", "seconds", "expected"),
    [(30, 60, 0.5), (0, 60, None), (5, 0, None), (5, -3, None)],
)
def test_rate_per_second(finished, seconds, expected):
    assert rate_per_second(finished, seconds) == expected


def test_the_rate_window_is_no_longer_than_the_batch_has_existed():
    assert window_seconds(later(600), T0, T0 - timedelta(days=1)) == 600
    assert window_seconds(later(600), T0, later(540)) == 60


@pytest.mark.parametrize(
    ("kwargs", "state"),
    [
        (
            {
                "cancelled": True,
                "paused": True,
                "remaining": 5,
                "in_flight": 1,
                "stalled": True,
            },
            "cancelled",
        ),
        (
            {
                "cancelled": False,
                "paused": True,
                "remaining": 0,
                "in_flight": 0,
                "stalled": False,
            },
            "finished",
        ),
        (
            {
                "cancelled": False,
                "paused": True,
                "remaining": 5,
                "in_flight": 2,
                "stalled": True,
            },
            "paused",
        ),
        (
            {
                "cancelled": False,
                "paused": False,
                "remaining": 5,
                "in_flight": 2,
                "stalled": True,
            },
            "stalled",
        ),
        (
            {
                "cancelled": False,
                "paused": False,
                "remaining": 5,
                "in_flight": 0,
                "stalled": True,
            },
            "running",
        ),
        (
            {
                "cancelled": False,
                "paused": False,
                "remaining": 5,
                "in_flight": 2,
                "stalled": False,
            },
            "running",
        ),
    ],
)
def test_batch_state(kwargs, state):
    assert batch_state(**kwargs) == state


def test_stalled_only_with_items_in_flight_and_no_recent_activity():
    five = timedelta(minutes=5)
    assert is_stalled(in_flight=1, last_activity=T0, now=later(301), after=five)
    assert not is_stalled(in_flight=1, last_activity=T0, now=later(300), after=five)
    assert not is_stalled(in_flight=0, last_activity=T0, now=later(9999), after=five)
    assert is_stalled(in_flight=2, last_activity=None, now=T0, after=five)


def test_percent():
    assert (percent(1, 3), percent(0, 0), percent(5, 5)) == (33.3, 0.0, 100.0)


def test_the_bar_is_drawn_whole_though_its_percentages_are_rounded():
    # 14/44 + 2/44 + 3/44 + 25/44 rounds to 99.9%: the last segment ends the bar.
    counts = {"done": 14, "failed": 2, "transcribing": 3, "queued": 25, "cancelled": 0}
    bar = bar_geometry(segments(counts, 44))

    assert [s["status"] for s in bar] == ["done", "failed", "transcribing", "queued"]
    assert [s["x"] for s in bar] == pytest.approx([0.0, 31.8, 36.3, 43.1])
    assert [s["width"] for s in bar] == pytest.approx([31.8, 4.5, 6.8, 56.9])
    assert bar[-1]["x"] + bar[-1]["width"] == 100.0


def test_chart_bars_fill_missing_minutes_with_zero():
    bars = chart_bars({T0: 4, T0 + timedelta(minutes=2): 1}, later(150), 4)

    assert bars == [
        (T0 - timedelta(minutes=1), 0),
        (T0, 4),
        (T0 + timedelta(minutes=1), 0),
        (T0 + timedelta(minutes=2), 1),
    ]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "unknown"), (0, "0 s"), (59.6, "1 min"), (61, "1 min"), (3599, "59 min"),
     (3600, "1 h 00 min"), (7500, "2 h 05 min"), (200_000, "2 d 7 h")],
)  # fmt: skip
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# --- From the database -------------------------------------------------------------------


def _finish(worker, n, *, at, fail=False):
    # A worker's API calls record that it was seen (routing, issue 26: a batch
    # no worker online can take waits, without an ETA); the transitions alone
    # do not, so the helper does.
    transitions.touch_worker(worker, now=at)
    for _ in range(n):
        job = claim(worker, now=at)
        if fail:
            transitions.fail(
                job, job.lease_token, worker=worker, error="x", retryable=False, now=at
            )
        else:
            transitions.complete(
                job, job.lease_token, worker=worker, result={"text": "t"}, now=at
            )


@pytest.mark.django_db
def test_progress_counts_rate_and_eta_by_items(worker):
    batch = make_batch(100)
    _finish(worker, 20, at=later(60))  # minute 12:01
    _finish(worker, 10, at=later(330), fail=True)  # minute 12:05
    transitions.touch_worker(worker, now=later(590))  # its claim's request
    claim(worker, now=later(590))

    progress = progress_for(batch, now=later(600))

    assert progress.counts == {
        "queued": 69,
        "transcribing": 1,
        "done": 20,
        "failed": 10,
        "cancelled": 0,
    }
    assert (progress.state, progress.total, progress.percent_done) == (
        "running",
        100,
        20.0,
    )
    # The batch is 10 minutes old: 20 done in 600 s is 2 per minute; ETA counts
    # everything that finished (30 in 600 s) against the 70 items left.
    assert progress.throughput_per_minute == 2.0
    assert progress.eta_seconds == 1400
    assert (
        progress.eta_basis
        == "70 items left, at 3.0 items per minute finished (done or failed) over the last 10 min."
    )
    assert progress.as_json() == {
        "batch": batch.pk,
        "state": "running",
        "total": 100,
        "counts": {
            "queued": 69,
            "transcribing": 1,
            "done": 20,
            "failed": 10,
            "cancelled": 0,
        },
        "percent_done": 20.0,
        "throughput_per_minute": 2.0,
        "eta_seconds": 1400,
        # Added by fair share (issue 12).
        "weight": 1,
        "max_in_flight": None,
        "in_flight": 1,
        # Added by silent leases and retry waits (issue 27).
        "silent": 0,
        "retry": None,
        # Added by routing (issue 26).
        "requires": {},
        "waiting_for_worker": False,
    }


@pytest.mark.django_db
def test_eta_is_weighted_by_duration_when_every_item_has_one(worker):
    batch = make_batch(4, durations=[10, 10, 100, 100])
    _finish(worker, 2, at=later(60))  # 20 s of audio in the first minute

    progress = progress_for(batch, now=later(60))

    # 200 s of audio left at 20 s of audio per 60 s of wall time.
    assert progress.eta_seconds == 600
    assert progress.eta_basis.startswith(
        "3 min of audio left in 2 items, at 0.3 s of audio"
    )


@pytest.mark.django_db
def test_eta_only_counts_the_recent_window(worker):
    batch = make_batch(10)
    _finish(worker, 5, at=later(30))

    assert progress_for(batch, now=later(60)).eta_seconds == 60
    transitions.touch_worker(worker, now=later(60 * 12))  # still polling, idle
    stale = progress_for(batch, now=later(60 * 12))
    assert stale.eta_seconds is None
    assert stale.eta_basis == "Unknown: no item finished in the last 10 min."
    assert stale.throughput_per_minute == 0.0


@pytest.mark.django_db
def test_paused_batch_has_no_eta(worker):
    batch = make_batch(10)
    _finish(worker, 5, at=later(30))
    transitions.pause_batch(batch, now=later(40))

    progress = progress_for(batch, now=later(60))

    assert (progress.state, progress.eta_seconds) == ("paused", None)


@pytest.mark.django_db
def test_finished_batch(worker):
    batch = make_batch(2)
    _finish(worker, 2, at=later(5))

    progress = progress_for(batch, now=later(9))

    assert (progress.state, progress.eta_seconds, progress.is_final) == (
        "finished",
        0,
        True,
    )
    assert progress.percent_done == 100.0


@pytest.mark.django_db
def test_stalled_when_in_flight_work_goes_silent(worker, settings):
    settings.RECALL_STALLED_AFTER_SECONDS = 300
    batch = make_batch(3)
    claim(worker, now=T0)

    assert progress_for(batch, now=later(300)).state == BatchState.RUNNING
    assert progress_for(batch, now=later(301)).state == BatchState.STALLED
    job = Job.objects.get(status="leased")
    transitions.heartbeat(job, job.lease_token, worker=worker, now=later(400))
    assert progress_for(batch, now=later(401)).state == BatchState.RUNNING


@pytest.mark.django_db
def test_cancelled_batch(worker):
    batch = make_batch(3)
    transitions.cancel_batch(batch, now=T0)

    progress = progress_for(Batch.objects.get(pk=batch.pk), now=later(1))

    assert (progress.state, progress.eta_seconds) == ("cancelled", None)
    assert progress.counts["cancelled"] == 3


@pytest.mark.django_db
def test_the_chart_has_sixty_minutes_of_done_counts(worker):
    batch = make_batch(10)
    _finish(worker, 3, at=later(0))
    _finish(worker, 2, at=later(120))

    chart = progress_for(batch, now=later(180), chart=True).chart

    assert len(chart) == 60
    assert chart[-4:] == [
        (T0, 3),
        (T0 + timedelta(minutes=1), 0),
        (T0 + timedelta(minutes=2), 2),
        (T0 + timedelta(minutes=3), 0),  # the current, partial minute
    ]
    assert chart[0] == (T0 - timedelta(minutes=56), 0)
