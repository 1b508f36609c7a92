"""`make bench` prints figures, it does not test. These keep it honest: the rows
it seeds break no invariant, and a tiny run of the whole harness (every
scenario, the peers included) works, so it cannot rot between releases."""

import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from bench import seed
from jobs import transitions
from jobs.checks import find_violations
from jobs.models import Job, JobStatus
from jobs.sweep import sweep

from .factories import T0
from .pgserver import available

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.postgres


@pytest.mark.django_db
def test_seeded_rows_agree_like_the_transitions_leave_them():
    (holder, _), (claimer, _) = seed.workers(2)
    batch = seed.batch(
        "seeded",
        now=T0,
        completed=30,
        leased=7,
        queued=5,
        lease_expires_at=T0 + timedelta(minutes=1),
        worker=holder,
    )

    assert find_violations(now=T0) == []
    assert batch.counts() == {
        **dict.fromkeys(batch.counts(), 0),
        "done": 30,
        "transcribing": 7,
        "queued": 5,
        "done_ms": 30 * seed.ITEM_MS,
        "transcribing_ms": 7 * seed.ITEM_MS,
        "queued_ms": 5 * seed.ITEM_MS,
    }
    # The seeded leases behave like real ones: they expire and are reclaimed,
    # and the seeded queue is claimed in order.
    assert seed.expire_leases(batch.pk, at=T0) == 7
    sweep(now=T0 + timedelta(seconds=1))
    assert Job.objects.filter(status=JobStatus.LEASED).count() == 0
    job = transitions.claim_next(claimer, now=T0 + timedelta(seconds=2))
    assert job.batch_id == batch.pk
    assert find_violations(now=T0 + timedelta(seconds=2)) == []


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
def test_a_tiny_bench_run_prints_every_figure():
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--processes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    rows = re.findall(r"^(\d+)\s{2,}(.*)$", result.stdout, re.MULTILINE)
    assert {n for n, _ in rows} == {str(n) for n in range(1, 16)}
    cells = [re.split(r"\s{2,}", row) for _, row in rows]
    scenarios = {c[0] for c in cells}
    assert {
        "peer: procrastinate, stock",
        "peer: django-q2 (ORM broker), tuned",
    } <= scenarios
    exact = [c for c in cells if c[1] == "counts equal a fresh recount once quiet"]
    assert exact[0][2] == "yes"
    scraped = [
        c for c in cells if c[1] == "recall_jobs equals a fresh count of the jobs"
    ]
    assert scraped[0][2] == "yes"
    assert any(c[0] == "idle fleet" and "% of one core" in c[2] for c in cells)
    assert any(c[0] == "long-poll" and "% of one core" in c[2] for c in cells)
