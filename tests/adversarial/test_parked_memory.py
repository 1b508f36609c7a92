"""What a parked claim keeps (issue 24, item 1).

Before, a waiting claim kept its whole request body (the server ran the view
again on it when woken), and so did Django's request until the garbage
collector broke its reference cycles: 20 claims with 5 MB bodies took a
process from 65 to 217 MB. Now it keeps its parsed parameters
(``api.waiter.ClaimRequest``), the request's body is released when its
response is made, and large blocks go back to the system when freed.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from django.utils import timezone

from jobs.models import Job, JobStatus, Worker
from tests.support.factories import jobs_of, make_batch, make_worker
from tests.support.raw_clients import connect, read_response, request_bytes, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

BODY_BYTES = 5 * 1024 * 1024


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_twenty_parked_claims_with_5_mb_bodies_keep_nothing_of_them(tmp_path):
    with serving(tmp_path, 1, 4) as (port, log):
        (pid,) = map(
            int, re.findall(r"Booting worker with pid: (\d+)", log.read_text())
        )
        workers = [make_worker(f"large-{i}") for i in range(20)]
        pad = "x" * (BODY_BYTES - 100)
        time.sleep(1)
        before = _rss_mb(pid)
        claims = []
        for worker in workers:
            body = json.dumps({"wait_seconds": 60, "pad": pad}).encode()
            sock = connect(port)
            sock.sendall(
                request_bytes(
                    "POST", "/api/v1/claim", body, token=worker.token, close=False
                )
            )
            claims.append(sock)
        deadline = time.monotonic() + 60
        seen = Worker.objects.filter(name__startswith="large-", last_seen__isnull=False)
        while seen.count() < 20:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(2)  # all tried once, found nothing, parked
        grown = _rss_mb(pid) - before

        # They still wait, and work comes to them as to any waiting claim.
        batch = make_batch(20, now=timezone.now())
        answers = [read_response(sock, timeout=30) for sock in claims]
        for sock in claims:
            sock.close()

    assert grown < 30, f"the process grew {grown:.0f} MB"
    assert [status for status, _, _ in answers] == [200] * 20
    won = sorted(json.loads(body)["job"]["id"] for _, _, body in answers)
    assert won == [job.pk for job in jobs_of(batch)]
    assert Job.objects.filter(batch=batch, status=JobStatus.LEASED).count() == 20
