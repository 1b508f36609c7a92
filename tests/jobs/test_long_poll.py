"""Long-poll claims in the view and the waker's probe (the server's side, the
holding of parked claims, is tested against real gunicorn in
``tests/test_long_poll_server.py``)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import transitions
from jobs.longpoll import claimable_jobs
from jobs.models import Job
from jobs.waiter import WAITER_KEY, Waiter

from ..factories import T0, claim, jobs_of, later, make_batch, make_worker

pytestmark = pytest.mark.django_db


def _error(response, detail: str) -> None:
    assert response.status_code == 400, response.content
    assert response.json() == {"error": "bad_request", "detail": detail}


# --- wait_seconds ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "given"),
    [
        (-1, "-1"),
        (-0.5, "-0.5"),
        (60.5, "60.5"),
        (61, "61"),
        (10**30, str(10**30)),
        ("5", "a string"),
        (True, "a boolean"),
        (False, "a boolean"),
        (None, "null"),
        ([5], "an array"),
        ({"s": 5}, "an object"),
    ],
)
def test_a_wait_out_of_range_or_ill_typed_is_400(api, value, given):
    make_batch(1)

    response = api.post("/api/v1/claim", {"wait_seconds": value})

    _error(
        response,
        f"Field 'wait_seconds' must be a number from 0 to 60, not {given}.",
    )
    assert Job.objects.get().status == "queued"  # nothing was claimed


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 25, 60, 60.0])
def test_a_wait_in_range_claims_as_before(api, value):
    batch = make_batch(1)

    response = api.post("/api/v1/claim", {"wait_seconds": value})

    assert response.status_code == 200
    assert response.json()["job"]["id"] == jobs_of(batch)[0].pk


def test_a_server_that_cannot_hold_a_claim_answers_204_at_once(api):
    """The test client, like runserver and the sync worker, offers no waiter."""
    started = time.monotonic()

    response = api.post("/api/v1/claim", {"wait_seconds": 60})

    assert (response.status_code, response.content) == (204, b"")
    assert time.monotonic() - started < 5


def _claim_with(api, body: dict, waiter: Waiter):
    return api.client.post(
        "/api/v1/claim",
        data=body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {api.worker.token}",
        **{WAITER_KEY: waiter},
    )


def test_an_empty_queue_parks_the_claim_with_its_body(api):
    waiter = Waiter(started=time.monotonic())

    response = _claim_with(api, {"wait_seconds": 30, "x": 1}, waiter)

    assert (response.status_code, response.content) == (204, b"")
    assert waiter.parked is True
    assert waiter.body == b'{"wait_seconds": 30, "x": 1}'
    assert waiter.deadline == waiter.started + 30


def test_a_claim_that_finds_work_or_does_not_wait_is_not_parked(api):
    waiter = Waiter()
    assert _claim_with(api, {}, waiter).status_code == 204
    assert _claim_with(api, {"wait_seconds": 0}, waiter).status_code == 204
    assert waiter.parked is False

    make_batch(1)
    assert _claim_with(api, {"wait_seconds": 30}, waiter).status_code == 200
    assert waiter.parked is False


def test_a_wait_counts_from_the_first_arrival_and_ends():
    waiter = Waiter(started=time.monotonic() - 10)
    assert waiter.park(30, b"{}") is True
    first_deadline = waiter.deadline

    # Tried again later: the deadline does not move.
    assert waiter.park(30, b"{}") is True
    assert waiter.deadline == first_deadline

    over = Waiter(started=time.monotonic() - 31)
    assert over.park(30, b"{}") is False
    assert over.parked is False
    assert Waiter().park(0, b"{}") is False


def test_the_view_answers_a_claim_whose_wait_is_over(api):
    waiter = Waiter(started=time.monotonic() - 5)

    response = _claim_with(api, {"wait_seconds": 5}, waiter)

    assert response.status_code == 204
    assert waiter.parked is False


# --- The probe -----------------------------------------------------------------------


def test_the_probe_counts_claimable_jobs_up_to_the_limit():
    assert claimable_jobs(10, now=T0) == 0
    make_batch(3, name="a")
    make_batch(2, name="b")

    assert claimable_jobs(10, now=T0) == 5
    assert claimable_jobs(4, now=T0) == 4
    assert claimable_jobs(1, now=T0) == 1
    assert claimable_jobs(0, now=T0) == 0


def test_the_probe_skips_paused_batches_and_full_caps():
    paused = make_batch(3, name="paused")
    transitions.pause_batch(paused, now=T0)
    capped = make_batch(3, name="capped")
    transitions.set_share(capped, priority=0, weight=1, max_in_flight=2, now=T0)
    worker = make_worker()

    assert claimable_jobs(10, now=T0) == 2  # the cap's room, not its 3 jobs
    claim(worker)
    assert claimable_jobs(10, now=T0) == 1
    claim(worker)
    assert claimable_jobs(10, now=T0) == 0


def test_the_probe_sees_a_retry_when_it_becomes_due():
    make_batch(1)
    worker = make_worker()
    job = claim(worker)
    transitions.fail(job, job.lease_token, worker=worker, error="oom", now=T0)
    due = Job.objects.get(pk=job.pk).available_at

    assert due > T0
    assert claimable_jobs(10, now=T0) == 0
    assert claimable_jobs(10, now=due) == 1


def test_the_probe_sees_a_released_lease_and_an_expired_one():
    make_batch(2)
    worker = make_worker()
    first, second = claim(worker), claim(worker)
    assert claimable_jobs(10, now=T0) == 0

    transitions.release(first, first.lease_token, worker=worker, now=later(1))
    assert claimable_jobs(10, now=later(1)) == 1

    # The second lease expires: a claim reclaims it first, so it counts.
    expires = Job.objects.get(pk=second.pk).lease_expires_at
    assert claimable_jobs(10, now=expires) == 1
    assert claimable_jobs(10, now=later(3600)) == 2


def test_the_probe_reads_the_database_clock_when_not_told():
    """Without ``now`` each statement reads the database's clock: work due in
    the past counts, a retry due in an hour does not."""
    batch = make_batch(2, now=timezone.now() - timedelta(seconds=5))
    assert claimable_jobs(10) == 2
    Job.objects.filter(batch=batch).update(
        available_at=timezone.now() + timedelta(hours=1)
    )
    assert claimable_jobs(10) == 0
