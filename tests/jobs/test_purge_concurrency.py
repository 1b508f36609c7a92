"""The purge against real concurrency on PostgreSQL: a *retry failed* reopening
the batch while a chunk is being taken, and a purge process SIGKILLed in the
middle of a chunk. Real transactions, real row locks, a real subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

from batches.models import Batch, BatchCounter, BatchItem
from bench import seed
from jobs import transitions
from jobs.models import Job, Lease, Tally
from tests.support.factories import T0, assert_consistent, claim, jobs_of, make_batch

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _database_url() -> str:
    s = connection.settings_dict
    return (
        f"postgres://{s['USER'] or 'root'}@{s['HOST'] or '127.0.0.1'}:"
        f"{s['PORT'] or 5432}/{s['NAME']}"
    )


def _slow(table: str, on: str, seconds: float, when: str = "true") -> str:
    """A real trigger that makes ``on`` of ``table`` sleep (once per statement
    unless ``when`` refers to rows); returns its name for dropping."""
    name = f"slow_{table}_{on.lower()}"
    level = "STATEMENT" if when == "true" else "ROW"
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger AS $$ "
            f"BEGIN IF {when} THEN PERFORM pg_sleep({seconds}); END IF; "
            f"RETURN {'NEW' if level == 'ROW' else 'NULL'}; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            f"CREATE TRIGGER {name} BEFORE {on} ON {table} "
            f"FOR EACH {level} EXECUTE FUNCTION {name}()"
        )
    return name


def _drop(name: str, table: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")


def _sleeping() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event = 'PgSleep' AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.01)


def test_a_retry_reopening_the_batch_mid_chunk_wins_and_nothing_goes(worker):
    batch = make_batch(3, name="old")
    for i in range(3):
        job = claim(worker)
        if i == 2:
            transitions.fail(
                job, job.lease_token, worker=worker, error="x", retryable=False, now=T0
            )
        else:
            transitions.complete(job, job.lease_token, worker=worker, result={}, now=T0)
    table = Batch._meta.db_table
    # The retry holds its job, item and counter locks and sleeps as it reopens
    # the batch: the purge's chunk comes in exactly then.
    trigger = _slow(
        table, "UPDATE", 1.0, "OLD.finished_at IS NOT NULL AND NEW.finished_at IS NULL"
    )
    errors: list[BaseException] = []

    def retry() -> None:
        try:
            transitions.retry_failed(Job.objects.filter(batch=batch), now=T0)
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    try:
        thread = threading.Thread(target=retry)
        thread.start()
        _wait_for(_sleeping)
        started = time.monotonic()
        chunk = transitions.purge_batch_chunk(
            batch.pk, finished_before=T0 + timedelta(days=1), limit=10
        )
        waited = time.monotonic() - started
        thread.join()
    finally:
        _drop(trigger, table)
    assert errors == []
    assert (chunk.jobs, chunk.batch_deleted, chunk.refused) == (
        0,
        False,
        "not finished",
    )
    assert waited > 0.3  # it waited for the retry's locks, then saw its commit
    batch.refresh_from_db()
    assert batch.finished_at is None
    assert [j.status for j in jobs_of(batch)] == ["completed", "completed", "queued"]
    assert_consistent(T0)


def test_a_purge_killed_mid_chunk_leaves_no_orphans_and_the_next_run_finishes(
    tmp_path,
):
    n, chunk = 3_000, 200
    now = transitions.now()
    batch = seed.batch("old", now=now - timedelta(days=3), completed=n)
    Batch.objects.filter(pk=batch.pk).update(finished_at=now - timedelta(days=2))
    items = BatchItem._meta.db_table
    # Each chunk's delete of its items sleeps a moment: the kill lands inside one.
    trigger = _slow(items, "DELETE", 0.3)
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(),
        "RECALL_CHUNK_SIZE": str(chunk),
        "LOG_LEVEL": "WARNING",
    }
    command = [sys.executable, "manage.py", "recall_purge", "--finished-before", "1"]
    try:
        purge = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # The first chunk has committed; the process is in the next one.
        _wait_for(lambda: Job.objects.filter(batch=batch).count() < n)
        _wait_for(_sleeping)
        purge.send_signal(signal.SIGKILL)
        purge.wait(timeout=30)
    finally:
        _drop(trigger, items)
    assert purge.returncode == -signal.SIGKILL

    left = Job.objects.filter(batch=batch).count()
    assert 0 < left < n and left % chunk == 0  # whole chunks only
    assert BatchItem.objects.filter(batch=batch).count() == left
    assert BatchItem.objects.filter(batch=batch, job__isnull=True).count() == 0
    assert Lease.objects.filter(job__batch=batch).count() == left
    assert BatchCounter.objects.filter(batch=batch).count() == 16
    batch.refresh_from_db()
    assert batch.total == left == batch.counts()["done"]
    assert_consistent(transitions.now())

    again = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"deleted: 1 batches, {left} items" in again.stdout
    assert not Batch.objects.filter(pk=batch.pk).exists()
    assert (
        Job.objects.count() == BatchItem.objects.count() == Lease.objects.count() == 0
    )
    assert_consistent(transitions.now())


def test_claims_in_other_batches_go_on_while_a_chunk_is_held(worker):
    """A chunk locks only its own batch's rows: a claim elsewhere never waits."""
    now = transitions.now()
    old = seed.batch("old", now=now - timedelta(days=3), completed=50)
    Batch.objects.filter(pk=old.pk).update(finished_at=now - timedelta(days=2))
    make_batch(2, name="live", now=now)
    items = BatchItem._meta.db_table
    trigger = _slow(items, "DELETE", 1.5)

    def chunk() -> None:
        try:
            transitions.purge_batch_chunk(old.pk, finished_before=now, limit=100)
        finally:
            connection.close()

    try:
        thread = threading.Thread(target=chunk)
        thread.start()
        _wait_for(_sleeping)
        started = time.monotonic()
        job = transitions.claim_next(worker)
        took = time.monotonic() - started
        thread.join()
    finally:
        _drop(trigger, items)
    assert job is not None
    assert took < 0.5
    assert not Batch.objects.filter(pk=old.pk).exists()


def test_two_purges_at_once_delete_each_job_once():
    now = transitions.now()
    batch = seed.batch("old", now=now - timedelta(days=3), completed=1_000)
    Batch.objects.filter(pk=batch.pk).update(finished_at=now - timedelta(days=2))
    reports, errors = [], []

    def run() -> None:
        from engine.retention import purge

        try:
            reports.append(purge(older_than=timedelta(days=1), chunk=50))
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(r.jobs for r in reports) == 1_000
    assert sorted(len(r.batches) for r in reports) == [0, 1]
    assert not Batch.objects.filter(pk=batch.pk).exists()
    assert Tally.objects.get(name="jobs_completed_purged").count == 1_000
    assert_consistent(transitions.now())
