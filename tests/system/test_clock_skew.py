"""Web nodes whose clocks are wrong by minutes still keep leases right.

Lease time is the database's: two more web servers run against the test
database under libfaketime, one two minutes fast and one two minutes slow. A
fast node must neither reclaim a live lease early nor stretch a heartbeat past
the lease; a slow node must not keep an expired lease alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection

from harness.server import Server, ServerError, libfaketime
from jobs import transitions
from jobs.models import Job, JobStatus, Lease, LeaseEnd
from tests.support.factories import make_batch, make_worker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LIBFAKETIME = libfaketime()


@contextlib.contextmanager
def skewed_server(offset: str) -> Iterator[str]:
    """gunicorn serving Recall from the test database, its clock ``offset``."""
    if not LIBFAKETIME:
        if os.environ.get("RECALL_REQUIRE_POSTGRES") == "1":
            pytest.fail("libfaketime is missing (Debian package faketime)")
        pytest.skip("libfaketime is missing (apt-get install faketime)")
    settings = connection.settings_dict
    url = (
        f"postgres://{settings['USER']}@{settings['HOST'] or '127.0.0.1'}:"
        f"{settings['PORT'] or 5432}/{settings['NAME']}"
    )
    log = Path(tempfile.mkdtemp(prefix="recall-skewed-")) / "gunicorn.log"
    server = Server(
        {
            **os.environ,
            "DATABASE_URL": url,
            "WEB_CONCURRENCY": "1",
            "RECALL_STARTUP_SWEEP": "off",
            "RECALL_HTTPS": "off",
            "RECALL_ACCESS_LOG": "/dev/null",
        },
        log,
        clock=offset,
    )
    try:
        try:
            server.wait_until_up(30)
        except ServerError as error:
            pytest.fail(f"the skewed server did not start: {error}")
        yield server.url
    finally:
        server.stop(15)
        shutil.rmtree(log.parent, ignore_errors=True)


def post(base: str, path: str, token: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_fast_node_neither_reclaims_a_live_lease_early_nor_stretches_it():
    make_batch(2)
    alice, bob = make_worker("alice"), make_worker("bob")
    held = transitions.claim_next(alice)  # the database's clock: lease 60 s
    assert held is not None

    with skewed_server("+120s") as fast:
        # Its own clock says Alice's lease ran out a minute ago; the database's
        # says it has a minute left. Bob gets the other job.
        status, body = post(fast, "/api/v1/claim", bob.token, {})
        assert status == 200
        assert body["job"]["id"] != held.pk
        job = Job.objects.get(pk=held.pk)
        assert (job.status, job.leased_by_id, job.lease_token) == (
            JobStatus.LEASED,
            alice.pk,
            held.lease_token,
        )
        assert not Lease.objects.filter(end_reason=LeaseEnd.EXPIRED).exists()

        # A heartbeat through it extends the lease by 60 s of database time,
        # not to three minutes from now.
        before = database_now()
        status, body = post(
            fast,
            f"/api/v1/jobs/{held.pk}/heartbeat",
            alice.token,
            {"lease_token": held.lease_token},
        )
        after = database_now()
        assert status == 200
        expires = datetime.fromisoformat(body["lease_expires_at"])
        assert before + timedelta(seconds=60) <= expires
        assert expires <= after + timedelta(seconds=60)
        assert Job.objects.get(pk=held.pk).lease_expires_at == expires


@pytest.mark.django_db(transaction=True)
def test_a_slow_node_does_not_keep_an_expired_lease_alive():
    make_batch(2)
    alice, bob = make_worker("alice"), make_worker("bob")
    held = transitions.claim_next(alice)
    assert held is not None
    # Alice stopped heartbeating long enough ago: by the database's clock her
    # lease ran out a second ago (by the slow node's, it has two minutes left).
    Job.objects.filter(pk=held.pk).update(
        lease_expires_at=database_now() - timedelta(seconds=1)
    )

    with skewed_server("-120s") as slow:
        # Bob's claim reclaims the expired lease first, and takes that job.
        status, body = post(slow, "/api/v1/claim", bob.token, {})
        assert status == 200
        assert body["job"]["id"] == held.pk
        assert body["job"]["attempt"] == 2
        ended = Lease.objects.get(token=held.lease_token)
        assert ended.end_reason == LeaseEnd.EXPIRED

        # Alice comes back through the slow node: fenced out.
        status, body = post(
            slow,
            f"/api/v1/jobs/{held.pk}/heartbeat",
            alice.token,
            {"lease_token": held.lease_token},
        )
        assert (status, body["error"]) == (409, "lease_lost")
