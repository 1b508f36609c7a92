"""Retention: the purge deletes old finished batches and everything they own,
a chunk per transaction, never an unfinished batch, and leaves every invariant
and every metric total as it was. Runs on PostgreSQL (both transition
backends) and on SQLite; the lock and kill tests need PostgreSQL.
"""

from __future__ import annotations

import gzip
import json

import pytest
from django.core.management import CommandError, call_command

from batches.exports import jsonl_lines
from batches.intake_records import Intake
from batches.models import Batch
from engine import fleet
from engine.archive import ArchiveRefused, archive_path
from engine.retention import purge, purgeable
from engine.sweep import sweep
from jobs import transitions
from jobs.models import (
    DeliveryStatus,
    Job,
    Lease,
    Tally,
    WebhookDelivery,
)
from recall_site.metrics import render
from tests.support.factories import (
    T0,
    assert_consistent,
    claim,
    jobs_of,
    later,
    make_batch,
    make_endpoint,
    snapshot,
)
from tests.support.purge import DAY, GONE, finished_batch, rows_of

pytestmark = pytest.mark.django_db


def deliver_everything() -> None:
    """Test set-up: every webhook delivery done (as a receiver's 2xx leaves it)."""
    WebhookDelivery.objects.update(
        status=DeliveryStatus.DELIVERED, next_attempt_at=None, finished_at=T0
    )


def test_an_old_finished_batch_goes_with_everything_it_owns(worker):
    make_endpoint(events=("batch.finished", "item.failed"))
    old = finished_batch(worker, 4, failed=1)
    transitions.pause_batch(old, now=T0)  # a batch event
    deliver_everything()
    assert rows_of(old.pk) == {
        "batch": 1, "items": 4, "jobs": 4, "leases": 4, "events": 1,
        "counters": 16, "minutes": 4, "outbox": 2,
    }  # fmt: skip

    intake = Intake.objects.create(name="old", batch=old)

    report = purge(older_than=DAY, now=T0 + 2 * DAY)

    assert rows_of(old.pk) == GONE
    intake.refresh_from_db()
    assert intake.batch is None  # the intake's record stays, without its batch
    assert report.batches == [old.pk]
    assert report.jobs == 4
    assert WebhookDelivery.objects.count() == 0
    assert dict(Tally.objects.filter(name__endswith="_purged").values_list("name", "count")) == {
        "jobs_completed_purged": 3, "jobs_failed_purged": 1, "batches_purged": 1,
    }  # fmt: skip
    assert_consistent(T0 + 2 * DAY)


def test_unfinished_and_young_batches_are_never_touched(worker):
    young = finished_batch(worker, 2, name="young", at=T0 + DAY)
    queued = make_batch(2, name="queued")
    paused = make_batch(2, name="paused")
    transitions.pause_batch(paused, now=T0)
    leased = make_batch(2, name="leased", priority=5)
    claim(worker)
    cancelling = make_batch(2, name="cancel left half-way")
    Batch.objects.filter(pk=cancelling.pk).update(cancelled_at=T0)  # a cancel killed
    unfinished = [queued, paused, leased, cancelling]
    before = snapshot(*[j for b in unfinished for j in jobs_of(b)])

    report = purge(older_than=DAY, now=T0 + 10 * DAY)

    assert report.batches == [young.pk]  # finished 9 days before: it goes
    assert snapshot(*[j for b in unfinished for j in jobs_of(b)]) == before
    for batch in (queued, paused, leased, cancelling):
        refused = transitions.purge_batch_chunk(
            batch.pk, finished_before=T0 + 10 * DAY, limit=10
        )
        assert (refused.jobs, refused.refused) == (0, "not finished")
    assert_consistent(T0)  # at T0: the lease in flight is live


def test_a_batch_finished_after_the_cutoff_stays(worker):
    batch = finished_batch(worker, 2)
    report = purge(older_than=DAY, now=T0 + DAY)  # finished exactly a day ago
    assert report.batches == []
    refused = transitions.purge_batch_chunk(batch.pk, finished_before=T0, limit=10)
    assert refused.refused == "finished after the cutoff"
    assert rows_of(batch.pk)["jobs"] == 2


