"""Slow clients against the real server (issue 24, item 3).

Before, a thread read each request itself, as slowly as its client sent it: 8
anonymous connections per process sending half a head or half a body held
every thread, and ``/healthz`` went unanswered for as long as they stayed.
Now the event loop reads a request whole before it takes a thread, and drops
it with 408 after ``RECALL_CLIENT_TIMEOUT_SECONDS``. And a client that never
closes its side after a ``Connection: close`` answer no longer stalls the
loop (gunicorn's close blocked it 2 s per such connection)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from django.utils import timezone

from tests.support.factories import make_batch, make_worker
from tests.support.raw_clients import (
    call,
    closed_by_server,
    connect,
    healthz,
    read_response,
    request_bytes,
    serving,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PROCESSES, THREADS = 2, 2
TIMEOUT = 3  # RECALL_CLIENT_TIMEOUT_SECONDS for these servers

HALF_A_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
HALF_A_BODY = (
    b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Authorization: Bearer nobody\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)


def _leased(port: int) -> tuple[str, dict]:
    """A worker holding a lease, through the server: (token, job)."""
    worker = make_worker("honest")
    make_batch(1, now=timezone.now())
    status, body, _ = call(port, "POST", "/api/v1/claim", b"{}", token=worker.token)
    assert status == 200, body
    return worker.token, json.loads(body)["job"]


def _heartbeat(port: int, token: str, job: dict) -> float:
    payload = json.dumps({"lease_token": job["lease_token"]}).encode()
    status, body, took = call(
        port, "POST", f"/api/v1/jobs/{job['id']}/heartbeat", payload, token=token
    )
    assert status == 200, body
    return took


@pytest.mark.parametrize("partial", [HALF_A_HEAD, HALF_A_BODY], ids=["head", "body"])
def test_slow_requests_hold_no_thread_and_are_dropped_after_the_timeout(
    tmp_path, partial
):
    """40 connections (10 per thread) send part of a request and stop, five a
    second: a burst of bodies would be shed at once (test_load_shedding.py),
    and a process sheds once 4 bodies per thread arrived in the last second,
    so even if the kernel gives every connection to one process (8 bodies)
    they stay under it.
    The server answers /healthz and a heartbeat at once all along, and drops
    each slow one with 408 once RECALL_CLIENT_TIMEOUT_SECONDS have passed."""
    env = {"RECALL_CLIENT_TIMEOUT_SECONDS": str(TIMEOUT)}
    with serving(tmp_path, PROCESSES, THREADS, env=env) as (port, _):
        token, job = _leased(port)
        took: list[float] = []
        answers: list[tuple] = [None] * 40
        readers = []

        def answer(n: int, sent: float, sock) -> None:
            """When the server drops slow connection ``n``, and how."""
            try:
                status, headers, body = read_response(sock, timeout=TIMEOUT + 15)
                dropped_after = time.monotonic() - sent
                answers[n] = (
                    status,
                    headers["connection"],
                    json.loads(body)["error"],
                    TIMEOUT - 0.5 <= dropped_after < TIMEOUT + 5 or dropped_after,
                    closed_by_server(sock, timeout=5),
                )
            finally:
                sock.close()

        for n in range(40):
            sock = connect(port)
            sock.sendall(partial)
            reader = threading.Thread(target=answer, args=(n, time.monotonic(), sock))
            reader.start()
            readers.append(reader)
            time.sleep(0.2)
            if n % 10 == 9:
                took += [healthz(port, timeout=5), _heartbeat(port, token, job)]
        for reader in readers:
            reader.join()

    assert max(took) < 1.0, took
    assert answers == [(408, "close", "request_timeout", True, True)] * 40


def test_requests_trickling_in_are_read_whole_without_a_thread(tmp_path):
    """Four bodies arrive a few bytes at a time (on one process of two
    threads), never stopping for the timeout: each is read to its end and
    answered, and meanwhile /healthz is answered at once (before, the four
    held both threads)."""
    env = {"RECALL_CLIENT_TIMEOUT_SECONDS": str(TIMEOUT)}
    with serving(tmp_path, 1, 2, env=env) as (port, _):
        worker = make_worker("trickling")
        body = json.dumps({"wait_seconds": 0, "pad": "x" * 40}).encode()
        head = request_bytes("POST", "/api/v1/claim", body, token=worker.token)
        head = head[: -len(body)]
        socks = [connect(port) for _ in range(4)]
        for sock in socks:
            sock.sendall(head)
        took = []
        for at in range(0, len(body), 8):  # 8 bytes every 0.5 s: about 4 s
            for sock in socks:
                sock.sendall(body[at : at + 8])
            took.append(healthz(port, timeout=5))
            time.sleep(0.5)
        answers = [read_response(sock)[::2] for sock in socks]
        for sock in socks:
            sock.close()

    assert answers == [(204, b"")] * 4
    assert max(took) < 1.0, took


def test_clients_that_never_close_do_not_stall_the_server(tmp_path):
    """10 clients each send a whole request with ``Connection: close`` and
    never close their side. The server answers them, then waits for each to
    close while it goes on serving others (gunicorn's own close waited up to
    2 s per connection in the event loop: /healthz then took 20 s)."""
    with serving(tmp_path, 1, 4) as (port, _):
        lingering = []
        for _ in range(10):
            sock = connect(port)
            sock.sendall(request_bytes("GET", "/healthz"))
            lingering.append(sock)
        time.sleep(0.3)
        took = [healthz(port, timeout=30) for _ in range(5)]
        for sock in lingering:
            status, headers, _ = read_response(sock)
            assert (status, headers["connection"]) == (200, "close")
            sock.close()

    assert max(took) < 1.0, took
