"""The backup and restore drill of docs/operations/production.md, followed to
the letter: ``pg_dump --format=custom`` while reference workers run and a
webhook waits for its receiver, more work and that webhook's delivery after
the dump, then the disaster (everything stopped), ``pg_restore`` into an empty
database, and Recall started on it. Then: ``recall_check`` is clean; every
lease live at the dump is reclaimed once it runs out (and the sweep closes
it); every item is done with its result or claimable again; and the webhook
event delivered after the dump is sent again with its original
``webhook-id``, so a receiver that deduplicates by id sees it once."""

from __future__ import annotations

import subprocess
import time

import psycopg
import pytest
from django.utils import timezone
from django_q.models import Schedule

from batches.models import Batch
from engine.manifests import create_batch
from jobs import transitions
from jobs.models import DeliveryStatus, WebhookDelivery
from tests.support.factories import make_worker
from tests.support.receiver import Answer, Receiver
from tests.support.stack import (
    PY,
    ROOT,
    Gunicorn,
    call,
    cluster,
    db_settings,
    direct_url,
    need,
    reference_worker,
    server_env,
    wait_for,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

LEASE = 5


def manage(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "manage.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def rows(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def test_a_restore_from_a_dump_taken_while_workers_ran(tmp_path):
    pg_dump, pg_restore = need("pg_dump"), need("pg_restore")
    receiver = Receiver()
    receiver.answers = [Answer(status=503)] * 1000  # down until the dump is taken
    env = server_env(
        tmp_path,
        direct_url(),
        RECALL_LEASE_SECONDS=str(LEASE),
        RECALL_WEBHOOK_ALLOW_PRIVATE="on",
        RECALL_WEBHOOK_RETRY_SECONDS="1,1,1,1,1,1,1,1,1,1",
    )
    schedules()
    transitions.create_webhook_endpoint(
        receiver.url, events=["batch.finished"], now=timezone.now()
    )
    small = create_batch(
        "small", lambda: iter(f"file:///a/{n}.wav\n" for n in range(4)),
        now=timezone.now(),
    )  # fmt: skip
    create_batch(
        "big", lambda: iter(f"file:///b/{n:04d}.wav\n" for n in range(600)),
        now=timezone.now(),
    )  # fmt: skip
    restored_name = f"{db_settings()['name']}_restore"
    restored = direct_url(restored_name)
    dump = tmp_path / "recall.dump"
    processes: list = []
    try:
        web = Gunicorn(tmp_path, env, processes=1, threads=4)
        processes.append(web)
        url = f"http://127.0.0.1:{web.port}"
        processes += [
            reference_worker(tmp_path, f"worker-{i}", make_worker(f"gpu-{i}").token,
                             url, "--poll-max", "1")
            for i in range(4)
        ]  # fmt: skip
        processes.append(cluster(tmp_path, env))

        # The small batch finishes; its webhook is tried and refused.
        wait_for(
            lambda: (
                Batch.objects.get(pk=small.pk).finished_at is not None
                and len(receiver.received) >= 1
            ),
            60,
            "the small batch's webhook to be tried",
        )
        # The backup, while the workers run.
        started = time.monotonic()
        subprocess.run(
            [pg_dump, "--format=custom", f"--file={dump}", direct_url()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        dumped = time.monotonic() - started
        # After the dump: the receiver is back, the webhook is delivered.
        receiver.answers.clear()
        wait_for(
            lambda: (
                receiver.received[-1:]
                and WebhookDelivery.objects.filter(
                    status=DeliveryStatus.DELIVERED
                ).exists()
            ),
            30,
            "the webhook's delivery after the dump",
        )
        first = receiver.received[-1]
        # The disaster: everything stops at once.
        for process in reversed(processes):
            process.kill()
        processes.clear()
        delivered_before = len(receiver.received)

        # The restore, into an empty database.
        subprocess.run(["createdb", "-h", db_settings()["host"], "-p",
                        db_settings()["port"], "-U", db_settings()["user"],
                        restored_name], check=True, capture_output=True,
                       timeout=60)  # fmt: skip
        started = time.monotonic()
        subprocess.run(
            [pg_restore, "--no-owner", "--exit-on-error", f"--dbname={restored}",
             str(dump)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        restored_in = time.monotonic() - started
        live_at_dump = rows(
            restored, "SELECT job_id FROM jobs_lease WHERE ended_at IS NULL"
        )
        counts = dict(
            rows(
                restored,
                "SELECT status, count(*) FROM batches_batchitem GROUP BY status",
            )
        )
        print(
            f"restore: dump of {dump.stat().st_size} bytes in {dumped:.2f} s, "
            f"restored in {restored_in:.2f} s; at the dump: {counts}, "
            f"{len(live_at_dump)} live leases"
        )
        assert live_at_dump, "no lease was live at the dump: nothing to check"

        # Recall on the restored database.
        renv = {**env, "DATABASE_URL": restored}
        check = manage(renv, "recall_check")
        assert check.returncode == 0, check.stdout + check.stderr
        processes.append(cluster(tmp_path, renv, "qcluster-restored"))
        web = Gunicorn(tmp_path, renv, processes=1, threads=4)
        processes.append(web)

        # The webhook delivered after the dump is sent again, same id, by the
        # dispatcher the cluster's scheduler starts (within its first 30 s).
        again = wait_for(
            lambda: receiver.received[delivered_before:],
            60,
            "the webhook to be sent again",
        )
        assert again[0].headers["webhook-id"] == first.headers["webhook-id"]
        assert again[0].body == first.body
        ids = [r.headers["webhook-id"] for r in receiver.received if r is not None]
        print(f"restore: webhook-ids received: {ids}")
        assert len(set(ids)) == 1

        # The leases live at the dump run out, and the sweep reclaims them.
        wait_for(
            lambda: (
                rows(
                    restored,
                    "SELECT count(*) FROM jobs_lease WHERE ended_at IS NULL"
                    " AND expires_at > now()",
                )[0][0]
                == 0
            ),
            LEASE + 10,
            "the restored leases to run out",
        )
        sweep = manage(renv, "recall_sweep")
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        assert rows(
            restored, "SELECT count(*) FROM jobs_lease WHERE ended_at IS NULL"
        ) == [(0,)]
        ends = dict(
            rows(
                restored,
                "SELECT l.end_reason, count(*) FROM jobs_lease l WHERE l.job_id IN ("
                + ",".join(str(j) for (j,) in live_at_dump)
                + ") AND l.ended_at IS NOT NULL GROUP BY l.end_reason",
            )
        )
        print(f"restore: the {len(live_at_dump)} leases live at the dump: {ends}")
        assert ends.get("expired", 0) == len(live_at_dump)
        items = rows(
            restored,
            "SELECT i.status, j.status, j.result IS NOT NULL, count(*)"
            " FROM batches_batchitem i JOIN jobs_job j ON j.item_id = i.id"
            " GROUP BY 1, 2, 3 ORDER BY 1",
        )
        print(f"restore: items after the sweep: {items}")
        assert {(i, j, r) for i, j, r, _ in items} <= {
            ("done", "completed", True),
            ("queued", "queued", False),
        }
        check = manage(renv, "recall_check")
        assert check.returncode == 0, check.stdout + check.stderr
        # Claimable again: a worker gets one of them.
        worker = make_worker_in(renv, "after-restore")
        status, body, _ = call(web.port, "POST", "/api/v1/claim", {}, token=worker)
        assert status == 200, body
    finally:
        for process in reversed(processes):
            process.stop()
        receiver.close()
        with psycopg.connect(direct_url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{restored_name}" WITH (FORCE)')


def make_worker_in(env: dict, name: str) -> str:
    """A worker token on the restored database (create_worker's last line)."""
    created = manage(env, "create_worker", name)
    assert created.returncode == 0, created.stderr
    return created.stdout.strip().splitlines()[-1]


def schedules() -> None:
    """The cluster's two schedules, as the migrations create them (a
    transactional test's flush empties every table, theirs included)."""
    for name, func in [
        ("recall-sweep", "engine.tasks.sweep"),
        ("recall-webhooks", "engine.tasks.dispatch_webhooks"),
    ]:
        Schedule.objects.update_or_create(
            name=name,
            defaults={"func": func, "schedule_type": Schedule.MINUTES, "minutes": 1,
                      "repeats": -1, "next_run": timezone.now()},
        )  # fmt: skip