def test_a_cancelled_batch_goes_once_settled(worker):
    batch = make_batch(3, name="cancelled")
    claim(worker)  # in flight when cancelled: its lease ends "forced"
    transitions.cancel_batch(batch, now=T0)
    batch.refresh_from_db()
    assert batch.finished_at == T0
    purge(older_than=DAY, now=T0 + 2 * DAY)
    assert rows_of(batch.pk) == GONE
    assert_consistent(T0 + 2 * DAY)


def test_chunks_leave_a_smaller_consistent_batch_each_time(worker):
    batch = finished_batch(worker, 7, failed=2)
    cutoff = T0 + DAY
    sizes = []
    for _ in range(3):
        chunk = transitions.purge_batch_chunk(batch.pk, finished_before=cutoff, limit=3)
        sizes.append((chunk.jobs, chunk.batch_deleted))
        if not chunk.batch_deleted:
            batch.refresh_from_db()
            left = 7 - sum(n for n, _ in sizes)
            assert batch.total == left
            assert sum(batch.counts()[s] for s in ("done", "failed")) == left
            assert batch.total_ms == 0
            assert_consistent(cutoff)
    assert sizes == [(3, False), (3, False), (1, True)]
    assert rows_of(batch.pk) == GONE
    assert_consistent(cutoff)


def test_the_metric_totals_do_not_go_backwards(worker):
    finished_batch(worker, 3, failed=1)
    young = make_batch(3, name="young")
    job = claim(worker, later(1))
    transitions.complete(job, job.lease_token, worker=worker, result={}, now=later(1))
    job = claim(worker, later(2))
    transitions.fail(
        job, job.lease_token, worker=worker, error="x", retryable=False, now=later(2)
    )
    transitions.retry_failed(Job.objects.filter(pk=job.pk), now=later(3))
    assert young.pk
    now = T0 + 3 * DAY

    def totals():
        counts = fleet.job_counts()
        lines = [
            line
            for line in render(now).decode().splitlines()
            if line.startswith(
                ("recall_jobs_completed_total", "recall_jobs_failed_total")
            )
        ]
        return fleet.finished_totals(counts, fleet.tallies()), lines

    before = totals()
    assert before[0] == (3, 2)  # 2 + 1 completed; 1 failed + 1 failed then retried
    assert purge(older_than=DAY, now=now).jobs == 3
    assert fleet.job_counts()["completed"] == 1
    assert totals() == before


def test_a_batch_reopened_by_retry_after_selection_is_not_purged(worker):
    batch = finished_batch(worker, 3, failed=1)
    cutoff = T0 + DAY
    assert list(purgeable(cutoff)) == [batch]
    transitions.retry_failed(Job.objects.filter(batch=batch), now=later(5))
    before = snapshot(*jobs_of(batch))

    chunk = transitions.purge_batch_chunk(batch.pk, finished_before=cutoff, limit=10)

    assert (chunk.jobs, chunk.batch_deleted, chunk.refused) == (
        0,
        False,
        "not finished",
    )
    assert snapshot(*jobs_of(batch)) == before
    assert_consistent(later(5))


def test_a_batch_with_a_webhook_delivery_pending_waits(worker):
    make_endpoint()
    batch = finished_batch(worker, 2)
    assert WebhookDelivery.objects.get().status == DeliveryStatus.PENDING
    assert purge(older_than=DAY, now=T0 + 2 * DAY).batches == []
    deliver_everything()
    assert purge(older_than=DAY, now=T0 + 2 * DAY).batches == [batch.pk]


def test_the_archive_holds_the_export_and_the_ledger_and_comes_first(worker, tmp_path):
    batch = finished_batch(worker, 3, failed=1)
    exported = list(jsonl_lines(batch))
    leases = list(Lease.objects.filter(job__batch=batch).order_by("job__item_id", "pk"))

    report = purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path)

    path = archive_path(tmp_path, batch.pk)
    assert report.archives == [str(path)]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    with gzip.open(path, "rt", encoding="utf-8") as archived:
        lines = archived.readlines()
    head = json.loads(lines[0])["batch"]
    assert (head["id"], head["name"], head["total"], head["finishes"]) == (
        batch.pk, "old", 3, 1,
    )  # fmt: skip
    assert head["finished_at"] == T0.isoformat()
    assert lines[1:4] == exported
    ledger = [json.loads(line)["lease"] for line in lines[4:]]
    assert [(r["id"], r["job"], r["attempt"], r["worker"], r["end_reason"]) for r in ledger] == [
        (lease.pk, lease.job_id, 1, worker.name, lease.end_reason) for lease in leases
    ]  # fmt: skip
    assert rows_of(batch.pk) == GONE


