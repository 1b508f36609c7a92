"""`make demo` shows routing (issue 26): one demo batch requires a label only
one demo worker offers, the terminal says so, and that worker alone does the
batch's jobs."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batches.labels import satisfies
from batches.models import Batch
from jobs import transitions
from jobs.models import Job, JobRun, Lease, Worker
from tests.support.factories import make_batch, make_worker

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scripts" / "demo.py"


def _demo():
    from tests.test_demo_reclaims import _demo as load

    return load()


def test_exactly_one_demo_worker_offers_what_the_routed_batch_requires():
    demo = _demo()

    offering = [
        name
        for name, labels in demo.WORKER_LABELS.items()
        if satisfies(labels, demo.ROUTED_REQUIRES)
    ]

    assert offering == ["gpu-1"]
    assert demo.routing_sentence() == (
        "'Demo: lectures (large-v3 only)' requires model=large-v3, which only "
        "worker gpu-1 offers (--label model=large-v3): only it takes that "
        "batch's jobs"
    )


@pytest.mark.django_db
def test_the_progress_line_says_who_did_the_routed_batchs_jobs():
    demo = _demo()
    batch = make_batch(3, name=demo.ROUTED_BATCH)
    Batch.objects.filter(pk=batch.pk).update(requires=demo.ROUTED_REQUIRES)
    gpu1 = make_worker("gpu-1")
    assert demo.routed_progress() == (
        "routing: Demo: lectures (large-v3 only) (model=large-v3): 0/3 done"
    )

    for _ in range(2):
        job = transitions.claim_next(gpu1, labels=demo.WORKER_LABELS["gpu-1"])
        transitions.complete(job, job.lease_token, worker=gpu1, result={"text": "x"})

    assert demo.routed_progress() == (
        "routing: Demo: lectures (large-v3 only) (model=large-v3): 2/3 done, "
        "all by gpu-1"
    )


@pytest.mark.slow
def test_the_demo_routes_the_lectures_to_gpu_1_alone(tmp_path):
    """The real demo, small and fast: gunicorn, the cluster and the three
    workers, until every item is finished; then Ctrl-C. Every lease of the
    routed batch was gpu-1's, and the terminal said so; each batch's short
    transcripts were re-run once, on gpu-1, and the batch finished again."""
    from harness.server import free_port

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DATABASE")},
        "RECALL_BIND": f"127.0.0.1:{free_port()}",
        "DEMO_ITEMS": "10",
        "DEMO_SPEED": "0.002",
        "DEMO_KILL_EVERY": "100000",
    }
    out = tmp_path / "demo.out"
    with open(out, "wb") as terminal:
        demo = subprocess.Popen(
            [sys.executable, str(DEMO)],
            cwd=ROOT,
            env=env,
            stdout=terminal,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while "every item is finished" not in out.read_text(errors="replace"):
            assert demo.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.5)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 0
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    terminal_text = out.read_text(errors="replace")

    assert "routing: 'Demo: lectures (large-v3 only)' requires model=large-v3, " in (
        terminal_text
    )
    assert ", all by gpu-1\n" in terminal_text
    database = sqlite3.connect(ROOT / "var" / "demo" / "recall.sqlite3")
    rows = database.execute(
        f"SELECT w.name, l.end_reason, j.status "
        f"FROM {Lease._meta.db_table} l "
        f"JOIN {Job._meta.db_table} j ON l.job_id = j.id "
        f"JOIN {Batch._meta.db_table} b ON j.batch_id = b.id "
        f"JOIN {Worker._meta.db_table} w ON l.worker_id = w.id "
        f"WHERE b.name = ?",
        ["Demo: lectures (large-v3 only)"],
    ).fetchall()
    statuses = database.execute(
        f"SELECT j.status FROM {Job._meta.db_table} j "
        f"JOIN {Batch._meta.db_table} b ON j.batch_id = b.id WHERE b.name = ?",
        ["Demo: lectures (large-v3 only)"],
    ).fetchall()
    # The re-run (issue 29): each batch's short transcripts (DEMO_ITEMS=10:
    # items 3 and 8 of the interviews, item 3 of the others, FLAGGED) re-run
    # once as run 2, on gpu-1 alone (model=large-v3), and finished again.
    reruns = database.execute(
        f"SELECT b.name, COUNT(*) FROM {JobRun._meta.db_table} r "
        f"JOIN {Job._meta.db_table} j ON r.job_id = j.id "
        f"JOIN {Batch._meta.db_table} b ON j.batch_id = b.id "
        f"WHERE r.number = 1 GROUP BY b.name ORDER BY b.name"
    ).fetchall()
    second_runs = database.execute(
        f"SELECT j.run, j.status, j.requires, w.name "
        f"FROM {Job._meta.db_table} j "
        f"JOIN {Lease._meta.db_table} l ON l.job_id = j.id "
        f"JOIN {Worker._meta.db_table} w ON l.worker_id = w.id "
        f"WHERE j.run = 2 AND l.id > (SELECT r.last_lease_id "
        f"FROM {JobRun._meta.db_table} r WHERE r.job_id = j.id)"
    ).fetchall()
    unfinished = database.execute(
        f"SELECT COUNT(*) FROM {Batch._meta.db_table} WHERE finished_at IS NULL"
    ).fetchone()
    database.close()
    assert reruns == [
        ("Demo: field interviews", 2),
        ("Demo: lectures (large-v3 only)", 1),
        ("Demo: press calls (urgent)", 1),
    ]
    assert {(run, requires, name) for run, _, requires, name in second_runs} == {
        (2, '{"model": "large-v3"}', "gpu-1")
    }
    assert {status for _, status, _, _ in second_runs} <= {"completed", "failed"}
    assert unfinished == (0,)
    for name, n in (
        ("Demo: field interviews", 2),
        ("Demo: lectures (large-v3 only)", 1),
        ("Demo: press calls (urgent)", 1),
    ):
        assert (
            f"re-run: {name} finished with {n} transcript{'s' * (n != 1)} flagged "
            f"short; re-running {'them' if n != 1 else 'it'} on the workers "
            f"offering model=large-v3 (the batch page's Re-run, as demo)\n"
        ) in terminal_text
        assert (
            f"re-run: {name} finished again; each re-run item's page shows "
            f"its earlier run ({n} item{'s' * (n != 1)})\n"
        ) in terminal_text
    # Every lecture finished (a simulated failure on its last attempt may
    # fail one), every lease of the batch gpu-1's, most of them completed.
    assert len(statuses) == 5
    assert {status for (status,) in statuses} <= {"completed", "failed"}
    assert {name for name, _, _ in rows} == {"gpu-1"}
    assert sum(reason == "completed" for _, reason, _ in rows) >= 4
