"""`make bench` prints figures, it does not test. These keep it honest: the rows
it seeds break no invariant, and a tiny run of the whole harness (every
scenario, the peers included) works, so it cannot rot between releases."""

import re
import subprocess
import sys
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, transaction

from batches.labels import satisfies
from bench import scale, seed
from bench.scenarios.routing import MATCHING, NOT_MATCHING, requirement_sets
from engine.checks import find_violations
from engine.sweep import sweep
from harness.pgserver import available
from harness.server import ROOT
from jobs import transitions
from jobs.models import Job, JobStatus
from tests.support.factories import T0

pytestmark = pytest.mark.postgres


def run(*argv: str, timeout: int) -> str:
    """What ``python -m argv...`` printed; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return result.stdout


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


@pytest.mark.django_db
def test_a_seed_keeps_analyze_off_its_tables_until_it_commits():
    """An ANALYZE (autovacuum's) while the seed's rows are uncommitted counted
    none of them, and the foreign-key checks at COMMIT then walked a whole
    index per row (docs/development/benchmark-history.md)."""
    with transaction.atomic():  # the seed's COMMIT, still to come
        seed.batch("held", now=T0, completed=3, queued=2, analyze=False)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relation::regclass::text FROM pg_locks "
                "WHERE pid = pg_backend_pid() AND mode = 'ShareUpdateExclusiveLock'"
            )
            held = {name for (name,) in cursor.fetchall()}
        assert held == {"batches_batch", "batches_batchitem", "jobs_job"}
        with psycopg.connect(**connection.get_connection_params()) as other:
            other.execute("SET lock_timeout = '50ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("ANALYZE batches_batchitem")


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
def test_a_tiny_bench_run_prints_every_figure():
    stdout = run("bench", "--quick", "--processes", "2", timeout=600)

    rows = re.findall(r"^(\d+)\s{2,}(.*)$", stdout, re.MULTILINE)
    assert {n for n, _ in rows} == {
        *(str(n) for n in range(1, 16)),
        *(str(n) for n in range(17, 23)),
    }
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
    hostile = [c for c in cells if c[0] == "hostile clients"]
    assert [c[1] for c in hostile[1:]] == [
        "leases expired",
        "/healthz answered every 0.5 s (5 s timeout)",
        hostile[3][1],  # server memory growth, with the sizes measured
        "what the attackers sent and got",
    ]
    assert hostile[3][1].startswith("server memory growth")
    # Row 19's check is exact at any size: no lease went to a worker whose
    # labels do not meet its batch's requirements.
    routed = [c for c in cells if c[0] == "routing"]
    assert len(routed) == 2
    assert routed[1][2:] == ["0", "0", "ok"]
    beats = [c for c in cells if c[0] == "heartbeats at fleet scale"]
    assert [c[1].split(":")[0] for c in beats] == [
        "once per lease",
        "once per worker",
        "server CPU once per lease / once per worker (per lease renewed); leases "
        "live at the end, of 80",
    ]
    assert re.fullmatch(r"[0-9.]+ x \([0-9.]+ x\); 80", beats[2][2])
    many = [c for c in cells if c[0] == "HTTP claim of many"]
    assert len(many) == 2
    assert many[1][1].count("tuned") == 2
    searched = [c for c in cells if c[0] == "search"]
    assert len(searched) == 4
    assert searched[0][1].startswith("a batch of 2,000 transcripts")
    assert "in rounds of without, with, with, without" in searched[3][1]
    assert re.match(r"[0-9.]+/s / [0-9.]+/s = [0-9.]+ \(CPU per", searched[3][2])


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
@pytest.mark.parametrize("kind", ["raw", "model", "http"])
def test_the_hot_path_measure_runs_its_steps(kind):
    stdout = run("bench.hotpath", kind, "3", timeout=300)

    assert re.search(
        rf"^{kind}: 3 claim \+ complete steps, [0-9.]+ ms of CPU each "
        r"\(and [0-9.]+ ms of the database's\)$",
        stdout,
        re.MULTILINE,
    ), stdout


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
def test_the_hot_path_measure_spreads_its_queue_over_open_batches():
    stdout = run("bench.hotpath", "model", "6", "--batches", "3", timeout=300)

    assert re.search(
        r"^model: 6 claim \+ complete steps, over 3 open batches, [0-9.]+ ms of CPU "
        r"each \(and [0-9.]+ ms of the database's\)$",
        stdout,
        re.MULTILINE,
    ), stdout


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
def test_the_hot_path_measure_lists_the_statements_and_their_plans():
    stdout = run("bench.hotpath", "model", "20", "--statements", timeout=300)

    rows = {
        line.split(None, 5)[5][:20]: line.split()[:2]
        for line in stdout.splitlines()[2:]
    }
    # The claim and the completion, each once per step and never re-planned
    # (their plans were made in the warm-up: plan_cache_mode).
    assert rows["WITH chores AS ( SEL"] == ["1.00", "0.00"]
    assert rows["WITH target AS ( SEL"] == ["1.00", "0.00"]


def test_the_routing_rows_workers_serve_as_it_says():
    sets = requirement_sets(20)

    assert len({tuple(sorted(s.items())) for s in sets}) == 20
    for labels in MATCHING:
        assert sum(satisfies(labels, s) for s in sets) == 2, labels
    for labels in NOT_MATCHING:
        assert not any(satisfies(labels, s) for s in sets), labels


def test_scale_sizes_read_like_the_docs_write_them():
    assert scale.parse_scale("10m") == 10_000_000
    assert scale.parse_scale("250k") == 250_000
    assert scale.parse_scale("1.5M") == 1_500_000
    assert scale.parse_scale("5000") == 5_000
    for bad in ("", "ten", "10g", "999", "-5k"):
        with pytest.raises(ValueError, match=r"size|too small"):
            scale.parse_scale(bad)


def test_the_scale_layout_is_the_issues_ten_million():
    layout = scale.Layout.of(10_000_000, 1_000)

    done, leased, queued = layout.largest
    assert (done, leased, queued) == (500_000, 10_000, 490_000)
    assert len(layout.finished) == 900
    assert len(layout.queued) == 99
    assert sum(layout.finished) + done == 9_000_000
    assert sum(layout.queued) + queued + leased == 1_000_000
    assert max(layout.finished + layout.queued) < done + leased + queued


@pytest.mark.skipif(not available(), reason="PostgreSQL server binaries not installed")
def test_a_tiny_scale_run_prints_every_figure_and_breaks_no_invariant():
    stdout = run(
        *("bench", "--quick", "--processes", "2"),
        *("--scale", "5k", "--scale-batches", "10"),
        timeout=600,
    )

    rows = re.findall(r"^S\s{2,}(.*)$", stdout, re.MULTILINE)
    cells = [re.split(r"\s{2,}", row) for row in rows]
    assert [c[0] for c in cells] == [
        "seed",
        "idle claim",
        "idle claim",
        "claim with work",
        "claim with work",
        "progress.json",
        "batch page",
        "batches list",
        "admin job list",
        "admin job list, leased",
        "sweep",
        "recall_check",
        "heartbeat",
        "heartbeat",
        "database size",
    ]
    check = next(c for c in cells if c[0] == "recall_check")
    assert "(0 violations)" in check[1]
    assert check[-1] == "ok"


def test_with_one_open_batch_the_largest_holds_the_whole_queue():
    layout = scale.Layout.of(5_000, 10)

    assert layout.largest == (250, 5, 495)
    assert layout.queued == []
    assert sum(layout.finished) + sum(layout.largest) == 5_000
