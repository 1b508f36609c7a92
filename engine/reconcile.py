"""Reconciliation: compare the records with reality and heal the difference.

Every transition is atomic, so a crash inside one leaves nothing half-written.
What atomicity cannot cover is work split over several transactions (a bulk
cancel interrupted part-way), rows changed behind Recall's back (a manual SQL
edit, a restored backup, an older release), and bugs. This module finds such
mismatches and heals each one in a short transaction of its own, through the
repairs in ``jobs.transitions``; every repair is logged (``Event`` row, WARNING
line, and the repairs tally).

It runs:

* on every claim: the claim itself (``jobs.transitions.claim_next``) reclaims
  expired leases first, finishes a chunk of an interrupted batch cancel, and
  heals the rows it touches (index lookups only);
* in every sweep: ``reconcile`` over the live rows (leases, in-flight items,
  open ledger rows) plus a bounded slice of a rotating scan of all jobs;
* at start-up and on demand (``recall_sweep --full``): everything, including a
  recount of every batch's progress counters.

A repair that finds an item in an unexpected status cannot know whether the
counters saw that change, so it asks for a recount of the batch
(``recount_requested_at``), which the next sweep performs.

The job row is the authority: repairs bring items, ledger rows, counters and
batch flags in line with it, and never change a job's status, except to finish
what an operator already asked for (an interrupted cancel) or to fail a queued
job that has no attempts left and so could never run.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime

from django.db.models import Exists, F, Max, OuterRef, Q

from batches.models import Batch, ItemStatus
from jobs import transitions
from jobs.models import Job, JobStatus, Lease, SweepState, agreeing_item_status

log = logging.getLogger("recall.reconcile")

# Rows of the jobs table one query of the rotating scan covers.
SCAN_WINDOW = 5_000


@dataclass
class ReconcileReport:
    items_healed: int = 0
    leases_closed: int = 0
    leases_restored: int = 0
    exhausted_failed: int = 0
    cancels_finished: int = 0
    batches_reopened: int = 0
    counters_fixed: int = 0
    jobs_scanned: int = 0  # jobs covered by the rotating scan

    @property
    def repairs(self) -> int:
        return sum(v for k, v in asdict(self).items() if k != "jobs_scanned")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def reconcile(
    *, now: datetime, scan_budget: int | None = None, recount: bool = False
) -> ReconcileReport:
    """Heal every mismatch this pass can see; return what was healed.

    ``scan_budget`` bounds the rotating scan of the whole jobs table to that many
    job ids, continuing from where the previous pass stopped (None: scan all).
    ``recount`` also recounts every batch's progress counters (slow on big
    batches: start-up and on demand only).
    """
    report = ReconcileReport()
    _heal_live_rows(report, now=now)
    for batch_id in Batch.objects.filter(
        cancelled_at__isnull=False, finished_at__isnull=True
    ).values_list("pk", flat=True):
        report.cancels_finished += transitions.finish_cancel(batch_id, now=now)
    _scan_jobs(report, now=now, budget=scan_budget)
    batches = Batch.objects.all()
    if not recount:
        batches = batches.filter(recount_requested_at__isnull=False)
    for batch_id, requested_at in batches.values_list("pk", "recount_requested_at"):
        report.counters_fixed += transitions.recount(
            batch_id, now=now, requested_at=requested_at
        )
    if report.repairs:
        log.warning("reconcile healed: %s", report.as_dict())
    return report


def _heal_live_rows(report: ReconcileReport, *, now: datetime) -> None:
    """Leased jobs, transcribing items and open ledger rows: all of them."""
    leased = Job.objects.filter(status=JobStatus.LEASED)
    disagreeing = list(
        leased.exclude(item__status=ItemStatus.TRANSCRIBING).values_list(
            "pk", flat=True
        )
    ) + list(
        Job.objects.filter(item__status=ItemStatus.TRANSCRIBING)
        .exclude(status=JobStatus.LEASED)
        .values_list("pk", flat=True)
    )
    for job_id in disagreeing:
        report.items_healed += transitions.heal_item(job_id, now=now)

    stray = (
        Lease.objects.filter(ended_at__isnull=True)
        .exclude(job__status=JobStatus.LEASED, job__lease_token=F("token"))
        .values_list("job_id", flat=True)
        .distinct()
    )
    for job_id in list(stray):
        report.leases_closed += transitions.close_stray_leases(job_id, now=now)

    unrecorded = leased.exclude(
        Exists(
            Lease.objects.filter(token=OuterRef("lease_token"), ended_at__isnull=True)
        )
    ).values_list("pk", flat=True)
    for job_id in list(unrecorded):
        report.leases_restored += transitions.restore_lease_row(job_id, now=now)


def _scan_jobs(report: ReconcileReport, *, now: datetime, budget: int | None) -> None:
    """Check every job against its item and batch, SCAN_WINDOW jobs at a time.

    With a budget (in jobs), the scan resumes where the last pass stopped and
    wraps around, so each sweep stays bounded and every job is still checked
    every few sweeps.
    """
    top = Job.objects.aggregate(top=Max("pk"))["top"] or 0
    cursor = sweep_state().scan_cursor if budget is not None else 0
    if cursor >= top:
        cursor = 0
    while cursor < top and (budget is None or report.jobs_scanned < budget):
        after = (
            Job.objects.filter(pk__gt=cursor)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        boundary = list(after[SCAN_WINDOW - 1 : SCAN_WINDOW])
        hi = boundary[0] if boundary else top
        window = Job.objects.filter(pk__gt=cursor, pk__lte=hi)
        suspects = window.filter(
            ~agreeing_item_status()
            | Q(status=JobStatus.QUEUED, attempts__gte=F("max_attempts"))
            | Q(
                status__in=[JobStatus.QUEUED, JobStatus.LEASED],
                batch__finished_at__isnull=False,
            )
        ).values_list("pk", flat=True)
        for job_id in list(suspects):
            _heal_scanned(report, job_id, now=now)
        report.jobs_scanned += SCAN_WINDOW if boundary else window.count()
        cursor = hi
    if budget is not None:
        SweepState.objects.filter(pk=SweepState.SINGLETON).update(
            scan_cursor=0 if cursor >= top else cursor
        )


def _heal_scanned(report: ReconcileReport, job_id: int, *, now: datetime) -> None:
    report.items_healed += transitions.heal_item(job_id, now=now)
    report.exhausted_failed += transitions.fail_exhausted(job_id, now=now)
    report.batches_reopened += transitions.reopen_batch_of(job_id, now=now)


def sweep_state() -> SweepState:
    """The sweep's single state row (created on first use)."""
    state, _ = SweepState.objects.get_or_create(pk=SweepState.SINGLETON)
    return state
