"""One worker token against the real server (gunicorn.conf.py, its thread
worker, several processes): it may not lease past its cap however its claims
arrive (parked long-polls and plain claims together), may keep only
``RECALL_MAX_WAITING_CLAIMS_PER_WORKER`` claims waiting on the whole server,
counted across its processes and never leaked by a process that dies, and
is held to ``RECALL_WORKER_RATE_PER_SECOND`` with 429 ``rate_limited``."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import select
import signal
import socket
import threading
import time

import pytest
from django.utils import timezone

from jobs.models import Job, JobStatus, Worker
from tests.support.factories import make_batch, make_worker
from tests.support.server import healthy, start_server

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREADS = 4


@contextlib.contextmanager
def serving(tmp_path, processes: int, env: dict):
    """The server with ``env``: (process, port, log); stopped after, its log
    free of tracebacks."""
    process, port, log = start_server(tmp_path, processes, THREADS, env=env)
    try:
        yield process, port, log
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text, text


class Claim:
    """A claim sent on a connection of its own, its answer read when it comes
    (or its client hangs up first)."""

    def __init__(self, port: int, worker: Worker, wait: float = 0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        body = json.dumps({"wait_seconds": wait}).encode()
        self.sock.sendall(
            b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {worker.token}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    def answered(self, within: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], within)[0])

    def answer(self) -> tuple[int, dict | None, dict]:
        """(status, JSON or None, headers)."""
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        raw = response.read()
        self.sock.close()
        return response.status, (json.loads(raw) if raw else None), response.headers

    def hang_up(self) -> None:
        self.sock.close()


def answered_within(claims: list[Claim], seconds: float) -> list[Claim]:
    """The claims answered by then (all waited on together)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        ready = [c for c in claims if c.answered()]
        if left <= 0:
            return ready
        time.sleep(min(0.05, left))


def request(port: int, worker: Worker, path: str, body: dict) -> tuple:
    """(status, JSON or None, headers) of one request on a new connection."""
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    client.request(
        "POST",
        f"/api/v1/{path}",
        json.dumps(body),
        {"Authorization": f"Bearer {worker.token}"},
    )
    response = client.getresponse()
    raw = response.read()
    client.close()
    return response.status, (json.loads(raw) if raw else None), response.headers


