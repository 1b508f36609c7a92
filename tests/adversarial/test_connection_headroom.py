"""Parked claims and idle connections against a process's connection limit
(issue 24, item 1).

Before, every parked claim and idle kept-alive connection counted against
gunicorn's ``worker_connections``, and a process at that count stopped
accepting: one token opening 4,000 waiting claims took a default server (3
processes) offline, ``/healthz`` and every heartbeat with it. Now a process
keeps a tenth of its connections (at least twice its threads) free: a new
connection that would eat into that headroom first closes the oldest idle
kept-alive connection, then answers the oldest parked claim early (its kept
204, as if its wait were over).

These servers run one process with ``--worker-connections 40``: 36 held at
most (headroom max(2 x 4 threads, 40 // 10) = 8). The claims come from
several tokens, at most 4 each, as a per-worker cap on waiting claims would
allow: the headroom must hold whatever the number of tokens.
"""

from __future__ import annotations

import json
import time

import pytest
from django.utils import timezone

from jobs.models import Worker
from tests.support.factories import make_batch, make_worker
from tests.support.raw_clients import (
    call,
    claim_bytes,
    closed_by_server,
    connect,
    healthz,
    read_response,
    request_bytes,
    serving,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

CONNECTIONS, THREADS = 40, 4
HELD = CONNECTIONS - max(2 * THREADS, CONNECTIONS // 10)  # 32
ARGS = ("--worker-connections", str(CONNECTIONS), "--keep-alive", "60")


def _workers(n: int) -> list[Worker]:
    return [make_worker(f"waiting-{i}") for i in range(n)]


def _park(port: int, worker: Worker, wait: float = 60):
    """A claim that waits: its socket once the server has parked it."""
    sock = connect(port)
    sock.sendall(claim_bytes(worker.token, wait))
    deadline = time.monotonic() + 10
    while not Worker.objects.filter(pk=worker.pk, last_seen__isnull=False).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)  # tried once, found nothing: parked
    return sock


def _idle(port: int):
    """A kept-alive connection, idle after one answered request."""
    sock = connect(port)
    sock.sendall(request_bytes("GET", "/healthz", close=False))
    status, headers, _ = read_response(sock)
    assert (status, headers["connection"]) == (200, "keep-alive")
    return sock


def test_parked_claims_from_many_tokens_never_stop_the_process(tmp_path):
    """60 claims wait (15 tokens, 4 each) on a process that holds 32: it keeps
    answering /healthz and heartbeats at once, and the oldest claims get their
    204 early, with ``Connection: close``, so that it never holds more."""
    with serving(tmp_path, 1, THREADS, *ARGS) as (port, _):
        holder = make_worker("holder")
        make_batch(1, now=timezone.now())
        status, body, _ = call(port, "POST", "/api/v1/claim", b"{}", token=holder.token)
        assert status == 200
        job = json.loads(body)["job"]
        beat = json.dumps({"lease_token": job["lease_token"]}).encode()

        workers = [w for w in _workers(15) for _ in range(4)]
        claims, took = [], []
        for n, worker in enumerate(workers):
            sock = connect(port)
            sock.sendall(claim_bytes(worker.token, 60))
            claims.append(sock)
            if n % 10 == 9:
                took.append(healthz(port, timeout=5))
                status, _, seconds = call(
                    port,
                    "POST",
                    f"/api/v1/jobs/{job['id']}/heartbeat",
                    beat,
                    token=holder.token,
                    timeout=5,
                )
                assert status == 200
                took.append(seconds)
        time.sleep(1)
        took.append(healthz(port, timeout=5))
        answers = [_answer(sock) for sock in claims]
        for sock in claims:
            sock.close()

    assert max(took) < 1.0, took
    answered = [n for n, answer in enumerate(answers) if answer is not None]
    # Enough went early that the process holds no more than it may; the
    # oldest went, never one of the last claims.
    assert len(answered) >= len(claims) - HELD
    assert max(answered) < len(claims) - 10
    assert {answers[n] for n in answered} == {(204, "close", b"")}


def _settled(look, seconds: float = 2.0):
    """What ``look()`` says once it has said the same twice, 0.2 s apart (the
    server acts on each connection as its event loop gets to it)."""
    deadline = time.monotonic() + seconds
    seen = look()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = look()
        if again == seen:
            return seen
        seen = again
    return seen


def _answer(sock) -> tuple | None:
    """The answer a waiting claim got by now, or None."""
    try:
        status, headers, body = read_response(sock, timeout=0.1)
    except TimeoutError:
        return None
    return status, headers["connection"], body


def test_idle_connections_are_closed_before_any_parked_claim_is_answered(tmp_path):
    """20 idle kept-alive connections, then 20 waiting claims, then 10 more
    requests: every one that needs room closes the oldest idle connection,
    and only when none is left is the oldest parked claim answered early."""
    with serving(tmp_path, 1, THREADS, *ARGS) as (port, _):
        idle = [_idle(port) for _ in range(20)]
        claims = [_park(port, worker) for worker in _workers(20)]
        first = _settled(lambda: [closed_by_server(s, timeout=0.05) for s in idle])
        # 20 requests on their way (half a head each, within a second: none
        # is slow yet): the 12 idle connections left go, then 8 parked claims.
        arriving = []
        for _ in range(20):
            sock = connect(port)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            arriving.append(sock)
        idle_closed = _settled(
            lambda: [closed_by_server(s, timeout=0.05) for s in idle]
        )
        early = [_answer(sock) for sock in claims]
        took = healthz(port, timeout=5)
        for sock in idle + claims + arriving:
            sock.close()

    assert first == [True] * 8 + [False] * 12
    assert idle_closed == [True] * 20
    assert early == [(204, "close", b"")] * 8 + [None] * 12
    assert took < 1.0
