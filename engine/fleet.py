"""The whole fleet right now: read-only queries behind /metrics and the overview.

Every figure comes from the database, so every process on every web node gives
the same answer. Each read is a handful of index probes or a sum over the
sharded counter rows, never a count over the jobs or items of a big batch:
a Prometheus scrape and the overview page (refreshed every few seconds by each
open tab) must stay cheap with millions of jobs. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Exists, Min, OuterRef, Q, Subquery, Sum

from batches.models import Batch, BatchCounter, BatchMinute
from engine.progress import (
    CHART_WINDOW,
    BatchState,
    Progress,
    chart_bars,
    count_states,
    minute_floor,
    progress_for_many,
    throughput_per_minute,
    window_seconds,
)
from engine.waiting import Offers, seen_recently
from jobs import transitions
from jobs.models import (
    ITEM_STATUS_FOR_JOB,
    Event,
    Job,
    JobStatus,
    Lease,
    LeaseEnd,
    SweepState,
    Tally,
    Worker,
)
from jobs.transitions import rules

# The workers page flags a worker "flaky" when its leases ran out at
# FLAKY_INCIDENTS separate times within FLAKY_WINDOW (leases that run out within
# one lease length of each other are one incident: one crash takes all the
# leases a worker holds); or, over its whole history, when at least
# FLAKY_MIN_EXPIRED of its leases expired and they are at least FLAKY_SHARE
# percent of its finished leases. The first catches a box that crashes every
# few minutes however much it completes in between (the demo's gpu-flaky, killed
# every 45 s, at its third kill); a healthy worker has no expired leases, and
# one outage that expires all of a worker's leases at once is one incident.
FLAKY_INCIDENTS = 3
FLAKY_WINDOW = timedelta(hours=1)
FLAKY_WINDOW_WORDS = "the last hour"  # FLAKY_WINDOW, as the pages say it
FLAKY_MIN_EXPIRED = 3
FLAKY_SHARE = 20


class WorkerState:
    BUSY = "busy"  # holds a live lease
    IDLE = "idle"  # active, no lease, called the API recently
    OFFLINE = "offline"  # the rest: disabled, never seen, or silent too long

    ALL = (BUSY, IDLE, OFFLINE)


# --- Jobs and batches ---------------------------------------------------------------


def job_counts() -> dict[str, int]:
    """Jobs per status. From the counter rows (16 per batch), which every
    transition keeps equal to the items per status, and an item's status is a
    function of its job's: no scan of the jobs."""
    sums = BatchCounter.objects.aggregate(
        **{item: Sum(item) for item in ITEM_STATUS_FOR_JOB.values()}
    )
    return {str(job): sums[str(item)] or 0 for job, item in ITEM_STATUS_FOR_JOB.items()}


def tallies() -> dict[str, int]:
    """Every tally the transitions keep (``jobs.models.Tally``): what they did
    since the beginning, by name. A handful of rows."""
    return dict(Tally.objects.values_list("name", "count"))


def finished_totals(counts: dict[str, int], tally: dict[str, int]) -> tuple[int, int]:
    """(jobs ever completed, jobs ever failed for good). The counters hold the
    jobs done and failed now; a failed job queued again by *retry failed* or
    a finished one by a *re-run*, and
    a finished job deleted by a purge (retention), are kept in tallies, so the
    totals only ever grow."""
    completed = (
        counts[JobStatus.COMPLETED]
        + tally.get("jobs_completed_rerun", 0)
        + tally.get("jobs_completed_purged", 0)
    )
    failed = (
        counts[JobStatus.FAILED]
        + tally.get("jobs_failed_retried", 0)
        + tally.get("jobs_failed_purged", 0)
    )
    return completed, failed


def unsettled_batches():
    """Batches that are neither cancelled nor marked finished by the sweep, by
    priority then age: the only ones whose state can be anything but
    cancelled or finished."""
    return Batch.objects.filter(
        cancelled_at__isnull=True, finished_at__isnull=True
    ).order_by("-priority", "pk")


def batch_states(now: datetime) -> dict[str, int]:
    """Batches per state, in the operator UI's words and by its rules (those
    the batch list filters by: ``engine.progress.in_state``). A cancelled
    batch is cancelled; one the sweep marked finished has nothing queued or in
    flight (the sweep checks that under the batch's lock, and a retry unmarks
    it under the same lock); only the others are looked at: two queries."""
    counts = dict.fromkeys(BatchState.ALL, 0)
    flags = Batch.objects.aggregate(
        cancelled=Count("pk", filter=Q(cancelled_at__isnull=False)),
        finished=Count(
            "pk", filter=Q(cancelled_at__isnull=True, finished_at__isnull=False)
        ),
    )
    counts[BatchState.CANCELLED] = flags["cancelled"]
    counts[BatchState.FINISHED] = flags["finished"]
    for state, n in count_states(unsettled_batches(), now=now).items():
        counts[state] += n
    return counts


