"""The sweep: reclaim expired leases, reconcile, settle finished batches.

One function serves the django-q2 schedule (``jobs.tasks.sweep``), the
``recall_sweep`` command and start-up. It is safe to run several at once:
reclaiming locks jobs with SKIP LOCKED, so no lease is reclaimed twice, and the
reconcile part runs under a lock of its own (a lease on ``SweepState``) so two
sweeps do not scan the same rows.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from batches.models import Batch, BatchMinute

from .models import Job, SweepState
from .reconcile import reconcile

log = logging.getLogger("recall.sweep")

# How long one sweep may hold the reconcile lock before another may take it.
LOCK_TTL = timedelta(minutes=5)


def sweep(*, now: datetime | None = None, full: bool = False) -> dict:
    """One pass; returns a report of counts (also stored for /readyz and the UI).

    ``full`` scans every job and recounts every batch's counters (start-up and
    on demand); otherwise the job scan is bounded by
    ``RECALL_RECONCILE_SCAN_PER_SWEEP``.
    """
    started = timezone.now()
    now = now or started
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    report: dict = {"reclaimed": Job.objects.reclaim_expired(now=now)}
    if not SweepState.acquire(owner, now=now, ttl=LOCK_TTL):
        report["reconcile"] = "skipped: another sweep is reconciling"
        return report
    try:
        budget = settings.RECALL_RECONCILE_SCAN_PER_SWEEP or None
        healed = reconcile(now=now, scan_budget=None if full else budget, recount=full)
        report["reconcile"] = healed.as_dict()
        report["batches_finished"] = Batch.objects.settle(now=now)
        retention = timedelta(hours=settings.RECALL_THROUGHPUT_RETENTION_HOURS)
        BatchMinute.objects.filter(minute__lt=now - retention).delete()
        SweepState.objects.filter(pk=SweepState.SINGLETON).update(
            last_started_at=now,
            last_finished_at=now + (timezone.now() - started),
            last_report=report,
        )
    finally:
        SweepState.release(owner)
    log.info("sweep: %s", report)
    return report
