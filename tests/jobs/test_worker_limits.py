"""Per-worker limits: the request rate (429 ``rate_limited``) and the claims a
worker may have waiting, in the shared table of ``api/worker_limits.py`` and
through the worker API. (Against the real server, across its processes:
``tests/adversarial/test_worker_limits.py``.)"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from django.test import Client

from api import worker_limits
from api.waiter import WAITER_KEY, Waiter
from api.worker_limits import MICRO, Table
from jobs.models import Job, JobStatus
from tests.support.factories import WorkerClient, jobs_of, make_batch, make_worker

SECOND = MICRO  # the table's clock counts microseconds

# --- The token bucket ----------------------------------------------------------------


def test_a_burst_passes_then_requests_wait_for_the_rate():
    table = Table()
    t0 = 1_000 * SECOND

    assert [table.take(7, 2, 3, t0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert table.take(7, 2, 3, t0) == pytest.approx(0.5)
    assert table.take(7, 2, 3, t0 + SECOND // 4) == pytest.approx(0.25)
    # Half a second on, one request's worth has come back, and only one.
    assert table.take(7, 2, 3, t0 + SECOND // 2) == 0.0
    assert table.take(7, 2, 3, t0 + SECOND // 2) == pytest.approx(0.5)
    # Another worker has a bucket of its own; an idle one fills to the burst.
    assert table.take(8, 2, 3, t0) == 0.0
    assert [table.take(7, 2, 3, t0 + 10 * SECOND) for _ in range(4)] == [
        0.0,
        0.0,
        0.0,
        pytest.approx(0.5),
    ]


def test_workers_whose_ids_share_slots_keep_their_own_buckets():
    table = Table()
    t0 = 1_000 * SECOND
    crowd = [7 + n * worker_limits.RATE_SLOTS for n in range(worker_limits.WINDOW)]

    for worker in crowd:
        assert table.take(worker, 1, 1, t0) == 0.0
    for worker in crowd:
        assert table.take(worker, 1, 1, t0) == pytest.approx(1.0)
    # A window full of live buckets lets a newcomer through rather than
    # refusing it for others' requests; once theirs fill up, it gets one.
    newcomer = 7 + worker_limits.WINDOW * worker_limits.RATE_SLOTS
    assert table.take(newcomer, 1, 1, t0) == 0.0
    assert table.take(newcomer, 1, 1, t0) == 0.0
    assert table.take(newcomer, 1, 1, t0 + 2 * SECOND) == 0.0
    assert table.take(newcomer, 1, 1, t0 + 2 * SECOND) == pytest.approx(1.0)


def test_no_rate_is_no_limit():
    assert all(
        worker_limits.take_request(7, rate=0, burst=1) == 0.0 for _ in range(1000)
    )


# --- Waiting claims ------------------------------------------------------------------


def test_a_worker_holds_at_most_its_limit_of_waiting_claims():
    table = Table()

    assert [table.hold_waiting(7, 4) for _ in range(5)] == [True] * 4 + [False]
    assert table.hold_waiting(8, 4) is True  # another worker's own count
    assert (table.waiting(7), table.waiting(8)) == (4, 1)

    table.release_waiting(7)
    assert table.waiting(7) == 3
    assert table.hold_waiting(7, 4) is True
    assert table.hold_waiting(7, 4) is False
    for _ in range(4):
        table.release_waiting(7)
    assert table.waiting(7) == 0
    table.release_waiting(7)  # one release too many changes nothing
    assert table.waiting(7) == 0


def _hold_in_child(table: Table, tries: int, answers, exit_holding: bool) -> None:
    granted = sum(table.hold_waiting(7, 4) for _ in range(tries))
    answers.put((os.getpid(), granted))
    if exit_holding:
        answers.close()
        answers.join_thread()  # the answer is sent before the process dies
        os._exit(0)  # dies with its waiting claims counted, never released
    time.sleep(60)  # holds them until the test ends it


def _taking_child(table: Table, start: int, answers) -> None:
    answers.put(sum(table.take(7, 1, 10, start) == 0.0 for _ in range(10)))


def test_every_process_made_after_the_table_counts_in_it():
    """Processes forked from the one that made the table (gunicorn's master)
    share it: three processes trying four waiting claims each get four in all,
    and ten requests each at once pass as one burst of ten in all."""
    table = Table()
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    holders = [
        fork.Process(target=_hold_in_child, args=(table, 4, answers, False))
        for _ in range(3)
    ]
    for process in holders:
        process.start()
    try:
        granted = [answers.get(timeout=30) for _ in holders]
        assert sum(n for _, n in granted) == 4
        assert table.waiting(7) == 4
        assert table.hold_waiting(7, 4) is False

        takers = [
            fork.Process(target=_taking_child, args=(table, 5 * SECOND, answers))
            for _ in range(3)
        ]
        for process in takers:
            process.start()
        assert sum(answers.get(timeout=30) for _ in takers) == 10
        for process in takers:
            process.join(timeout=30)
    finally:
        for process in holders:
            process.kill()
            process.join(timeout=30)


def test_the_claims_of_a_process_that_died_are_not_counted_forever():
    """A process killed while its claims waited releases nothing: a worker at
    its limit has the dead process's entries dropped before it is refused,
    and gunicorn's master forgets a reaped process's at once."""
    table = Table()
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    child = fork.Process(target=_hold_in_child, args=(table, 4, answers, True))
    child.start()
    pid, granted = answers.get(timeout=30)
    child.join(timeout=30)
    assert granted == 4
    assert table.waiting(7) == 4  # nobody released them

    assert table.hold_waiting(7, 4) is True  # the dead process's are dropped
    assert table.waiting(7) == 1

    other = fork.Process(target=_hold_in_child, args=(table, 2, answers, False))
    other.start()
    try:
        pid, granted = answers.get(timeout=30)
        assert granted == 2
        assert table.waiting(7) == 3
        table.forget_process(pid)
        assert table.waiting(7) == 1
    finally:
        other.kill()
        other.join(timeout=30)


# --- Through the worker API ------------------------------------------------------------


def _claim_with(client: WorkerClient, waiter: Waiter):
    return client.client.post(
        "/api/v1/claim",
        data={"wait_seconds": 30},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {client.worker.token}",
        **{WAITER_KEY: waiter},
    )


@pytest.mark.django_db
def test_a_worker_past_its_waiting_claims_is_answered_at_once(settings):
    """Four claims of one worker wait; a fifth is answered as if it had not
    asked to wait: a job when there is one, else a 204, and it is not held.
    Once one of the four is answered, a claim may wait again; a claim woken
    and parked again (run through the view twice) counts once."""
    settings.RECALL_MAX_WAITING_CLAIMS_PER_WORKER = 4
    worker, other = make_worker("greedy"), make_worker("other")
    api = WorkerClient(worker)
    parked = [Waiter() for _ in range(4)]

    for waiter in parked:
        assert _claim_with(api, waiter).status_code == 204
        assert waiter.parked is True
    fifth = Waiter()
    assert _claim_with(api, fifth).status_code == 204
    assert fifth.parked is False
    quiet = Waiter(quiet=True)  # parked without trying, unless past the limit
    batch = make_batch(1)
    response = _claim_with(api, quiet)
    assert (response.status_code, quiet.parked) == (200, False)
    assert response.json()["job"]["id"] == jobs_of(batch)[0].pk
    # Another worker's claims wait as usual.
    theirs = Waiter()
    assert _claim_with(WorkerClient(other), theirs).status_code == 204
    assert theirs.parked is True
    assert worker_limits.waiting(worker.pk) == 4

    # The same claim through the view again (woken, nothing for it): still one.
    assert _claim_with(api, parked[0]).status_code == 204
    assert parked[0].parked is True
    assert worker_limits.waiting(worker.pk) == 4

    parked[1].done()
    parked[1].done()  # a second call releases nothing more
    assert worker_limits.waiting(worker.pk) == 3
    again = Waiter()
    assert _claim_with(api, again).status_code == 204
    assert again.parked is True
    assert worker_limits.waiting(worker.pk) == 4


@pytest.mark.django_db
def test_no_waiting_claims_allowed_answers_every_claim_at_once(settings):
    settings.RECALL_MAX_WAITING_CLAIMS_PER_WORKER = 0
    api = WorkerClient(make_worker())
    waiter = Waiter()

    assert _claim_with(api, waiter).status_code == 204
    assert waiter.parked is False


@pytest.mark.django_db
def test_a_worker_past_its_rate_gets_429_rate_limited_with_retry_after(settings):
    settings.RECALL_WORKER_RATE_PER_SECOND = 0.5
    settings.RECALL_WORKER_RATE_BURST = 3
    make_batch(1)
    flooder, other = WorkerClient(make_worker("flood")), WorkerClient(make_worker())

    answers = [flooder.claim().status_code for _ in range(3)]
    refused = flooder.heartbeat(1, "x")

    assert answers == [200, 204, 204]
    assert refused.status_code == 429
    assert refused["Retry-After"] == "2"
    assert refused.json() == {
        "error": "rate_limited",
        "detail": "Worker 'flood' is over its request rate (0.5 a second, in "
        "bursts of up to 3): retry after Retry-After seconds.",
    }
    # Refused before it did anything: the lease is as it was, the worker's
    # request not counted against anyone else.
    assert Job.objects.get().status == JobStatus.LEASED
    assert other.claim().status_code == 204
    # Requests without a valid token never reach the bucket (a 401 as always).
    assert flooder.post("/api/v1/claim", {}, token="nope").status_code == 401


@pytest.mark.django_db
def test_the_api_document_gives_every_worker_call_its_429_rate_limited():
    spec = Client().get("/api/v1/openapi.json").json()

    worker_calls = [
        operation
        for operations in spec["paths"].values()
        for operation in operations.values()
        if "worker" in operation["tags"]
    ]
    assert len(worker_calls) == 7
    for operation in worker_calls:
        limited = operation["responses"]["429"]
        assert "rate_limited" in limited["description"]
        assert limited["headers"]["Retry-After"]["schema"]["type"] == "integer"
    error = spec["components"]["schemas"]["Error"]["properties"]["error"]
    assert "rate_limited" in error["enum"]
