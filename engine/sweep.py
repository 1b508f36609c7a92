"""The sweep: reclaim expired leases, reconcile, settle finished batches, queue
stranded background intakes again (and, with ``RECALL_RETENTION_DAYS``, purge a
bounded share of old ones).

One function serves the django-q2 schedule (``engine.tasks.sweep``), the
``recall_sweep`` command and start-up. It is safe to run several at once:
reclaiming locks jobs with SKIP LOCKED, so no lease is reclaimed twice, and the
reconcile part runs under a lock of its own (a lease on ``SweepState``, timed
by the database's clock) so two sweeps do not scan the same rows.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q

from engine.background_intake import requeue_stranded
from engine.reconcile import reconcile, sweep_state
from engine.retention import purge
from jobs import transitions
from jobs.models import SweepState

log = logging.getLogger("recall.sweep")

# How long one sweep may hold the reconcile lock before another may take it.
LOCK_TTL = timedelta(minutes=5)


def sweep(*, now: datetime | None = None, full: bool = False) -> dict[str, Any]:
    """One pass; returns a report of counts (also stored for /readyz and the UI).

    ``full`` scans every job and recounts every batch's counters (start-up and
    on demand); otherwise the job scan is bounded by
    ``RECALL_RECONCILE_SCAN_PER_SWEEP``.
    """
    started = time.monotonic()
    now = transitions.now() if now is None else now
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    report: dict[str, Any] = {"reclaimed": transitions.reclaim_expired(now=now)}
    if not acquire_lock(owner, now=now, ttl=LOCK_TTL):
        report["reconcile"] = "skipped: another sweep is reconciling"
        return report
    try:
        budget = settings.RECALL_RECONCILE_SCAN_PER_SWEEP or None
        healed = reconcile(now=now, scan_budget=None if full else budget, recount=full)
        report["reconcile"] = healed.as_dict()
        report["batches_finished"] = transitions.settle(now=now)
        report["intakes_requeued"] = len(requeue_stranded(now=now))
        retention = timedelta(hours=settings.RECALL_THROUGHPUT_RETENTION_HOURS)
        transitions.drop_throughput(before=now - retention)
        if settings.RECALL_RETENTION_DAYS is not None:
            purged = purge(
                older_than=timedelta(days=settings.RECALL_RETENTION_DAYS),
                now=now,
                budget=settings.RECALL_RETENTION_PURGE_PER_SWEEP,
            )
            report["purged"] = {"batches": len(purged.batches), "jobs": purged.jobs}
        SweepState.objects.filter(pk=SweepState.SINGLETON).update(
            last_started_at=now,
            last_finished_at=now + timedelta(seconds=time.monotonic() - started),
            last_report=report,
        )
    finally:
        release_lock(owner)
    log.info("sweep: %s", report)
    return report


def acquire_lock(owner: str, *, now: datetime, ttl: timedelta) -> bool:
    """Take (or extend) the reconcile lock unless another owner holds it."""
    sweep_state()
    return bool(
        SweepState.objects.filter(pk=SweepState.SINGLETON)
        .filter(
            Q(locked_until__isnull=True) | Q(locked_until__lt=now) | Q(locked_by=owner)
        )
        .update(locked_until=now + ttl, locked_by=owner)
    )


def release_lock(owner: str) -> None:
    SweepState.objects.filter(pk=SweepState.SINGLETON, locked_by=owner).update(
        locked_until=None, locked_by=""
    )