def test_no_row_goes_when_the_archive_cannot_be_written(worker, tmp_path):
    batch = finished_batch(worker, 2)
    archive_path(tmp_path, batch.pk).mkdir()  # in the way of the file
    before = snapshot(*jobs_of(batch))
    # The archive's name is taken: the purge trusts nothing it did not write
    # (tests/jobs/test_purge_archive_trust.py has the planted files).
    with pytest.raises(ArchiveRefused, match="is already there"):
        purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path)
    assert snapshot(*jobs_of(batch)) == before


def test_a_second_run_stops_at_the_first_runs_archive_until_it_is_moved(
    worker, tmp_path
):
    batch = finished_batch(worker, 5)
    first = purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path, budget=2)
    assert (first.batches, first.unfinished, first.jobs) == ([], [batch.pk], 2)
    assert rows_of(batch.pk)["jobs"] == 3
    # The first run's archive (all 5 items) is not this run's: it stops.
    with pytest.raises(ArchiveRefused, match="move it elsewhere"):
        purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path)
    assert rows_of(batch.pk)["jobs"] == 3
    kept = tmp_path / "kept"
    kept.mkdir()
    archive_path(tmp_path, batch.pk).rename(archive_path(kept, batch.pk))
    second = purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path)
    assert second.batches == [batch.pk]

    def items(directory):
        with gzip.open(archive_path(directory, batch.pk), "rt") as archived:
            return [json.loads(line) for line in archived if '"item"' in line[:8]]

    assert (len(items(kept)), len(items(tmp_path))) == (5, 3)


def test_a_dry_run_reports_and_writes_nothing(worker, tmp_path):
    batch = finished_batch(worker, 3)
    before = snapshot(*jobs_of(batch))
    report = purge(older_than=DAY, now=T0 + 2 * DAY, archive=tmp_path, dry_run=True)
    assert (report.batches, report.jobs) == ([batch.pk], 3)
    assert report.lines() == [
        f"batch {batch.pk} (old): 3 items, finished {T0.isoformat()}",
        f"would delete: 1 batches, 3 items (finished before {(T0 + DAY).isoformat()})",
    ]
    assert snapshot(*jobs_of(batch)) == before
    assert list(tmp_path.iterdir()) == []


def test_the_command_purges_and_prints_a_json_report(worker, tmp_path, capsys):
    batch = finished_batch(worker, 2)  # finished at T0, long before today
    call_command(
        "recall_purge", "--finished-before", "1", "--archive", str(tmp_path / "a")
    )
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert (report["batch_ids"], report["jobs"], report["dry_run"]) == (
        [batch.pk],
        2,
        False,
    )
    assert archive_path(tmp_path / "a", batch.pk).exists()
    assert rows_of(batch.pk) == GONE


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--finished-before", "abc"], "takes a number of days"),
        (["--finished-before", "-1"], "0 or more"),
        (["--finished-before", "nan"], "0 or more"),
        (["--finished-before", "inf"], "0 or more"),
        ([], "--finished-before"),
    ],
)
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("recall_purge", *args)


def test_an_archive_that_is_a_file_is_refused(worker, tmp_path):
    batch = finished_batch(worker, 1)
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(CommandError, match="not a directory"):
        call_command("recall_purge", "--finished-before", "0", "--archive", str(target))
    assert rows_of(batch.pk)["jobs"] == 1


def test_the_sweep_purges_a_bounded_share_when_retention_is_set(worker, settings):
    batch = finished_batch(worker, 6)
    now = T0 + 3 * DAY
    assert "purged" not in sweep(now=now)  # off by default
    assert rows_of(batch.pk)["jobs"] == 6
    settings.RECALL_RETENTION_DAYS = 2
    settings.RECALL_RETENTION_PURGE_PER_SWEEP = 4
    assert sweep(now=now)["purged"] == {"batches": 0, "jobs": 4}
    assert_consistent(now)
    assert sweep(now=now)["purged"] == {"batches": 1, "jobs": 2}
    assert rows_of(batch.pk) == GONE
    settings.RECALL_RETENTION_DAYS = 4
    young = finished_batch(worker, 1, name="young", at=now)
    assert sweep(now=now + DAY)["purged"] == {"batches": 0, "jobs": 0}
    assert rows_of(young.pk)["jobs"] == 1
