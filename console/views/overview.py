"""The overview page: is the whole system healthy right now?

One screen for the fleet: items by state, leases in flight, the oldest
claimable job, throughput over the last hour, leases that ended badly and
repairs, workers and the flaky ones, the open batches with their bars and
ETAs, and the sweeper. The figures are the ones /metrics reports (engine.fleet)
and the batch pages show (engine.progress), read at the database's time; the
live region refreshes like the batch pages' do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from batches.roles import viewer_required
from console.live import fragment
from engine import fleet
from engine.progress import BatchState, chart_geometry, segments, window_text
from jobs import transitions
from jobs.models import item_status_for
from jobs.transitions import rules

# Open batches listed; the batch list has them all.
OPEN_BATCHES_SHOWN = 20


@dataclass(frozen=True)
class Items:
    """Every item of every batch by state, for the segmented bar and legend."""

    counts: dict[str, int]
    silent: int = 0  # of the transcribing, those whose lease is silent

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def segments(self) -> list[tuple[str, int, float]]:
        return segments(self.counts, self.total, self.silent)


def _context(now: datetime) -> dict:
    jobs = fleet.job_counts()
    open_batches = fleet.open_progress(now)
    in_progress = [p for p in open_batches if p.state != BatchState.FINISHED]
    bars = fleet.done_per_minute(now)
    sweep_age = fleet.last_sweep_age(now)
    silent = fleet.silent_leases(now)
    per_minute, rate_seconds = fleet.throughput(now)
    return {
        "now": now,
        "items": Items({item_status_for(job): n for job, n in jobs.items()}, silent),
        "in_flight": jobs["leased"],
        "silent": silent,
        "silent_after": rules.silent_after().total_seconds(),
        "past_expiry": fleet.leases_past_expiry(now),
        "oldest_queued": fleet.oldest_queued_age(now),
        "chart": chart_geometry(bars),
        "per_minute": per_minute,
        "throughput_window": window_text(rate_seconds),
        "endings": fleet.lease_endings(now),
        "repairs": fleet.repairs(now),
        "workers": fleet.worker_states(now),
        "seen_within": fleet.seen_recently().total_seconds(),
        "flaky": fleet.flaky_workers(now),
        "flaky_window": fleet.FLAKY_WINDOW_WORDS,
        "batch_states": fleet.batch_states(now),
        "rows": in_progress[:OPEN_BATCHES_SHOWN],
        "more_batches": max(0, len(in_progress) - OPEN_BATCHES_SHOWN),
        "sweep_age": sweep_age,
        "sweep_stale": sweep_age is None
        or sweep_age > settings.RECALL_READY_MAX_SWEEP_AGE_SECONDS,
        "nav": "overview",
    }


@require_GET
@viewer_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "jobs/overview.html", _context(transitions.now()))


@require_GET
@viewer_required
def overview_live(request: HttpRequest) -> HttpResponse:
    response = render(request, "jobs/_overview_live.html", _context(transitions.now()))
    return fragment(response, final=False)  # the fleet never stops changing
