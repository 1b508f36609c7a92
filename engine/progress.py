"""What operators see of a batch: counts, state, throughput and ETA.

The numbers come from records the transitions keep exact in their own
transactions (the sharded counters and the per-minute finish buckets), and from
the live leases; the maths is in pure functions below, tested without a
database. Reads are a handful of indexed queries, whatever the batch's size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import (
    BooleanField,
    Count,
    Exists,
    ExpressionWrapper,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce

from batches.labels import format_pairs
from batches.models import Batch, BatchCounter, BatchMinute, ItemStatus
from engine.waiting import Offers, seen_recently
from jobs.models import Job, JobStatus
from jobs.transitions.rules import silent_after

# The ETA's rate is measured over this recent window.
RATE_WINDOW = timedelta(minutes=10)
# The throughput chart covers this much history, one bar per minute.
CHART_WINDOW = timedelta(hours=1)


class BatchState:
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    STALLED = "stalled"

    ALL = (RUNNING, PAUSED, FINISHED, CANCELLED, STALLED)


# --- Pure functions ---------------------------------------------------------------


def batch_state(
    *, cancelled: bool, paused: bool, remaining: int, in_flight: int, stalled: bool
) -> str:
    """One word for the batch. Cancelled and finished win over paused."""
    if cancelled:
        return BatchState.CANCELLED
    if remaining == 0:
        return BatchState.FINISHED
    if paused:
        return BatchState.PAUSED
    if stalled and in_flight:
        return BatchState.STALLED
    return BatchState.RUNNING


def is_stalled(
    *, in_flight: int, last_activity: datetime | None, now: datetime, after: timedelta
) -> bool:
    """Items are in flight but nothing completed or heartbeated for ``after``."""
    return in_flight > 0 and (last_activity is None or now - last_activity > after)


def rate_per_second(finished: float, seconds: float) -> float | None:
    """Finished units per second over a window, or None when nothing finished."""
    if seconds <= 0 or finished <= 0:
        return None
    return finished / seconds


def eta_seconds(remaining: float, rate: float | None) -> int | None:
    """Seconds until ``remaining`` units are finished at ``rate`` units/second.

    0 when nothing remains; None when the rate is unknown (no recent
    throughput). Never negative, never infinite.
    """
    if remaining <= 0:
        return 0
    if not rate or rate <= 0 or not math.isfinite(rate):
        return None
    return max(0, math.ceil(remaining / rate))


def percent(part: int, total: int) -> float:
    return round(100 * part / total, 1) if total > 0 else 0.0


def throughput_per_minute(finished: float, seconds: float) -> float:
    """Items per minute, to one decimal, over a window of ``seconds``: the one
    throughput figure every page shows (0.0 when nothing finished)."""
    rate = rate_per_second(finished, seconds)
    return round(rate * 60, 1) if rate else 0.0


def window_text(seconds: float) -> str:
    """The window a throughput figure is measured over, in words."""
    if seconds // 60 == 60:
        return "last hour"
    return f"last {format_duration(seconds)}"


def run_text(seconds: float) -> str:
    """The window of a finished batch's throughput: its whole run."""
    return f"average over its {format_duration(seconds)} run"


# Items whose lease is silent: in the transcribing state, but the worker has
# not heartbeated for two heartbeat intervals (jobs.transitions.rules.silent_after).
SILENT = "silent"

# The segmented bar's order: finished first, then in flight, waiting, cancelled.
SEGMENT_ORDER = (
    ItemStatus.DONE,
    ItemStatus.FAILED,
    ItemStatus.TRANSCRIBING,
    SILENT,
    ItemStatus.QUEUED,
    ItemStatus.CANCELLED,
)


def apart_silent(counts: dict[str, int], silent: int) -> dict[str, int]:
    """Item counts as shown: the silent leases apart from transcribing."""
    silent = min(max(silent, 0), counts[ItemStatus.TRANSCRIBING])
    return {
        **counts,
        ItemStatus.TRANSCRIBING: counts[ItemStatus.TRANSCRIBING] - silent,
        SILENT: silent,
    }


def segments(
    counts: dict[str, int], total: int, silent: int = 0
) -> list[tuple[str, int, float]]:
    """(status, count, percent of total) for a segmented bar of items, silent
    leases apart from transcribing (and listed only when there are some)."""
    shown = apart_silent(counts, silent)
    return [
        (s, shown[s], percent(shown[s], total))
        for s in SEGMENT_ORDER
        if s != SILENT or shown[s]
    ]


