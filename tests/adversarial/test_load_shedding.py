"""A flood of large bodies against the real server (issue 24, items 1 and 3).

Before, every request took a thread and read its body there: 30 clients each
starting a megabyte body held both threads of a process, and nothing else was
answered until they finished or gave up. Now the event loop reads bodies, at
most 4 per thread at once among those that just started: the next ones are
answered 503 (``unavailable``, ``Retry-After: 1``) as soon as their head is
read, their body never read, while lease calls and health checks, never shed,
are answered at once."""

from __future__ import annotations

import json
import time

import pytest
from django.utils import timezone

from tests.support.factories import make_batch, make_worker
from tests.support.raw_clients import call, connect, healthz, read_response, serving

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREADS = 2
ACCEPTED = 4 * THREADS  # bodies on their way at once, per process
TIMEOUT = 3


def test_a_flood_of_bodies_is_shed_before_they_are_read(tmp_path):
    env = {"RECALL_CLIENT_TIMEOUT_SECONDS": str(TIMEOUT)}
    with serving(tmp_path, 1, THREADS, env=env) as (port, _):
        worker = make_worker("honest")
        make_batch(1, now=timezone.now())
        status, body, _ = call(port, "POST", "/api/v1/claim", b"{}", token=worker.token)
        job = json.loads(body)["job"]
        flood = make_worker("flood")
        socks = []
        for _ in range(30):
            sock = connect(port)
            sock.sendall(
                b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"Authorization: Bearer {flood.token}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                + b'{"pad": "'
                + b"x" * 30_000
            )
            socks.append(sock)
        time.sleep(0.3)
        shed = []
        for sock in socks:
            try:
                status, headers, body = read_response(sock, timeout=0.2)
            except TimeoutError:
                shed.append(None)  # still being read
                continue
            shed.append((status, headers["retry-after"], json.loads(body)["error"]))
        beat = json.dumps({"lease_token": job["lease_token"]}).encode()
        beats = json.dumps(
            {"leases": [{"job_id": job["id"], "lease_token": job["lease_token"]}]}
        ).encode()
        single = call(
            port,
            "POST",
            f"/api/v1/jobs/{job['id']}/heartbeat",
            beat,
            token=worker.token,
            timeout=5,
        )
        batched = call(
            port, "POST", "/api/v1/heartbeat", beats, token=worker.token, timeout=5
        )
        took = [healthz(port, timeout=5), single[2], batched[2]]
        # The ones read go on, and are dropped at their timeout.
        timed_out = [
            read_response(sock, timeout=TIMEOUT + 5)[0]
            for sock, answer in zip(socks, shed, strict=True)
            if answer is None
        ]
        for sock in socks:
            sock.close()

    assert shed == [None] * ACCEPTED + [(503, "1", "unavailable")] * (30 - ACCEPTED)
    assert timed_out == [408] * ACCEPTED
    assert max(took) < 1.0, took
    assert (single[0], batched[0]) == (200, 200)
    assert "lease_expires_at" in json.loads(batched[1])["leases"][0]