def test_parked_and_plain_claims_of_one_worker_lease_no_more_than_its_cap(tmp_path):
    """Cap 2: ten claims of one worker wait, a 10-item batch arrives and six
    plain claims of the same worker come at once. The woken wave and the
    plain claims count the worker's leases each in their own transaction:
    exactly two jobs are leased, every other claim is a 429 too_many_leases
    (or a 204, a wait that ended), and eight jobs stay queued."""
    env = {
        "RECALL_MAX_LEASES_PER_WORKER": "2",
        "RECALL_MAX_WAITING_CLAIMS_PER_WORKER": "10",
    }
    with serving(tmp_path, 2, env) as (_, port, _):
        worker = make_worker("greedy")
        waiting = [Claim(port, worker, wait=8) for _ in range(10)]
        # Nothing is claimable: a claim that did not wait would be answered
        # at once. Unanswered after 2 s, all ten are parked.
        assert answered_within(waiting, 2.0) == []

        batch = make_batch(10, now=timezone.now())
        plain: list[tuple] = []
        threads = [
            threading.Thread(
                target=lambda: plain.append(request(port, worker, "claim", {}))
            )
            for _ in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        answers = [claim.answer() for claim in waiting] + plain

    statuses = sorted(status for status, _, _ in answers)
    assert statuses.count(200) == 2, statuses
    assert set(statuses) <= {200, 204, 429}, statuses
    for status, body, headers in answers:
        if status == 429:
            assert body["error"] == "too_many_leases"
            assert headers["Retry-After"] == "20"
    leased = Job.objects.filter(batch=batch, status=JobStatus.LEASED)
    assert list(leased.values_list("leased_by", flat=True)) == [worker.pk] * 2
    assert Job.objects.filter(batch=batch, status=JobStatus.QUEUED).count() == 8


def test_a_worker_keeps_at_most_its_limit_of_claims_waiting_on_the_server(tmp_path):
    """Limit 4, three processes: of ten waiting claims of one worker, four
    wait and six are answered at once (204: nothing claimable), wherever
    they landed. Another worker's claim still waits. Two clients that hang
    up free two places, and only two."""
    env = {"RECALL_MAX_WAITING_CLAIMS_PER_WORKER": "4"}
    with serving(tmp_path, 3, env) as (_, port, _):
        greedy, other = make_worker("greedy"), make_worker("other")
        claims = [Claim(port, greedy, wait=30) for _ in range(10)]

        at_once = answered_within(claims, 3.0)
        assert len(at_once) == 6
        assert [claim.answer()[:2] for claim in at_once] == [(204, None)] * 6
        waiting = [claim for claim in claims if claim not in at_once]
        theirs = Claim(port, other, wait=30)
        assert answered_within([*waiting, theirs], 1.5) == []

        waiting[0].hang_up()
        waiting[1].hang_up()
        time.sleep(1.0)  # the server sees the hang-ups on its next loop
        more = [Claim(port, greedy, wait=30) for _ in range(3)]
        at_once = answered_within(more, 3.0)
        assert len(at_once) == 1
        assert at_once[0].answer()[:2] == (204, None)
        assert answered_within(waiting[2:], 0) == []


def test_waiting_claims_of_a_killed_process_do_not_lock_their_worker_out(tmp_path):
    """A process killed (SIGKILL) while two claims of a worker wait in it
    releases nothing; gunicorn's master starts another, and the worker may
    have two claims waiting again, not none."""
    env = {"RECALL_MAX_WAITING_CLAIMS_PER_WORKER": "2"}
    with serving(tmp_path, 1, env) as (_, port, log):
        worker = make_worker()
        held = [Claim(port, worker, wait=30) for _ in range(2)]
        assert answered_within(held, 1.5) == []
        third = Claim(port, worker, wait=30)
        assert answered_within([third], 3.0) == [third]  # past the limit
        assert third.answer()[:2] == (204, None)

        pid = int(re.findall(r"Booting worker with pid: (\d+)", log.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        # The killed process's connections close; the master boots another.
        assert answered_within(held, 10.0) == held
        deadline = time.monotonic() + 60
        while log.read_text().count("Booting worker") < 2 or not healthy(port):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

        again = [Claim(port, worker, wait=30) for _ in range(3)]
        at_once = answered_within(again, 3.0)
        assert len(at_once) == 1
        assert at_once[0].answer()[:2] == (204, None)


def test_a_flood_from_one_token_is_rate_limited_across_the_processes(tmp_path):
    """1 request a second in bursts of 5, three processes: fifteen claims as
    fast as they go, each on a new connection (spread over the processes),
    pass five (and one more per second elapsed) in all; the rest are 429
    rate_limited with Retry-After. Another worker is not affected."""
    env = {"RECALL_WORKER_RATE_PER_SECOND": "1", "RECALL_WORKER_RATE_BURST": "5"}
    with serving(tmp_path, 3, env) as (_, port, _):
        flood, honest = make_worker("flood"), make_worker("honest")
        started = time.monotonic()
        answers = [request(port, flood, "claim", {}) for _ in range(15)]
        elapsed = time.monotonic() - started
        honest_answer = request(port, honest, "claim", {})

    passed = [a for a in answers if a[0] == 204]
    refused = [a for a in answers if a[0] == 429]
    assert len(passed) + len(refused) == 15
    assert 5 <= len(passed) <= 5 + int(elapsed) + 1, (len(passed), elapsed)
    for _, body, headers in refused:
        assert body == {
            "error": "rate_limited",
            "detail": "Worker 'flood' is over its request rate (1 a second, in "
            "bursts of up to 5): retry after Retry-After seconds.",
        }
        assert headers["Retry-After"] == "1"
    assert honest_answer[0] == 204
