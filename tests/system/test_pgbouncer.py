"""Recall behind a real PgBouncer (deploy/pgbouncer/pgbouncer.ini: transaction
pooling) with a pool smaller than the web server's threads: the worker API's
claim, heartbeat, complete, fail and release from 16 workers at once, a wave of
long-poll claims woken by a new batch, the cluster's sweep (reclaim and
reconcile), an export, and the short chaos run. The settings the guide names
for PgBouncer (``DATABASE_DISABLE_SERVER_SIDE_CURSORS=on``,
``RECALL_PREPARED_STATEMENTS=off``) are the ones used: nothing may need a
session of its own."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import Counter

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import Task
from django_q.tasks import async_task

from batches.models import BatchItem, ItemStatus
from jobs.models import Job, JobStatus, Lease
from operator_api import tokens as api_tokens
from tests.support.factories import (
    assert_consistent,
    make_batch,
    make_user,
    make_worker,
)
from tests.support.stack import (
    PY,
    ROOT,
    Gunicorn,
    PgBouncer,
    call,
    cluster,
    db_settings,
    direct_url,
    need,
    server_env,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

POOL = 3  # server connections; the web server has 2 x 4 = 8 threads
WORKERS = 16
ITEMS = 160
LEASE = 5


def pgbouncer_env(bouncer: PgBouncer, tmp_path) -> dict[str, str]:
    return server_env(
        tmp_path,
        bouncer.url(db_settings()["name"]),
        DATABASE_DISABLE_SERVER_SIDE_CURSORS="on",
        RECALL_PREPARED_STATEMENTS="off",
        RECALL_LEASE_SECONDS=str(LEASE),
        RECALL_RETRY_BACKOFF_SECONDS="0",
    )


class ServerConnections(threading.Thread):
    """Samples how many server connections PgBouncer holds to the test
    database (every backend but this sampler's and the test's own)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        connection.ensure_connection()
        self.mine = connection.connection.info.backend_pid
        self.most = 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        with psycopg.connect(direct_url(), autocommit=True) as conn:
            while not self.done.wait(0.01):
                (n,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                    " current_database() AND pid NOT IN (pg_backend_pid(), %s)",
                    [self.mine],
                ).fetchone()
                self.most = max(self.most, n)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.most


def work(port: int, token: str, log: list, released: set) -> None:
    """A worker's loop: claim, heartbeat, then complete, fail (by job id, on
    the first attempt) or release (once; a release gives the attempt back),
    until a claim finds nothing."""
    while True:
        status, body, _ = call(port, "POST", "/api/v1/claim", {}, token=token)
        log.append(("claim", status))
        if status == 204:
            return
        job = body["job"]
        base = f"/api/v1/jobs/{job['id']}"
        lease = {"lease_token": job["lease_token"]}
        status, _, _ = call(port, "POST", f"{base}/heartbeat", lease, token=token)
        log.append(("heartbeat", status))
        if job["attempt"] == 1 and job["id"] % 5 == 0:
            action, body = "fail", {**lease, "error": "flaky", "retryable": True}
        elif job["id"] % 5 == 1 and job["id"] not in released:
            released.add(job["id"])
            action, body = "release", lease
        else:
            action, body = "complete", {**lease, "result": {"text": f"t{job['id']}"}}
        status, _, _ = call(port, "POST", f"{base}/{action}", body, token=token)
        log.append((action, status))