def is_silent(heartbeat_at: datetime | None, now: datetime, after: timedelta) -> bool:
    """A live lease whose worker has not heartbeated for ``after``."""
    return heartbeat_at is not None and now - heartbeat_at > after


def bar_geometry(segments: list[tuple[str, int, float]]) -> list[dict]:
    """The non-empty segments with where each starts (x) and how wide it is,
    in percent of the bar: geometry for an SVG, which needs no inline style."""
    x, bar = 0.0, []
    last = max((i for i, (_, count, _) in enumerate(segments) if count), default=-1)
    for i, (status, count, pct) in enumerate(segments):
        if count:
            # The percentages are rounded: the last segment ends the bar.
            width = 100.0 - x if i == last else pct
            bar.append({"status": status, "count": count, "x": x, "width": width})
            x += pct
    return bar


def window_seconds(
    now: datetime, window_start: datetime, created_at: datetime
) -> float:
    """Length of the rate window: no longer than the batch has existed."""
    return (now - max(window_start, created_at)).total_seconds()


def minute_floor(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def chart_bars(
    done_by_minute: dict[datetime, int], now: datetime, minutes: int
) -> list[tuple[datetime, int]]:
    """(minute, items done) for each of the last ``minutes`` minutes, oldest first."""
    last = minute_floor(now)
    return [
        (m, done_by_minute.get(m, 0))
        for m in (last - timedelta(minutes=i) for i in range(minutes - 1, -1, -1))
    ]


def chart_geometry(bars: list[tuple[datetime, int]]) -> dict:
    """Geometry of the throughput chart (an inline SVG, one bar per minute)."""
    width, height, gap = 600, 120, 2
    top = max((n for _, n in bars), default=0)
    bar = width / max(len(bars), 1)
    return {
        "width": width,
        "height": height,
        "top": top,
        "total": sum(n for _, n in bars),
        "bars": [
            {
                "x": round(i * bar, 1),
                "w": round(bar - gap, 1),
                "h": round(height * n / top, 1) if top else 0,
                "y": round(height - (height * n / top), 1) if top else height,
                "n": n,
                "minute": minute,
            }
            for i, (minute, n) in enumerate(bars)
        ],
    }


def format_duration(seconds: float | None) -> str:
    """'2 h 05 min', '7 min', '40 s'; 'unknown' for None."""
    if seconds is None:
        return "unknown"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def waiting_text(unoffered: Mapping[str, str], seen_within: timedelta) -> str:
    """Why a batch waits for a worker, in words: the labels nobody online
    offers, or that no worker is online at all."""
    if unoffered:
        return f"Waiting for a worker with {format_pairs(unoffered)}"
    return (
        f"Waiting for a worker: none was seen in the last "
        f"{format_duration(seen_within.total_seconds())}"
    )


def retry_in_seconds(first_due: datetime, now: datetime) -> int:
    """Whole seconds until a backed-off item may be claimed again (rounded
    up, at least 0)."""
    return max(0, math.ceil((first_due - now).total_seconds()))


@dataclass(frozen=True)
class RetryWait:
    """Queued items none of which may be claimed yet: each waits out the
    backoff after a retryable failure (``available_at`` in the future)."""

    waiting: int
    in_seconds: int  # until the first of them may be claimed

    def as_json(self) -> dict:
        return {"waiting": self.waiting, "in_seconds": self.in_seconds}


# --- Reading a batch's progress ---------------------------------------------------


@dataclass
class Progress:
    batch: Batch
    now: datetime
    counts: dict[str, int]
    state: str
    total: int
    percent_done: float
    throughput_per_minute: float
    eta_seconds: int | None
    eta_basis: str
    stalled: bool
    last_activity: datetime | None
    chart: list[tuple[datetime, int]] = field(default_factory=list)
    # Live leases of this batch whose worker stopped heartbeating (SILENT).
    silent: int = 0
    # What ``throughput_per_minute`` is measured over, in words.
    throughput_window: str = ""
    # Read for the JSON only (``retry=True``): set when every queued item waits
    # out a retry backoff, so the batch waits for time, not for workers.
    retry: RetryWait | None = None
    # Set when the batch waits for a worker (``engine.waiting``): the labels
    # nobody online offers ({} when no worker is online at all).
    unoffered: dict[str, str] | None = None
    # The "online" window it was judged by.
    seen_within: timedelta = field(default_factory=seen_recently)

    @property
    def waiting_for_worker(self) -> bool:
        return self.unoffered is not None

    @property
    def waiting_text(self) -> str:
        """'Waiting for a worker with model=large-v3' (empty when not waiting)."""
        if self.unoffered is None:
            return ""
        return waiting_text(self.unoffered, self.seen_within)

    @property
    def eta_text(self) -> str:
        """The ETA as shown: none once nothing is left to do, nor while the
        batch waits for a worker (``eta_basis`` says why)."""
        if self.state == BatchState.FINISHED and self.eta_seconds == 0:
            return "—"
        if self.waiting_for_worker:
            return "—"
        return format_duration(self.eta_seconds)

    @property
    def remaining(self) -> int:
        return self.counts[ItemStatus.QUEUED] + self.counts[ItemStatus.TRANSCRIBING]

    @property
    def is_final(self) -> bool:
        """Nothing will change any more without an operator: stop refreshing."""
        return (
            self.state in (BatchState.FINISHED, BatchState.CANCELLED)
            and not (self.counts[ItemStatus.TRANSCRIBING])
        )

    @property
    def segments(self) -> list[tuple[str, int, float]]:
        """(status, count, percent of total) for the segmented bar."""
        return segments(self.counts, self.total, self.silent)

    @property
    def bar(self) -> list[dict]:
        return bar_geometry(self.segments)

    def as_json(self) -> dict:
        return {
            "batch": self.batch.pk,
            "state": self.state,
            "total": self.total,
            "counts": {s: self.counts[s] for s in ItemStatus.values},
            "percent_done": self.percent_done,
            "throughput_per_minute": self.throughput_per_minute,
            "eta_seconds": self.eta_seconds,
            "weight": self.batch.weight,
            "max_in_flight": self.batch.max_in_flight,
            "in_flight": self.counts[ItemStatus.TRANSCRIBING],
            # Of in_flight, the leases whose worker stopped heartbeating.
            "silent": self.silent,
            "retry": self.retry.as_json() if self.retry else None,
            # Added by routing (issue 26).
            "requires": requires_of(self.batch),
            "waiting_for_worker": self.waiting_for_worker,
        }


def requires_of(batch: Batch) -> dict[str, str]:
    """The worker labels the batch requires ({} for none)."""
    requires = batch.requires
    return dict(requires) if isinstance(requires, Mapping) else {}


def progress_for(
    batch: Batch,
    *,
    now: datetime,
    chart: bool = False,
    retry: bool = False,
    offers: Offers | None = None,
) -> Progress:
    return progress_for_many([batch], now=now, chart=chart, retry=retry, offers=offers)[
        batch.pk
    ]


def progress_for_many(
    batches: list[Batch],
    *,
    now: datetime,
    chart: bool = False,
    retry: bool = False,
    offers: Offers | None = None,
) -> dict[int, Progress]:
    """Progress of several batches in three or four queries in all; one more
    for the labels of the workers online when some batch has queued work
    (``offers``, if given, is read once for a whole request); with ``retry``,
    up to two more for those waiting out a retry backoff."""
    offers = Offers(now) if offers is None else offers
    ids = [b.pk for b in batches]
    counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    columns = [
        *ItemStatus.values,
        f"{ItemStatus.QUEUED}_ms",
        f"{ItemStatus.TRANSCRIBING}_ms",
    ]
    for batch_id, *sums in (
        BatchCounter.objects.filter(batch_id__in=ids)
        .values("batch_id")
        .annotate(**{f"sum_{c}": Sum(c) for c in columns})
        .values_list("batch_id", *(f"sum_{c}" for c in columns))
        .order_by()
    ):
        counts[batch_id].update(
            {c: value or 0 for c, value in zip(columns, sums, strict=True)}
        )

    history_start = minute_floor(now - (CHART_WINDOW if chart else RATE_WINDOW))
    rate_start = minute_floor(now - RATE_WINDOW)
    finished: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    done_by_minute: dict[int, dict[datetime, int]] = defaultdict(dict)
    for row in (
        BatchMinute.objects.filter(batch_id__in=ids, minute__gte=history_start)
        .values("batch_id", "minute")
        .annotate(
            done=Sum("done"),
            done_ms=Sum("done_ms"),
            failed=Sum("failed"),
            failed_ms=Sum("failed_ms"),
        )
        .order_by()
    ):
        done_by_minute[row["batch_id"]][row["minute"]] = row["done"]
        if row["minute"] >= rate_start:
            for key in ("done", "done_ms", "failed", "failed_ms"):
                finished[row["batch_id"]][key] += row[key]
    last_finish = dict(
        BatchMinute.objects.filter(batch_id__in=ids)
        .values("batch_id")
        .annotate(last=Max("minute"))
        .values_list("batch_id", "last")
        .order_by()
    )
    silent_before = now - silent_after()
    last_heartbeat, silent = {}, {}
    for batch_id, last, n in (
        Job.objects.filter(batch_id__in=ids, status=JobStatus.LEASED)
        .values("batch_id")
        .annotate(
            last=Max("heartbeat_at"),
            silent=Count("pk", filter=Q(heartbeat_at__lt=silent_before)),
        )
        .values_list("batch_id", "last", "silent")
        .order_by()
    ):
        last_heartbeat[batch_id], silent[batch_id] = last, n

    stall_after = timedelta(seconds=settings.RECALL_STALLED_AFTER_SECONDS)
    result = {}
    for batch in batches:
        c = counts[batch.pk]
        f = finished[batch.pk]
        remaining = c[ItemStatus.QUEUED] + c[ItemStatus.TRANSCRIBING]
        # A finish in minute m happened before m + 1 min; a heartbeat at its time.
        activity = [t for t in (last_heartbeat.get(batch.pk),) if t]
        if batch.pk in last_finish:
            activity.append(min(last_finish[batch.pk] + timedelta(minutes=1), now))
        last_activity = max(activity) if activity else None
        stalled = is_stalled(
            in_flight=c[ItemStatus.TRANSCRIBING],
            last_activity=last_activity,
            now=now,
            after=stall_after,
        )
        state = batch_state(
            cancelled=batch.cancelled_at is not None,
            paused=batch.paused_at is not None,
            remaining=remaining,
            in_flight=c[ItemStatus.TRANSCRIBING],
            stalled=stalled,
        )
        seconds = window_seconds(now, rate_start, batch.created_at)
        unoffered = None
        if c[ItemStatus.QUEUED] and state in (BatchState.RUNNING, BatchState.STALLED):
            unoffered = offers.waiting_for(requires_of(batch))
        if unoffered is not None:
            why = waiting_text(unoffered, seen_recently())
            eta, basis = None, f"Unknown: {why[0].lower()}{why[1:]}."
        else:
            eta, basis = _eta(batch, state, c, f, seconds)
        if state == BatchState.FINISHED:
            # Fixed once finished: its whole run, up to the finishing moment.
            end = batch.finished_at or last_activity or now
            run = (end - batch.created_at).total_seconds()
            throughput = throughput_per_minute(c[ItemStatus.DONE], run)
            throughput_window = run_text(run)
        else:
            throughput = throughput_per_minute(f["done"], seconds)
            throughput_window = window_text(seconds)
        result[batch.pk] = Progress(
            batch=batch,
            now=now,
            counts={s: c[s] for s in ItemStatus.values},
            state=state,
            total=batch.total,
            percent_done=percent(c[ItemStatus.DONE], batch.total),
            throughput_per_minute=throughput,
            eta_seconds=eta,
            eta_basis=basis,
            stalled=state == BatchState.STALLED,
            last_activity=last_activity,
            chart=chart_bars(done_by_minute[batch.pk], now, 60) if chart else [],
            silent=silent.get(batch.pk, 0),
            throughput_window=throughput_window,
            unoffered=unoffered,
        )
    if retry:
        for batch_id, wait in retry_waits(result, now=now).items():
            result[batch_id].retry = wait
    return result


def retry_waits(
    progress: dict[int, Progress], *, now: datetime
) -> dict[int, RetryWait]:
    """The batches whose queued items all wait out a retry backoff: none is
    claimable now. First an index probe per batch with queued items (the claim
    index, stopping at the first claimable job: the backed-off jobs ahead of
    it are all it reads); then, for those with none, their queued jobs, which
    are then only the backed-off ones (and any out of attempts)."""
    queued = [
        pk
        for pk, p in progress.items()
        if p.counts[ItemStatus.QUEUED]
        and p.state not in (BatchState.PAUSED, BatchState.CANCELLED)
    ]
    if not queued:
        return {}
    blocked = list(
        Batch.objects.filter(pk__in=queued)
        .annotate(ready=Exists(Job.objects.claimable(now).filter(batch=OuterRef("pk"))))
        .filter(ready=False)
        .values_list("pk", flat=True)
    )
    if not blocked:
        return {}
    return {
        batch_id: RetryWait(n, retry_in_seconds(first, now))
        for batch_id, n, first in Job.objects.filter(
            batch_id__in=blocked, status=JobStatus.QUEUED, available_at__gt=now
        )
        .values("batch_id")
        .annotate(n=Count("pk"), first=Min("available_at"))
        .values_list("batch_id", "n", "first")
        .order_by()
    }


def _eta(
    batch: Batch, state: str, c: dict[str, int], f: dict[str, int], seconds: float
) -> tuple[int | None, str]:
    """The ETA and a sentence saying how it was computed."""
    remaining = c[ItemStatus.QUEUED] + c[ItemStatus.TRANSCRIBING]
    if (
        state in (BatchState.FINISHED, BatchState.CANCELLED)
        and not c[ItemStatus.TRANSCRIBING]
    ):
        return (0 if state == BatchState.FINISHED else None), "Nothing left to do."
    if state == BatchState.PAUSED:
        return None, "Unknown while the batch is paused."
    window = format_duration(seconds)
    if batch.durations_known:
        remaining_ms = c[f"{ItemStatus.QUEUED}_ms"] + c[f"{ItemStatus.TRANSCRIBING}_ms"]
        rate = rate_per_second(f["done_ms"] + f["failed_ms"], seconds)
        eta = eta_seconds(remaining_ms, rate)
        if eta is None or rate is None:
            return None, f"Unknown: no item finished in the last {window}."
        return eta, (
            f"{format_duration(remaining_ms / 1000)} of audio left in {remaining} "
            f"items, at {rate / 1000:.1f} s of audio finished per second (done or "
            f"failed) over the last {window}."
        )
    rate = rate_per_second(f["done"] + f["failed"], seconds)
    eta = eta_seconds(remaining, rate)
    if eta is None or rate is None:
        return None, f"Unknown: no item finished in the last {window}."
    return eta, (
        f"{remaining} items left, at {rate * 60:.1f} items per minute finished "
        f"(done or failed) over the last {window}."
    )


# --- Filtering by state, in SQL -----------------------------------------------------


def _state_inputs(batches: QuerySet, now: datetime) -> QuerySet:
    """``batches`` with what their state is decided by: items remaining and
    in flight (the counter rows), and whether anything happened recently (a
    heartbeat of a live lease, or a finished item, within the stall window).
    Each is an index probe per batch; the probes for recent activity stop at
    the first match."""
    cutoff = now - timedelta(seconds=settings.RECALL_STALLED_AFTER_SECONDS)
    counters = BatchCounter.objects.filter(batch=OuterRef("pk")).values("batch")
    heartbeat = Job.objects.filter(
        batch=OuterRef("pk"), status=JobStatus.LEASED, heartbeat_at__gte=cutoff
    )
    # A finish in minute m happened before m + 1 min (see progress_for_many).
    finish = BatchMinute.objects.filter(
        batch=OuterRef("pk"), minute__gte=cutoff - timedelta(minutes=1)
    )
    return batches.annotate(
        remaining=Coalesce(
            Subquery(
                counters.annotate(n=Sum("queued") + Sum("transcribing")).values("n")
            ),
            0,
        ),
        in_flight=Coalesce(
            Subquery(counters.annotate(n=Sum("transcribing")).values("n")), 0
        ),
        active=ExpressionWrapper(
            Exists(heartbeat) | Exists(finish), output_field=BooleanField()
        ),
    )


def _state_conditions() -> dict[str, Q]:
    """``batch_state`` and ``is_stalled`` over ``_state_inputs``, in SQL."""
    live = Q(cancelled_at__isnull=True, remaining__gt=0)
    running = live & Q(paused_at__isnull=True)
    quiet = Q(in_flight__gt=0, active=False)
    return {
        BatchState.CANCELLED: Q(cancelled_at__isnull=False),
        BatchState.FINISHED: Q(cancelled_at__isnull=True, remaining=0),
        BatchState.PAUSED: live & Q(paused_at__isnull=False),
        BatchState.STALLED: running & quiet,
        BatchState.RUNNING: running & ~quiet,
    }


def in_state(batches: QuerySet, state: str, *, now: datetime) -> QuerySet:
    """The batches of ``batches`` in ``state``, decided in the database by the
    rules of ``batch_state`` and ``is_stalled``, so a list can filter and
    paginate without reading every batch's progress."""
    return _state_inputs(batches, now).filter(_state_conditions()[state])


def count_states(batches: QuerySet, *, now: datetime) -> dict[str, int]:
    """How many of ``batches`` are in each state: one query."""
    return _state_inputs(batches, now).aggregate(
        **{
            state: Count("pk", filter=condition)
            for state, condition in _state_conditions().items()
        }
    )
