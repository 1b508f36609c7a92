"""Retention: which batches a purge deletes, in what order, and their archives.

``purge`` serves ``manage.py recall_purge`` and the sweep (when
``RECALL_RETENTION_DAYS`` is set). It picks the batches finished (or
cancelled and settled) before the cutoff, oldest finish first, writes each
one's archive first if asked, and deletes it through the purge transition, a
chunk per transaction, until the batch is gone or the budget (jobs) is spent.
Batches that are not finished are never picked, and the transition checks
again under the batch's lock. A batch with a webhook delivery still pending
waits until the delivery is done or given up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Exists, OuterRef, QuerySet

from batches.models import Batch
from engine.archive import ArchiveRefused, write_archive
from jobs import transitions
from jobs.models import DeliveryStatus, WebhookDelivery

log = logging.getLogger("recall.retention")


@dataclass
class PurgeReport:
    """What a purge deleted (or, dry, would delete)."""

    cutoff: datetime
    dry_run: bool = False
    batches: list[int] = field(default_factory=list)  # deleted (or would be)
    jobs: int = 0  # jobs deleted, each with its item (or would be)
    unfinished: list[int] = field(default_factory=list)  # started, budget spent
    refused: dict[int, str] = field(default_factory=dict)
    archives: list[str] = field(default_factory=list)
    # The SHA-256 of each archive, by path, as written and checked by this run.
    archive_sha256: dict[str, str] = field(default_factory=dict)
    # Why the run stopped before the end (an archive it could not trust).
    stopped: str = ""
    longest_chunk: float = 0.0  # seconds, of the slowest chunk's transaction
    # A dry run's list: {"id", "name", "items", "finished_at"} per batch.
    planned: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "cutoff": self.cutoff.isoformat(),
            "dry_run": self.dry_run,
            "batches": len(self.batches),
            "batch_ids": self.batches,
            "jobs": self.jobs,
            "unfinished": self.unfinished,
            "refused": {str(k): v for k, v in self.refused.items()},
            "archives": self.archives,
            "archive_sha256": self.archive_sha256,
            "stopped": self.stopped,
            "longest_chunk_seconds": round(self.longest_chunk, 3),
        }

    def lines(self) -> list[str]:
        """For people: one line per batch a dry run would delete, then the sum."""
        shown = [
            f"batch {p['id']} ({p['name']}): {p['items']} items, finished "
            f"{p['finished_at']}"
            for p in self.planned
        ]
        verb = "would delete" if self.dry_run else "deleted"
        shown.append(
            f"{verb}: {len(self.batches)} batches, {self.jobs} items "
            f"(finished before {self.cutoff.isoformat()})"
        )
        if self.unfinished:
            shown.append(f"left part-way (budget spent): {self.unfinished}")
        for batch_id, why in self.refused.items():
            shown.append(f"batch {batch_id} left alone: {why}")
        for path, digest in self.archive_sha256.items():
            shown.append(f"archive {path}: sha256 {digest}")
        if self.stopped:
            shown.append(f"stopped: {self.stopped}")
        return shown


def purgeable(finished_before: datetime) -> QuerySet[Batch]:
    """Batches finished before the cutoff with no webhook delivery pending,
    oldest finish first (a read: the purge re-checks each under its lock)."""
    pending = WebhookDelivery.objects.filter(
        event__batch=OuterRef("pk"), status=DeliveryStatus.PENDING
    )
    return (
        Batch.objects.filter(finished_at__lt=finished_before)
        .exclude(Exists(pending))
        .order_by("finished_at", "pk")
    )


def purge(
    *,
    older_than: timedelta,
    now: datetime | None = None,
    archive: Path | None = None,
    dry_run: bool = False,
    budget: int | None = None,
    chunk: int | None = None,
) -> PurgeReport:
    """Delete the batches finished more than ``older_than`` before ``now``.

    ``archive``: write each batch's ``batch-<id>.jsonl.gz`` there before its
    first row is deleted; ``ArchiveRefused`` (with the report so far as its
    ``report``) stops the run if that name is already taken. ``budget``:
    delete at most this many jobs (the sweep's bounded share; a batch left
    part-way is finished next time).
    ``dry_run``: only report what would go.
    """
    now = transitions.now() if now is None else now
    chunk = settings.RECALL_CHUNK_SIZE if chunk is None else chunk
    report = PurgeReport(cutoff=now - older_than, dry_run=dry_run)
    for batch in purgeable(report.cutoff):
        if dry_run:
            report.batches.append(batch.pk)
            report.jobs += batch.total
            report.planned.append(
                {
                    "id": batch.pk,
                    "name": batch.name,
                    "items": batch.total,
                    "finished_at": batch.finished_at and batch.finished_at.isoformat(),
                }
            )
            continue
        if budget is not None and budget - report.jobs <= 0:
            break
        if archive is not None:
            try:
                written = write_archive(batch, archive)
            except ArchiveRefused as refused:
                # Nothing of this batch is deleted, nor of any after it.
                report.stopped = str(refused)
                refused.report = report
                log.error("purge stopped: %s", refused)
                raise
            report.archives.append(str(written.path))
            report.archive_sha256[str(written.path)] = written.sha256
            log.info(
                "purge: archive %s written, %d bytes, sha256 %s",
                written.path,
                written.size,
                written.sha256,
            )
        _purge_batch(batch.pk, report, budget=budget, chunk=chunk)
    if report.batches or report.unfinished:
        log.info(
            "purge: %d batches and %d jobs finished before %s deleted",
            len(report.batches),
            report.jobs,
            report.cutoff.isoformat(),
        )
    return report


def _purge_batch(
    batch_id: int, report: PurgeReport, *, budget: int | None, chunk: int
) -> None:
    while True:
        limit = chunk
        if budget is not None:
            left = budget - report.jobs
            if left <= 0:
                report.unfinished.append(batch_id)
                return
            limit = min(limit, left)
        started = time.perf_counter()
        purged = transitions.purge_batch_chunk(
            batch_id, finished_before=report.cutoff, limit=limit
        )
        report.longest_chunk = max(report.longest_chunk, time.perf_counter() - started)
        report.jobs += purged.jobs
        if purged.refused:
            report.refused[batch_id] = purged.refused
            return
        if purged.batch_deleted:
            report.batches.append(batch_id)
            return