def open_progress(now: datetime, offers: Offers | None = None) -> list[Progress]:
    """Progress of the unsettled batches, by priority then age."""
    batches = list(unsettled_batches())
    progress = progress_for_many(batches, now=now, offers=offers)
    return [progress[b.pk] for b in batches]


def waiting_for_worker(now: datetime, offers: Offers | None = None) -> int:
    """How many batches wait for a worker (``engine.waiting``): open, with
    queued items, and no worker online offers what they require. One query
    groups those batches by requirement set (an index probe of the counter
    rows per open batch), one more reads the labels of the workers online;
    each distinct set is judged once."""
    offers = Offers(now) if offers is None else offers
    queued = BatchCounter.objects.filter(batch=OuterRef("pk"), queued__gt=0)
    groups = (
        Batch.objects.open()
        .filter(Exists(queued))
        .values("requires")
        .annotate(n=Count("pk"))
        .values_list("requires", "n")
        .order_by()
    )
    return sum(
        n
        for requires, n in groups
        if offers.waiting_for(requires if isinstance(requires, dict) else {})
        is not None
    )


def oldest_queued_age(now: datetime) -> float:
    """Seconds since the oldest claimable job was created; 0 when none is.

    Claimable: queued, due (``available_at``), attempts left, in an open batch
    (not paused, cancelled or finished). Claims take each batch's jobs in
    (created_at, id) order, so its oldest claimable job is the first one the
    claim index gives: one index probe per open batch, as a claim does.
    """
    head = (
        Job.objects.claimable(now)
        .filter(batch=OuterRef("pk"))
        .order_by("created_at", "pk")
        .values("created_at")[:1]
    )
    oldest = (
        Batch.objects.open()
        .annotate(head=Subquery(head))
        .aggregate(oldest=Min("head"))["oldest"]
    )
    return max(0.0, (now - oldest).total_seconds()) if oldest else 0.0


def silent_leases(now: datetime) -> int:
    """Live leases whose worker has not heartbeated for two heartbeat
    intervals (``rules.silent_after``): shown apart from transcribing. The
    live leases only (the lease-expiry index holds them)."""
    return Job.objects.filter(
        status=JobStatus.LEASED, heartbeat_at__lt=now - rules.silent_after()
    ).count()


def throughput(now: datetime) -> tuple[float, float]:
    """(items done per minute, over how many seconds), all batches, over the
    last hour (the chart's window) or since the first batch was created if
    that is less: the batch pages' figure (``engine.progress``'s
    ``throughput_per_minute``, whose windows are capped the same way)."""
    start = minute_floor(now - CHART_WINDOW)
    first = Batch.objects.order_by("pk").values_list("created_at", flat=True).first()
    seconds = window_seconds(now, start, first or now)
    done = BatchMinute.objects.filter(minute__gte=start).aggregate(n=Sum("done"))["n"]
    return throughput_per_minute(done or 0, seconds), seconds


def leases_past_expiry(now: datetime) -> int:
    """Live leases whose expiry has passed: the next claim or sweep reclaims
    them (the reclaim index holds only leased jobs)."""
    return Job.objects.expired(now).count()


# --- Workers ------------------------------------------------------------------------


def worker_states(now: datetime) -> dict[str, int]:
    """Workers per state: busy, idle, offline (see ``WorkerState``).

    Busy means holding a live lease, as the rest of Recall counts it: a lease
    stays live until it is reclaimed, even after its expiry. Two queries: the
    holders from the live leases' index, the recently seen from the workers.
    """
    busy = (
        Job.objects.filter(leased_by__isnull=False)
        .values("leased_by")
        .distinct()
        .count()
    )
    counts = Worker.objects.aggregate(
        total=Count("pk"),
        idle=Count(
            "pk",
            filter=Q(is_active=True, last_seen__gte=now - seen_recently())
            & ~Q(Exists(Job.objects.filter(leased_by=OuterRef("pk")))),
        ),
    )
    return {
        WorkerState.BUSY: busy,
        WorkerState.IDLE: counts["idle"],
        WorkerState.OFFLINE: counts["total"] - busy - counts["idle"],
    }


def expired_share(expired: int, ended: int) -> int:
    """Expired leases as a percentage of a worker's finished leases."""
    return round(100 * expired / ended) if ended > 0 else 0


def incidents(expiries: list[datetime], apart: timedelta) -> int:
    """How many separate times leases ran out: an expiry more than ``apart``
    after the first of the current incident starts a new one."""
    count, first = 0, None
    for moment in sorted(expiries):
        if first is None or moment - first > apart:
            count, first = count + 1, moment
    return count