def test_worker_api_long_polls_sweep_and_export_through_transaction_pooling(tmp_path):
    db = db_settings()
    bouncer = PgBouncer(db["host"], db["port"], POOL)
    env = pgbouncer_env(bouncer, tmp_path)
    web = Gunicorn(tmp_path, env, processes=2, threads=4)
    q = None
    try:
        # 1. The worker API: 16 workers drain a batch, failing and releasing
        # some first attempts; the pool never holds more than 3 connections.
        batch = make_batch(ITEMS, name="pooled", now=timezone.now())
        tokens = [make_worker(f"gpu-{i}").token for i in range(WORKERS)]
        sampler = ServerConnections()
        log: list = []
        released: set = set()
        started = time.monotonic()
        threads = [
            threading.Thread(target=work, args=(web.port, token, log, released))
            for token in tokens
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        drained = time.monotonic() - started
        most = sampler.stop()
        calls = Counter(log)
        print(
            f"pgbouncer: {len(log)} worker API calls in {drained:.1f} s through "
            f"{most} server connections (pool {POOL}, 8 threads): {dict(calls)}"
        )
        assert {status for _, status in log} <= {200, 204}, calls
        assert calls[("complete", 200)] == ITEMS
        assert calls[("fail", 200)] >= 1 and calls[("release", 200)] >= 1
        assert 1 <= most <= POOL
        assert BatchItem.objects.filter(
            batch=batch, status=ItemStatus.DONE
        ).count() == (ITEMS)
        assert Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).count() == (
            ITEMS
        )
        assert_consistent(now=timezone.now())

        # 2. A long-poll wave: 12 claims wait (holding no server connection)
        # and a new batch wakes every one with a job of its own.
        waiting = [make_worker(f"waiter-{i}") for i in range(12)]
        answers: dict[int, tuple] = {}

        def wait(i: int) -> None:
            answers[i] = call(
                web.port, "POST", "/api/v1/claim", {"wait_seconds": 20},
                token=waiting[i].token, timeout=40,
            )  # fmt: skip

        wave = [threading.Thread(target=wait, args=(i,)) for i in range(12)]
        for thread in wave:
            thread.start()
        wait_for(
            lambda: waiting_workers_seen([w.pk for w in waiting]),
            10,
            "the claims to be parked",
        )
        created = time.monotonic()
        make_batch(12, name="wave", now=timezone.now())
        for thread in wave:
            thread.join(timeout=40)
        woken = time.monotonic() - created
        ids = {answers[i][1]["job"]["id"] for i in range(12) if answers[i][0] == 200}
        print(f"pgbouncer: 12 waiting claims woken by a new batch in {woken:.2f} s")
        assert [answers[i][0] for i in range(12)] == [200] * 12
        assert len(ids) == 12
        assert woken < 5

        # 3. The cluster's sweep: the 12 leases nobody heartbeats expire, and
        # the sweep the cluster runs (through PgBouncer) reclaims them and
        # reconciles.
        wait_for(
            lambda: (
                Lease.objects.filter(job_id__in=ids, ended_at__isnull=True)
                .filter(expires_at__lt=timezone.now())
                .count()
                == 12
            ),
            LEASE + 5,
            "the unheartbeated leases to expire",
        )
        q = cluster(tmp_path, env)
        task_id = async_task("engine.tasks.sweep")
        task = wait_for(
            lambda: Task.objects.filter(id=task_id).first(), 30, "the cluster's sweep"
        )
        assert task.success, task.result
        print(f"pgbouncer: the cluster's sweep: {task.result}")
        assert task.result["reclaimed"] == {"requeued": 12, "failed": 0}
        assert isinstance(task.result["reconcile"], dict), task.result
        queued = Job.objects.filter(pk__in=ids, status=JobStatus.QUEUED).count()
        assert queued == 12

        # 4. An export, streamed in chunks through the pool.
        _, token = api_tokens.issue_token(
            make_user("ops", "Operators"), label="export", now=timezone.now()
        )
        status, body, _ = call(
            web.port, "GET", f"/api/v1/batches/{batch.pk}/export.csv", token=token
        )
        assert status == 200, body
        rows = body.strip().splitlines()
        assert len(rows) == ITEMS + 1
        assert all(",done," in row for row in rows[1:]), rows[:3]
    finally:
        if q is not None:
            q.stop()
        web.stop()
        bouncer.stop()
    assert "Traceback" not in web.log.read_text(), web.log.read_text()
    errors = [
        line for line in bouncer.log().splitlines() if re.search(r"ERROR|FATAL", line)
    ]
    assert errors == [], errors
    statuses = [
        int(m.group(1)) for m in re.finditer(r'" (\d{3}) ', web.access_log.read_text())
    ]
    assert statuses and max(statuses) < 500


def waiting_workers_seen(pks: list[int]) -> bool:
    from jobs.models import Worker

    return Worker.objects.filter(pk__in=pks, last_seen__isnull=False).count() == len(
        pks
    )


@pytest.mark.slow
def test_the_short_chaos_run_through_pgbouncer_loses_nothing():
    need("pgbouncer")
    result = subprocess.run(
        [PY, "-m", "tests.system.chaos", "--pgbouncer", str(POOL), "--duration", "45",
         "--workers", "6", "--items", "400", "--lease", "3", "--kill-every", "3",
         "--drain", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    summary = [
        line
        for line in result.stdout.splitlines()
        if re.match(r"chaos: \d+ jobs", line)
    ]
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    print(summary[0])
    assert "chaos: through PgBouncer" in result.stdout
    assert re.search(
        r"1 db restart, lost 0, duplicated 0, mismatched 0, 5xx 0", summary[0]
    )
