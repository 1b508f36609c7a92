"""The workers page: who is working, on what, and how reliably."""

from __future__ import annotations

from django.db.models import Count, OuterRef, Prefetch, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from batches.roles import viewer_required
from engine import fleet
from engine.fleet import expired_share, is_flaky
from jobs import transitions
from jobs.models import Job, JobStatus, Lease, LeaseEnd, Worker
from jobs.transitions import rules


def _ended(reason: str):
    return Coalesce(
        Subquery(
            Lease.objects.filter(worker=OuterRef("pk"), end_reason=reason)
            .order_by()
            .values("worker")
            .annotate(n=Count("pk"))
            .values("n")
        ),
        0,
    )


@require_GET
@viewer_required
def worker_list(request: HttpRequest) -> HttpResponse:
    """Each worker with its live leases and how its past leases ended; a box
    whose leases keep expiring stands out."""
    workers = (
        Worker.objects.annotate(
            completed=_ended(LeaseEnd.COMPLETED),
            expired=_ended(LeaseEnd.EXPIRED),
            failed=_ended(LeaseEnd.FAILED),
            lease_count=Coalesce(
                Subquery(
                    Lease.objects.filter(worker=OuterRef("pk"))
                    .order_by()
                    .values("worker")
                    .annotate(n=Count("pk"))
                    .values("n")
                ),
                0,
            ),
        )
        .prefetch_related(
            Prefetch(
                "current_jobs",
                queryset=Job.objects.filter(status=JobStatus.LEASED)
                .select_related("item", "batch")
                .order_by("pk"),
            )
        )
        .order_by("-is_active", "name")
    )
    now = transitions.now()
    recent = fleet.recent_incidents(now)
    rows = []
    for worker in workers:
        ended = worker.lease_count - len(worker.current_jobs.all())
        rows.append(
            {
                "worker": worker,
                "expired_share": expired_share(worker.expired, ended),
                "incidents": recent.get(worker.pk, 0),
                "flaky": is_flaky(worker.expired, ended, recent.get(worker.pk, 0)),
            }
        )
    return render(
        request,
        "jobs/workers.html",
        {
            "rows": rows,
            "now": now,
            "nav": "workers",
            "flaky_incidents": fleet.FLAKY_INCIDENTS,
            "flaky_window": fleet.FLAKY_WINDOW_WORDS,
            "lease_seconds": rules.lease_duration().total_seconds(),
            "flaky_min_expired": fleet.FLAKY_MIN_EXPIRED,
            "flaky_share": fleet.FLAKY_SHARE,
        },
    )
