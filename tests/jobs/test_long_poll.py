"""Long-poll claims in the view and the waker's probe (the server's side, the
holding of parked claims, is tested against real gunicorn in
``tests/system/test_long_poll_server.py``)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from api.waiter import KEEP_WAITING, WAITER_KEY, ClaimRequest, Waiter
from api.worker_views import claims_for_waiting
from engine.longpoll import claimable_jobs
from jobs import transitions
from jobs.models import Job, JobStatus
from tests.support.factories import T0, claim, jobs_of, later, make_batch, make_worker

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


def test_an_empty_queue_parks_the_claim_with_its_parameters_not_its_body(api):
    waiter = Waiter(started=time.monotonic())

    response = _claim_with(api, {"wait_seconds": 30, "x": "y" * 100_000}, waiter)

    assert (response.status_code, response.content) == (204, b"")
    assert waiter.parked is True
    assert waiter.claim == ClaimRequest(wait_seconds=30.0)
    assert waiter.claim.body() == b'{"wait_seconds": 30.0}'
    assert not hasattr(waiter, "body")
    assert waiter.deadline == waiter.started + 30


def test_a_claim_that_finds_work_or_does_not_wait_is_not_parked(api):
    waiter = Waiter()
    assert _claim_with(api, {}, waiter).status_code == 204
    assert _claim_with(api, {"wait_seconds": 0}, waiter).status_code == 204
    assert waiter.parked is False

    make_batch(1)
    assert _claim_with(api, {"wait_seconds": 30}, waiter).status_code == 200
    assert waiter.parked is False


def test_a_claim_that_may_wait_on_a_quiet_server_is_parked_without_trying(api):
    """The server's probe found nothing a moment ago: a claim that may wait
    parks at once (its next probe wakes it if work has come since); one that
    may not wait, or a server not quiet, claims as always."""
    batch = make_batch(1)

    quiet = Waiter(quiet=True)
    response = _claim_with(api, {"wait_seconds": 30}, quiet)
    assert (response.status_code, quiet.parked) == (204, True)
    assert Job.objects.get().status == JobStatus.QUEUED

    response = _claim_with(api, {}, Waiter(quiet=True))
    assert response.status_code == 200
    assert response.json()["job"]["id"] == jobs_of(batch)[0].pk


def test_a_wait_counts_from_the_first_arrival_and_ends():
    waiter = Waiter(started=time.monotonic() - 10)
    assert waiter.park(30, ClaimRequest(30)) is True
    first_deadline = waiter.deadline

    # Tried again later: the deadline does not move.
    assert waiter.park(30, ClaimRequest(30)) is True
    assert waiter.deadline == first_deadline

    over = Waiter(started=time.monotonic() - 31)
    assert over.park(30, ClaimRequest(30)) is False
    assert over.parked is False
    assert Waiter().park(0, ClaimRequest(0)) is False


def test_the_view_answers_a_claim_whose_wait_is_over(api):
    waiter = Waiter(started=time.monotonic() - 5)

    response = _claim_with(api, {"wait_seconds": 5}, waiter)

    assert response.status_code == 204
    assert waiter.parked is False


# --- Claims for woken parked claims -------------------------------------------------


def _bearer(worker) -> str:
    return f"Bearer {worker.token}"


def _waiting(*authorizations: str, labels=None, max_jobs=None):
    """Parked claims as the server hands them over: (header, kept request)."""
    kept = ClaimRequest(wait_seconds=30, labels=labels or {}, max_jobs=max_jobs)
    return [(authorization, kept) for authorization in authorizations]


def test_woken_claims_get_one_job_each_until_none_is_left(api):
    """What the server sends a woken claim is the claim view's answer; one
    that finds nothing waits on (KEEP_WAITING), and so, untried, does every
    later one with the same labels."""
    batch = make_batch(2)
    first, second, third = (make_worker(f"w{i}") for i in range(3))

    fourth = make_worker("w3")
    bodies = list(
        claims_for_waiting(_waiting(*(_bearer(w) for w in (first, second, third))))
    )
    more = list(claims_for_waiting(_waiting(_bearer(fourth), _bearer(first))))

    assert bodies[2:] == [KEEP_WAITING]
    assert more == [KEEP_WAITING, KEEP_WAITING]
    answers = [json.loads(body) for body in bodies[:2]]
    for worker, answer in zip((first, second), answers, strict=True):
        job = Job.objects.get(pk=answer["job"]["id"])
        assert (job.status, job.leased_by_id) == (JobStatus.LEASED, worker.pk)
        assert answer["job"]["lease_token"] == job.lease_token
    assert sorted(a["job"]["id"] for a in answers) == [j.pk for j in jobs_of(batch)]
    # The same shape as a claim the view answers at once.
    make_batch(1, name="more")
    direct = api.claim().json()
    assert answers[0]["job"].keys() == direct["job"].keys()
    assert answers[0]["job"]["item"].keys() == direct["job"]["item"].keys()
    assert answers[0]["job"]["batch"] == {"id": batch.pk, "name": batch.name}


@pytest.mark.parametrize("backend", ["auto", "orm"])
def test_workers_read_together_are_each_tokens_holder(backend):
    """One read for many tokens (the statement backend's one statement, the
    ORM backend's loop): each token's worker with its live leases, or None."""
    make_batch(2)
    busy, idle, off = (make_worker(n) for n in ("busy", "idle", "off"))
    claim(busy, transitions.now())
    transitions.set_worker_active(off, False)
    tokens = [idle.token, "short", busy.token, off.token, busy.token[:-1] + "x"]

    with override_settings(RECALL_TRANSITIONS_BACKEND=backend):
        found = transitions.authenticate_workers(tokens)

    assert [(w.pk, w.live_leases, w.is_active) if w else None for w, _ in found] == [
        (idle.pk, 0, True),
        None,
        (busy.pk, 1, True),
        (off.pk, 0, False),
        None,
    ]
    assert all((now is None) == (worker is None) for worker, now in found)
    assert transitions.authenticate_workers([]) == []


def test_a_woken_claim_of_a_refused_worker_goes_back_to_the_view(settings):
    """Unknown token, a malformed header, a disabled worker, one at its lease
    cap: None (the view answers 401, 403 or 429), and the next claims go on."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 1
    batch = make_batch(3)
    disabled, capped, ready = (make_worker(n) for n in ("off", "full", "ready"))
    transitions.set_worker_active(disabled, False)
    assert claim(capped, transitions.now()) is not None

    answers = list(
        claims_for_waiting(
            _waiting(
                "Bearer not-a-token",
                "Basic dXNlcjpwYXNz",
                _bearer(disabled),
                _bearer(capped),
                _bearer(ready),
            )
        )
    )

    assert answers[:4] == [None, None, None, None]
    job = Job.objects.get(pk=json.loads(answers[4])["job"]["id"])
    assert job.leased_by_id == ready.pk
    assert Job.objects.filter(batch=batch, status=JobStatus.LEASED).count() == 2


@pytest.mark.parametrize("backend", ["auto", "orm"])
def test_one_wave_of_woken_claims_never_leases_a_worker_past_its_cap(settings, backend):
    """The wave reads its workers (and their leases) once; the claims count
    again, each its own: ten waiting claims of one worker with a cap of 2 and
    ten jobs free get two jobs, and the other eight go back to the view (its
    429), while another worker's claim behind them goes on."""
    settings.RECALL_MAX_LEASES_PER_WORKER = 2
    settings.RECALL_TRANSITIONS_BACKEND = backend
    make_batch(10)
    greedy, other = make_worker("greedy"), make_worker("other")

    answers = list(
        claims_for_waiting(_waiting(*[_bearer(greedy)] * 10, _bearer(other)))
    )

    assert [answer is None for answer in answers] == [False] * 2 + [True] * 8 + [False]
    assert Job.objects.filter(leased_by=greedy).count() == 2
    assert Job.objects.filter(leased_by=other).count() == 1


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
