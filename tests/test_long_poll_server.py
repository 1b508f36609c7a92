"""Long-poll claims against the real server (gunicorn.conf.py, the thread worker
of recall_site/gunicorn_worker.py): a waiting claim is held without a thread and
woken by the per-process probe when work comes (a new batch, a retry that falls
due, a released lease), answered 204 when its wait is over, dropped when its
client hangs up, and hundreds of them hold neither threads nor connections:
heartbeats go on at full speed."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest
from django.utils import timezone

from jobs import transitions
from jobs.models import Job, JobStatus, Lease, Worker

from .factories import assert_consistent, jobs_of, make_batch, make_worker
from .test_server import backends, start_server

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PROCESSES, THREADS = 2, 4


@pytest.fixture
def server(tmp_path):
    process, port, log = start_server(
        tmp_path, PROCESSES, THREADS, env={"RECALL_RETRY_BACKOFF_SECONDS": "2"}
    )
    yield process, port
    process.terminate()
    process.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text, text


def post(port: int, worker: Worker, path: str, body: dict, timeout: float = 90):
    """(status, JSON or None, seconds taken) of one request on a new connection."""
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    client.request(
        "POST",
        f"/api/v1/{path}",
        json.dumps(body),
        {"Authorization": f"Bearer {worker.token}"},
    )
    response = client.getresponse()
    raw = response.read()
    took = time.monotonic() - started
    client.close()
    return response.status, (json.loads(raw) if raw else None), took


class Waiting(threading.Thread):
    """A claim with ``wait`` seconds in flight on its own thread."""

    def __init__(self, port: int, worker: Worker, wait: float):
        super().__init__()
        self.port, self.worker, self.wait = port, worker, wait
        self.result: tuple | None = None
        self.start()

    def run(self) -> None:
        self.result = post(self.port, self.worker, "claim", {"wait_seconds": self.wait})

    def answer(self) -> tuple:
        self.join(timeout=self.wait + 30)
        assert self.result is not None
        return self.result


def parked(worker: Worker) -> None:
    """Return once the worker's claim has been tried once (and found nothing):
    its first request marks the worker seen, and the view parks it right after."""
    deadline = time.monotonic() + 10
    while Worker.objects.get(pk=worker.pk).last_seen is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)


def test_a_new_batch_wakes_a_waiting_claim(server):
    _, port = server
    worker = make_worker()
    waiting = Waiting(port, worker, 30)
    parked(worker)

    batch = make_batch(1, now=timezone.now())
    created = time.monotonic()
    status, body, took = waiting.answer()

    assert status == 200
    assert body["job"]["id"] == jobs_of(batch)[0].pk
    assert time.monotonic() - created < 2  # the probe runs every 0.25 s
    assert took < 10


def test_a_retry_falling_due_wakes_a_waiting_claim(server):
    _, port = server
    first, second = make_worker("first"), make_worker("second")
    batch = make_batch(1, now=timezone.now())
    status, body, _ = post(port, first, "claim", {})
    assert status == 200
    job = body["job"]
    status, body, _ = post(
        port,
        first,
        f"jobs/{job['id']}/fail",
        {"lease_token": job["lease_token"], "error": "oom"},
    )
    assert (status, body) == (200, {"status": "queued"})
    due = Job.objects.get(pk=job["id"]).available_at  # 2 s on, the database's clock

    waiting = Waiting(port, second, 30)
    parked(second)
    assert transitions.now() < due
    status, body, _ = waiting.answer()
    answered = transitions.now()

    assert status == 200
    assert body["job"]["id"] == jobs_of(batch)[0].pk
    assert body["job"]["attempt"] == 2
    assert due <= answered
    assert (answered - due).total_seconds() < 2


def test_a_released_lease_wakes_a_waiting_claim(server):
    _, port = server
    holder, waiter = make_worker("holder"), make_worker("waiter")
    make_batch(1, now=timezone.now())
    status, body, _ = post(port, holder, "claim", {})
    assert status == 200
    job = body["job"]
    waiting = Waiting(port, waiter, 30)
    parked(waiter)

    status, body, _ = post(
        port, holder, f"jobs/{job['id']}/release", {"lease_token": job["lease_token"]}
    )
    released = time.monotonic()
    assert status == 200
    status, body, _ = waiting.answer()

    assert status == 200
    assert body["job"]["id"] == job["id"]
    assert time.monotonic() - released < 2
    assert Job.objects.get(pk=job["id"]).leased_by_id == waiter.pk


def test_a_wait_that_finds_nothing_ends_with_204(server):
    _, port = server
    worker = make_worker()

    status, body, took = post(port, worker, "claim", {"wait_seconds": 1.5})

    assert (status, body) == (204, None)
    assert 1.5 <= took < 2.5
    # A claim that does not wait still answers at once.
    status, body, took = post(port, worker, "claim", {})
    assert (status, body) == (204, None)
    assert took < 1


def test_bad_waits_are_400_through_the_server(server):
    _, port = server
    worker = make_worker()
    for value in (-1, 61, "5", True, None):
        status, body, took = post(port, worker, "claim", {"wait_seconds": value})
        assert status == 400
        assert body["error"] == "bad_request"
        assert took < 1


def test_a_waiting_claim_whose_client_hangs_up_leases_nothing(server):
    _, port = server
    gone, present = make_worker("gone"), make_worker("present")
    sock = socket.create_connection(("127.0.0.1", port))
    body = b'{"wait_seconds": 30}'
    sock.sendall(
        b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {gone.token}\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    parked(gone)
    sock.close()
    time.sleep(0.3)  # the server sees the hang-up on its next loop

    batch = make_batch(1, now=timezone.now())
    status, answer, _ = post(port, present, "claim", {"wait_seconds": 10})

    assert status == 200
    assert answer["job"]["id"] == jobs_of(batch)[0].pk
    assert list(Lease.objects.values_list("worker__name", flat=True)) == ["present"]


def test_a_stopping_server_answers_its_waiting_claims_at_once(server):
    process, port = server
    workers = [make_worker(f"w{i}") for i in range(6)]
    waiting = [Waiting(port, w, 30) for w in workers]
    for worker in workers:
        parked(worker)

    process.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    answers = [w.answer() for w in waiting]

    assert [(status, body) for status, body, _ in answers] == [(204, None)] * 6
    assert time.monotonic() - stopped < 5  # not the 30 s wait, nor the grace


def test_many_waiting_claims_hold_no_thread_and_do_not_slow_heartbeats(server):
    """200 claims wait 8 s on 2 processes x 4 threads; once they all wait, a
    worker heartbeats its lease as fast as it can for 5 s. Every heartbeat is
    answered in well under a second, the server holds no more database
    connections than it has threads, and each waiting claim is answered 204
    when its 8 s are over."""
    _, port = server
    make_batch(1, now=timezone.now())
    busy = make_worker("busy")
    status, body, _ = post(port, busy, "claim", {})
    assert status == 200
    job = body["job"]
    idle = [make_worker(f"idle-{i}") for i in range(200)]
    waiting = [Waiting(port, worker, 8) for worker in idle]
    # Every claim has been tried once (each marks its worker seen), then parked.
    deadline = time.monotonic() + 30
    while (
        Worker.objects.filter(name__startswith="idle-", last_seen__isnull=False).count()
        < 200
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)

    beats: list[float] = []
    seen_backends: list[int] = []
    started = time.monotonic()
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": f"Bearer {busy.token}"}
    while time.monotonic() - started < 5:
        t0 = time.monotonic()
        client.request(
            "POST",
            f"/api/v1/jobs/{job['id']}/heartbeat",
            json.dumps({"lease_token": job["lease_token"]}),
            headers,
        )
        response = client.getresponse()
        response.read()
        assert response.status == 200
        beats.append(time.monotonic() - t0)
        seen_backends.append(backends())
        time.sleep(0.02)
    answers = [w.answer() for w in waiting]

    assert [(status, body) for status, body, _ in answers] == [(204, None)] * 200
    assert min(took for _, _, took in answers) >= 8
    assert len(beats) > 50
    beats.sort()
    assert beats[-1] < 1.0, beats[-5:]
    assert max(seen_backends) <= PROCESSES * THREADS
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED
    assert_consistent(timezone.now())
