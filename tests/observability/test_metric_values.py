"""The database figures of /metrics agree with the tables: after claims,
completions, failures, a sweep that reclaims expired leases, a forced reclaim
and a cancel; batch states as the operator UI's list shows them; time passed in.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from batches.models import Batch, BatchItem, ItemStatus
from engine.manifests import create_batch
from engine.progress import BatchState
from engine.reconcile import reconcile, sweep_state
from engine.sweep import sweep
from jobs import transitions
from jobs.models import Job, JobStatus, Worker
from recall_site.metrics import render
from tests.support.factories import T0, claim, later, make_batch, make_worker
from tests.support.metrics import by_label, samples

pytestmark = pytest.mark.django_db


def scrape(now) -> dict[tuple, float]:
    return samples(render(now=now))


def jobs_in_the_table() -> dict[str, float]:
    counts = dict(Job.objects.values_list("status").annotate(n=Count("pk")).order_by())
    return {s: float(counts.get(s, 0)) for s in JobStatus.values}


def test_job_counts_agree_with_the_table_after_every_transition(worker, other_worker):
    a = make_batch(4, name="a")
    b = make_batch(2, name="b")
    now = T0

    def agrees() -> None:
        assert by_label(scrape(now), "recall_jobs") == jobs_in_the_table()

    agrees()
    first = claim(worker, now)
    agrees()
    transitions.complete(
        first, first.lease_token, worker=worker, result={"text": "x"}, now=now
    )
    agrees()
    second = claim(worker, now)
    transitions.fail(
        second, second.lease_token, worker=worker, error="bad", retryable=False
    )
    agrees()
    claim(other_worker, now), claim(other_worker, now)
    agrees()
    now = later(120)  # both leases expired a minute ago
    assert sweep(now=now)["reclaimed"] == {"requeued": 2, "failed": 0}
    agrees()
    forced = claim(worker, now)
    assert transitions.force_reclaim(forced, now=now)
    agrees()
    transitions.cancel_batch(b, now=now)
    agrees()

    # Claims alternate between the two batches (fair share): a got the
    # completion and the forced lease, b the failure and one reclaimed lease.
    assert by_label(scrape(now), "recall_jobs") == {
        "queued": 3,
        "leased": 0,
        "completed": 1,
        "failed": 1,
        "cancelled": 1,
    }
    assert a.counts()["queued"] == 3


def totals(figures: dict[tuple, float]) -> dict[str, float]:
    return {
        name: figures[(f"recall_{name}_total",)]
        for name in ("leases_expired", "leases_forced", "jobs_completed", "jobs_failed")
    }


def test_the_counters_count_what_the_transitions_did(worker, other_worker):
    """The _total counters only grow: a retry does not take a failure back,
    and a repair is counted by its kind (every kind is there from the start)."""
    batch = make_batch(5)
    assert totals(scrape(T0)) == dict.fromkeys(
        ("leases_expired", "leases_forced", "jobs_completed", "jobs_failed"), 0
    )
    repairs = by_label(scrape(T0), "recall_reconcile_repairs_total")
    assert repairs == dict.fromkeys(
        [
            "item_drift",
            "lease_closed",
            "lease_restored",
            "ledger_row_written",
            "ledger_row_closed_early",
            "exhausted_failed",
            "batch_reopened",
            "counters_fixed",
        ],
        0,
    )

    done = claim(worker, T0)
    transitions.complete(done, done.lease_token, worker=worker, result={}, now=T0)
    failed = claim(worker, T0)
    transitions.fail(
        failed, failed.lease_token, worker=worker, error="bad", retryable=False, now=T0
    )
    claim(other_worker, T0), claim(other_worker, T0)
    now = later(120)
    assert sweep(now=now)["reclaimed"] == {"requeued": 2, "failed": 0}
    forced = claim(worker, now)
    assert transitions.force_reclaim(forced, now=now)
    assert totals(scrape(now)) == {
        "leases_expired": 2,
        "leases_forced": 1,
        "jobs_completed": 1,
        "jobs_failed": 1,
    }

    assert transitions.retry_failed(Job.objects.filter(pk=failed.pk), now=now) == 1
    assert Job.objects.get(pk=failed.pk).status == JobStatus.QUEUED
    assert totals(scrape(now))["jobs_failed"] == 1

    drifted = Job.objects.filter(status=JobStatus.QUEUED).first()
    BatchItem.objects.filter(pk=drifted.item_id).update(status=ItemStatus.DONE)
    report = reconcile(now=now)
    assert (report.items_healed, report.counters_fixed) == (1, 1)
    repairs = by_label(scrape(now), "recall_reconcile_repairs_total")
    assert {kind: n for kind, n in repairs.items() if n} == {
        "item_drift": 1,
        "counters_fixed": 1,
    }
    assert batch.counts()["done"] == 1


def test_every_database_figure_at_one_moment(settings):
    settings.RECALL_LEASE_SECONDS = 60
    settings.RECALL_STALLED_AFTER_SECONDS = 180
    busy = make_worker("busy")
    idle, silent, disabled, _never = (
        make_worker(n) for n in ("idle", "silent", "disabled", "never")
    )
    done = make_batch(1, name="done", now=T0 - timedelta(hours=2))
    make_batch(2, name="old", now=T0 - timedelta(hours=1))
    make_batch(3, name="fresh", now=T0)
    paused = make_batch(2, name="paused", now=T0 - timedelta(hours=5))
    transitions.pause_batch(paused, now=T0)
    cancelled = make_batch(1, name="cancelled", now=T0 - timedelta(hours=6))
    transitions.cancel_batch(cancelled, now=T0)
    finishing = claim(busy, T0)
    assert finishing.batch_id == done.pk
    transitions.complete(
        finishing, finishing.lease_token, worker=busy, result={"text": ""}, now=T0
    )
    claim(busy, T0)  # the old batch's first job, held from now on
    now = later(30)
    Worker.objects.filter(pk=idle.pk).update(last_seen=now - timedelta(seconds=110))
    Worker.objects.filter(pk=silent.pk).update(last_seen=now - timedelta(seconds=130))
    Worker.objects.filter(pk=disabled.pk).update(last_seen=now, is_active=False)

    figures = scrape(now)

    assert by_label(figures, "recall_jobs") == {
        "queued": 6,
        "leased": 1,
        "completed": 1,
        "failed": 0,
        "cancelled": 1,
    }
    assert by_label(figures, "recall_batches") == {
        "running": 2,  # old (one in flight) and fresh
        "paused": 1,
        "finished": 1,  # nothing left, though no sweep has marked it yet
        "cancelled": 1,
        "stalled": 0,
    }
    # The old batch's second job, created an hour before T0; the paused batch's
    # older jobs are not claimable.
    assert figures[("recall_oldest_queued_seconds",)] == 3600 + 30
    assert by_label(figures, "recall_workers") == {"busy": 1, "idle": 1, "offline": 3}
    assert figures[("recall_last_sweep_age_seconds",)] == float("inf")

    # Five minutes on, the held lease has long expired but nobody reclaimed it:
    # still busy, and its batch stalled. A sweep then reclaims it.
    now = later(400)
    figures = scrape(now)
    assert by_label(figures, "recall_batches")["stalled"] == 1
    assert by_label(figures, "recall_batches")["running"] == 1
    assert by_label(figures, "recall_workers")["busy"] == 1
    sweep(now=now)
    later_on = now + timedelta(seconds=45)
    figures = scrape(later_on)
    finished_at = sweep_state().last_finished_at
    assert figures[("recall_last_sweep_age_seconds",)] == pytest.approx(
        (later_on - finished_at).total_seconds(), abs=1e-6
    )
    assert by_label(figures, "recall_workers") == {"busy": 0, "idle": 0, "offline": 5}
    assert by_label(figures, "recall_batches") == {
        "running": 2,
        "paused": 1,
        "finished": 1,
        "cancelled": 1,
        "stalled": 0,
    }
    assert (
        figures[("recall_oldest_queued_seconds",)]
        == (later_on - (T0 - timedelta(hours=1))).total_seconds()
    )


def test_no_claimable_job_means_zero_age(worker):
    batch = make_batch(1, now=T0 - timedelta(days=1))
    job = claim(worker, T0)
    assert scrape(T0)[("recall_oldest_queued_seconds",)] == 0
    transitions.fail(
        job, job.lease_token, worker=worker, error="later", retryable=True, now=T0
    )
    # Queued again, but in retry backoff (30 s): not claimable yet.
    assert scrape(later(10))[("recall_oldest_queued_seconds",)] == 0
    assert scrape(later(31))[("recall_oldest_queued_seconds",)] == 86400 + 31
    transitions.pause_batch(batch, now=later(40))
    assert scrape(later(41))[("recall_oldest_queued_seconds",)] == 0


def _listed(client, state: str) -> int:
    page = client.get(f"/?state={state}").content.decode()
    return len(re.findall(r'<a href="/batches/\d+/">', page))


def test_batch_states_are_the_batch_lists(viewer_client, worker, settings):
    """Counted as the list's state filter counts them, on the real clock (the
    list cannot be given a time)."""
    settings.RECALL_STALLED_AFTER_SECONDS = 180
    settings.RECALL_LEASE_SECONDS = 3600  # no lease expires (and is reclaimed)
    now = timezone.now()

    def claimed(batch, at=now) -> Job:
        job = claim(worker, at)
        assert job.batch_id == batch.pk
        return job

    claimed(make_batch(1, name="running", now=now))
    stalled = make_batch(1, name="stalled", now=now - timedelta(minutes=15))
    claimed(stalled, at=now - timedelta(minutes=10))  # no heartbeat since
    transitions.pause_batch(make_batch(1, name="paused", now=now), now=now)
    for name in ("finished and swept", "finished, not swept yet"):
        batch = make_batch(1, name=name, now=now)
        job = claimed(batch)
        transitions.complete(
            job, job.lease_token, worker=worker, result={"text": ""}, now=now
        )
    transitions.settle(Batch.objects.filter(name="finished and swept"), now=now)
    transitions.cancel_batch(make_batch(1, name="cancelled", now=now), now=now)

    figures = by_label(scrape(timezone.now()), "recall_batches")

    assert figures == {state: _listed(viewer_client, state) for state in BatchState.ALL}
    assert figures == {
        "running": 1,
        "stalled": 1,
        "paused": 1,
        "finished": 2,
        "cancelled": 1,
    }


def test_a_scrape_is_a_fixed_number_of_queries(worker):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            render(now=T0)
        return len(captured)

    make_batch(2)
    claim(worker, T0)
    few = queries()
    for i in range(10):
        make_batch(3, name=f"more-{i}")
        claim(make_worker(f"w-{i}"), T0)

    assert queries() == few


def test_batches_waiting_for_a_worker(settings):
    """Open batches with queued items that no worker online can take: from
    the start, 0 when there are none."""
    settings.RECALL_LEASE_SECONDS = 60
    text = render(now=T0).decode()
    assert (
        "# HELP recall_batches_waiting_for_worker Open batches with queued items "
        "that no worker seen recently can take (none offers the labels they "
        "require); 0 if none.\n# TYPE recall_batches_waiting_for_worker gauge\n"
        "recall_batches_waiting_for_worker 0.0\n"
    ) in text

    lines = ["file:///a.wav\n", "file:///b.wav\n"]
    create_batch("large", lambda: iter(lines), requires={"model": "large-v3"}, now=T0)
    create_batch("a100", lambda: iter(lines), requires={"gpu": "a100"}, now=T0)
    make_batch(2, name="anyone")
    paused = create_batch(
        "paused", lambda: iter(lines), requires={"gpu": "h100"}, now=T0
    )
    transitions.pause_batch(paused, now=T0)
    assert scrape(T0)[("recall_batches_waiting_for_worker",)] == 3

    worker = make_worker("a100")
    Worker.objects.filter(pk=worker.pk).update(labels={"gpu": "a100"}, last_seen=T0)
    assert scrape(later(120))[("recall_batches_waiting_for_worker",)] == 1
    assert scrape(later(121))[("recall_batches_waiting_for_worker",)] == 3
