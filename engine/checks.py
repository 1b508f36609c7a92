"""Recall's invariants, checked read-only against the database.

Used by ``manage.py recall_check`` in production and by the tests after every
scenario. Each check is one set-based query, so it stays usable on big tables.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Exists, F, Max, OuterRef, Q, Subquery, Sum
from django.db.models.functions import Coalesce

from batches.models import (
    COUNTER_COLUMNS,
    COUNTER_SHARDS,
    FLAG_COUNTER_COLUMNS,
    Batch,
    BatchCounter,
    BatchItem,
    ItemStatus,
)
from jobs import transitions
from jobs.models import (
    Job,
    JobRun,
    JobStatus,
    Lease,
    LeaseEnd,
    WebhookEvent,
    WebhookEventType,
    agreeing_item_status,
)

# Report at most this many offending rows per check.
SAMPLE = 20
# A lease expired longer ago than this should have been reclaimed by a sweep.
STALE_LEASE_GRACE = timedelta(minutes=5)


@dataclass(frozen=True)
class Violation:
    check: str
    detail: str

    def __str__(self) -> str:
        return f"{self.check}: {self.detail}"


def find_violations(
    *, now: datetime | None = None, stale_leases: bool = True
) -> list[Violation]:
    """Every broken invariant (an empty list when all is well).

    ``stale_leases=False`` skips the one check that depends on the sweeper having
    run recently (for tests that move a fake clock without sweeping).
    """
    now = now or transitions.now()
    found: list[Violation] = []
    checks = [
        _items_agree_with_jobs,
        _ledger_matches_leases,
        _one_completion_per_completed_job,
        _attempts_within_limits,
        _counters_match_items,
        _flags_only_on_done_items,
        _finished_batches_are_finished,
        _one_event_per_finish,
    ]
    if stale_leases:
        checks.insert(2, _no_stale_leases)
    for check in checks:
        found.extend(check(now))
    return found


def _sample(check: str, ids, describe) -> list[Violation]:
    return [Violation(check, describe(row)) for row in ids[:SAMPLE]]


def _items_agree_with_jobs(now: datetime) -> list[Violation]:
    rows = list(
        Job.objects.exclude(agreeing_item_status())
        .order_by("pk")
        .values_list("pk", "status", "item_id", "item__status")[:SAMPLE]
    )
    return _sample(
        "item-matches-job",
        rows,
        lambda r: f"job {r[0]} is {r[1]} but item {r[2]} is {r[3]}",
    )


def _ledger_matches_leases(now: datetime) -> list[Violation]:
    open_rows = Lease.objects.filter(job=OuterRef("pk"), ended_at__isnull=True)
    jobs = Job.objects.annotate(
        open_leases=Coalesce(
            Subquery(
                open_rows.order_by().values("job").annotate(n=Count("pk")).values("n")
            ),
            0,
        ),
        open_token=Subquery(open_rows.values("token")[:1]),
    )
    leased_bad = list(
        jobs.filter(status=JobStatus.LEASED)
        .filter(~Q(open_leases=1) | ~Q(open_token=F("lease_token")))
        .values_list("pk", "open_leases")[:SAMPLE]
    )
    other_bad = list(
        jobs.exclude(status=JobStatus.LEASED)
        .filter(open_leases__gt=0)
        .values_list("pk", "status", "open_leases")[:SAMPLE]
    )
    return _sample(
        "one-open-ledger-row-per-lease",
        leased_bad,
        lambda r: f"leased job {r[0]} has {r[1]} open ledger rows (or a wrong token)",
    ) + _sample(
        "no-open-ledger-row-without-lease",
        other_bad,
        lambda r: f"job {r[0]} is {r[1]} but has {r[2]} open ledger rows",
    )


def _no_stale_leases(now: datetime) -> list[Violation]:
    rows = list(
        Job.objects.expired(now - STALE_LEASE_GRACE)
        .order_by("lease_expires_at")
        .values_list("pk", "lease_expires_at")[:SAMPLE]
    )
    return _sample(
        "no-item-transcribing-without-a-live-lease",
        rows,
        lambda r: (
            f"job {r[0]}'s lease expired at {r[1].isoformat()} and was never "
            f"reclaimed (is the sweeper running?)"
        ),
    )


def _one_completion_per_completed_job(now: datetime) -> list[Violation]:
    """A completed job has exactly one completed ledger row in its current run
    (a re-run starts a new one), any other job none.

    Three set-based queries (an anti-join, a grouped count, a semi-join), not a
    count per job: with ten million jobs a correlated count per row took 91 s.
    """
    completions = Lease.objects.filter(end_reason=LeaseEnd.COMPLETED).order_by()
    of_the_job = completions.filter(job=OuterRef("pk"))
    counted = of_the_job.values("job").annotate(n=Count("pk")).values("n")
    # Jobs in their first run (nearly all): every ledger row is this run's.
    first_run = Job.objects.filter(run=1)
    # Completed without a completed ledger row.
    found: dict[int, tuple] = {
        pk: (pk, status, 0)
        for pk, status in first_run.filter(status=JobStatus.COMPLETED)
        .filter(~Exists(of_the_job))
        .values_list("pk", "status")[:SAMPLE]
    }
    # More than one completed ledger row, whatever the job's state.
    repeated = dict(
        completions.filter(~Exists(JobRun.objects.filter(job=OuterRef("job"))))
        .values("job")
        .annotate(n=Count("pk"))
        .filter(n__gt=1)
        .values_list("job", "n")[:SAMPLE]
    )
    for pk, status in Job.objects.filter(pk__in=repeated).values_list("pk", "status"):
        found.setdefault(pk, (pk, status, repeated[pk]))
    # Not completed, yet a ledger row says it was.
    for row in (
        first_run.exclude(status=JobStatus.COMPLETED)
        .filter(Exists(of_the_job))
        .annotate(completions=Subquery(counted))
        .values_list("pk", "status", "completions")[:SAMPLE]
    ):
        found.setdefault(row[0], row)
    # Re-run jobs (a few): the same rule for their current run, whose ledger
    # rows come after the last earlier run's (``JobRun.last_lease_id``).
    boundary = (
        JobRun.objects.filter(job=OuterRef("pk"))
        .order_by("-number")
        .values("last_lease_id")[:1]
    )
    this_run = (
        completions.filter(job=OuterRef("pk"), pk__gt=OuterRef("boundary"))
        .values("job")
        .annotate(n=Count("pk"))
        .values("n")
    )
    for row in (
        Job.objects.filter(run__gt=1)
        .annotate(boundary=Coalesce(Subquery(boundary), 0))
        .annotate(completions=Coalesce(Subquery(this_run), 0))
        .filter(
            (Q(status=JobStatus.COMPLETED) & ~Q(completions=1))
            | (~Q(status=JobStatus.COMPLETED) & Q(completions__gt=0))
        )
        .values_list("pk", "status", "completions")[:SAMPLE]
    ):
        found.setdefault(row[0], row)
    return _sample(
        "one-completion-per-completed-job",
        sorted(found.values()),
        lambda r: f"job {r[0]} is {r[1]} with {r[2]} completed ledger rows",
    )


def _attempts_within_limits(now: datetime) -> list[Violation]:
    rows = list(
        Job.objects.filter(
            Q(attempts__gt=F("max_attempts"))
            | Q(status=JobStatus.QUEUED, attempts__gte=F("max_attempts"))
        ).values_list("pk", "status", "attempts", "max_attempts")[:SAMPLE]
    )
    return _sample(
        "attempts-within-max",
        rows,
        lambda r: f"job {r[0]} is {r[1]} after {r[2]} of {r[3]} attempts",
    )


def _counters_match_items(now: datetime) -> list[Violation]:
    counted: dict = defaultdict(lambda: defaultdict(int))
    rows: Iterable[Any] = (
        BatchItem.objects.values("batch_id", "status")
        .annotate(
            n=Count("pk"),
            ms=Coalesce(Sum("duration_ms"), 0),
            **{c: Count("pk", filter=Q(**{c: True})) for c in FLAG_COUNTER_COLUMNS},
        )
        .order_by()
    )
    for row in rows:
        counted[row["batch_id"]][row["status"]] += row["n"]
        counted[row["batch_id"]][f"{row['status']}_ms"] += row["ms"]
        for column in FLAG_COUNTER_COLUMNS:
            counted[row["batch_id"]][column] += row[column]
    columns = (*COUNTER_COLUMNS, *FLAG_COUNTER_COLUMNS)
    kept: dict = defaultdict(lambda: defaultdict(int))
    shards: dict = defaultdict(int)
    for row in BatchCounter.objects.values("batch_id", *columns):
        shards[row["batch_id"]] += 1
        for column in columns:
            kept[row["batch_id"]][column] += row[column]
    found = []
    totals = dict(Batch.objects.values_list("pk", "total"))
    for batch_id, total in totals.items():
        wrong = {
            c: (kept[batch_id][c], counted[batch_id][c])
            for c in columns
            if kept[batch_id][c] != counted[batch_id][c]
        }
        if wrong:
            found.append(
                Violation(
                    "counters-match-items",
                    f"batch {batch_id}: "
                    + ", ".join(
                        f"{c} counter {k} != {n} counted" for c, (k, n) in wrong.items()
                    ),
                )
            )
        if shards[batch_id] != COUNTER_SHARDS:
            found.append(
                Violation(
                    "counters-match-items",
                    f"batch {batch_id} has {shards[batch_id]} counter rows, "
                    f"not {COUNTER_SHARDS}",
                )
            )
        items = sum(counted[batch_id][s] for s in ItemStatus.values)
        if items != total:
            found.append(
                Violation(
                    "counters-match-items",
                    f"batch {batch_id} has {items} items, total says {total}",
                )
            )
    return found


def _flags_only_on_done_items(now: datetime) -> list[Violation]:
    """Quality flags belong to a completion: an item that is not done has none."""
    flagged = Q()
    for column in FLAG_COUNTER_COLUMNS:
        flagged |= Q(**{column: True})
    rows = list(
        BatchItem.objects.filter(flagged)
        .exclude(status=ItemStatus.DONE)
        .order_by("pk")
        .values_list("pk", "status")[:SAMPLE]
    )
    return _sample(
        "flags-only-on-done",
        rows,
        lambda r: f"item {r[0]} is {r[1]} but has quality flags",
    )


def _finished_batches_are_finished(now: datetime) -> list[Violation]:
    rows = list(
        Batch.objects.filter(finished_at__isnull=False)
        .filter(items__status__in=[ItemStatus.QUEUED, ItemStatus.TRANSCRIBING])
        .values_list("pk", flat=True)
        .distinct()[:SAMPLE]
    )
    return _sample(
        "finished-batches-have-no-work",
        rows,
        lambda r: f"batch {r} is marked finished but has queued or transcribing items",
    )


def _one_event_per_finish(now: datetime) -> list[Violation]:
    """Each of a batch's finishes (``Batch.finishes``) has its batch.finished
    event, generations 1 to finishes, and there is no other."""
    events = WebhookEvent.objects.filter(
        batch=OuterRef("pk"), type=WebhookEventType.BATCH_FINISHED
    ).order_by()
    rows = list(
        Batch.objects.annotate(
            finish_events=Coalesce(
                Subquery(events.values("batch").annotate(n=Count("pk")).values("n")),
                0,
            ),
            last=Coalesce(
                Subquery(
                    events.values("batch").annotate(m=Max("generation")).values("m")
                ),
                0,
            ),
        )
        .filter(~Q(finish_events=F("finishes")) | ~Q(last=F("finishes")))
        .values_list("pk", "finishes", "finish_events")[:SAMPLE]
    )
    return _sample(
        "one-event-per-finish",
        rows,
        lambda r: (
            f"batch {r[0]} finished {r[1]} time(s) but has {r[2]} "
            f"batch.finished event(s)"
        ),
    )