def is_flaky(expired: int, ended: int, recent_incidents: int = 0) -> bool:
    """A worker whose leases keep running out (crashes, power, network): see
    ``FLAKY_INCIDENTS``."""
    return recent_incidents >= FLAKY_INCIDENTS or (
        expired >= FLAKY_MIN_EXPIRED and expired_share(expired, ended) >= FLAKY_SHARE
    )


def recent_incidents(now: datetime) -> dict[int, int]:
    """Worker id -> incidents of expired leases reclaimed in the last
    ``FLAKY_WINDOW``, grouped by when the leases ran out (``expires_at``).
    The ledger's index on abnormal endings: a few rows an hour."""
    expiries: dict[int, list[datetime]] = {}
    for worker_id, expires_at, ended_at in Lease.objects.filter(
        end_reason=LeaseEnd.EXPIRED, ended_at__gte=now - FLAKY_WINDOW
    ).values_list("worker", "expires_at", "ended_at"):
        moment = expires_at or ended_at
        if moment is not None:
            expiries.setdefault(worker_id, []).append(moment)
    apart = rules.lease_duration()
    return {pk: incidents(times, apart) for pk, times in expiries.items()}


@dataclass(frozen=True)
class FlakyWorker:
    worker: Worker
    expired: int
    ended: int
    incidents: int = 0  # in the last FLAKY_WINDOW

    @property
    def share(self) -> int:
        return expired_share(self.expired, self.ended)


def flaky_workers(now: datetime | None = None) -> list[FlakyWorker]:
    """The workers the workers page flags flaky, most expired leases first.

    Only workers with enough expired leases to qualify are looked at further
    (expired rows are few, and indexed), so the ledger's millions of completed
    rows are counted for those few workers only. ``now``: the database's
    clock unless given.
    """
    recent = recent_incidents(transitions.now() if now is None else now)
    expired = dict(
        Lease.objects.filter(end_reason=LeaseEnd.EXPIRED)
        .values("worker")
        .annotate(n=Count("pk"))
        .filter(n__gte=FLAKY_MIN_EXPIRED)
        .values_list("worker", "n")
        .order_by()
    )
    if not expired:
        return []
    ended = dict(
        Lease.objects.filter(worker__in=expired, ended_at__isnull=False)
        .values("worker")
        .annotate(n=Count("pk"))
        .values_list("worker", "n")
        .order_by()
    )
    workers = Worker.objects.in_bulk(list(expired))
    flaky = [
        FlakyWorker(workers[pk], n, ended.get(pk, 0), recent.get(pk, 0))
        for pk, n in expired.items()
        if is_flaky(n, ended.get(pk, 0), recent.get(pk, 0))
    ]
    return sorted(flaky, key=lambda f: (-f.expired, f.worker.name))


# --- History ------------------------------------------------------------------------


def lease_endings(now: datetime) -> dict[str, dict[str, int]]:
    """Leases that ended ``expired`` or ``forced`` in the last hour and day
    (the ledger's partial index on abnormal endings: migration jobs/0006)."""
    hour, day = now - timedelta(hours=1), now - timedelta(days=1)
    counts = Lease.objects.filter(
        end_reason__in=[LeaseEnd.EXPIRED, LeaseEnd.FORCED], ended_at__gte=day
    ).aggregate(
        **{
            f"{reason}_{window}": Count(
                "pk", filter=Q(end_reason=reason, ended_at__gte=since)
            )
            for reason in (LeaseEnd.EXPIRED, LeaseEnd.FORCED)
            for window, since in (("hour", hour), ("day", day))
        }
    )
    return {
        str(reason): {w: counts[f"{reason}_{w}"] for w in ("hour", "day")}
        for reason in (LeaseEnd.EXPIRED, LeaseEnd.FORCED)
    }


def repairs(now: datetime) -> dict[str, int]:
    """Reconciliation repairs logged in the last hour and day."""
    hour, day = now - timedelta(hours=1), now - timedelta(days=1)
    return (
        Event.objects.repairs()
        .filter(created_at__gte=day)
        .aggregate(hour=Count("pk", filter=Q(created_at__gte=hour)), day=Count("pk"))
    )


def done_per_minute(now: datetime) -> list[tuple[datetime, int]]:
    """Items done per minute over the last hour, all batches, oldest first
    (the per-minute finish rows the batch pages' chart reads)."""
    rows = (
        BatchMinute.objects.filter(minute__gte=minute_floor(now - CHART_WINDOW))
        .values("minute")
        .annotate(done=Sum("done"))
        .values_list("minute", "done")
        .order_by()
    )
    minutes = int(CHART_WINDOW.total_seconds() // 60)
    return chart_bars(dict(rows), now, minutes)


def last_sweep_age(now: datetime) -> float | None:
    """Seconds since the last sweep finished; None if none ever did."""
    finished = (
        SweepState.objects.filter(pk=SweepState.SINGLETON)
        .values_list("last_finished_at", flat=True)
        .first()
    )
    return None if finished is None else max(0.0, (now - finished).total_seconds())
