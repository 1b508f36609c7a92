"""The admin's bulk job actions: what each one changes, skips and says.

Each is a ``BulkAction``: which selected jobs it changes, the transition it
calls, and the words of its confirmation page and result messages. The job
admin (``job.py``) runs them all the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.db.models import Q

from jobs import transitions
from jobs.models import JobStatus

# Repairs listed by name on the reconciliation result page.
REPAIRS_SHOWN = 50
# A job action starts no new chunk after this many seconds, so one request stays
# well inside the server's timeout (gunicorn's is 60 s); the admin runs the
# action again for the rest. About 3,000 jobs a second go through on PostgreSQL.
ACTION_SECONDS = 20


def jobs_text(n: int) -> str:
    return f"{n} job" if n == 1 else f"{n} jobs"


@dataclass(frozen=True)
class BulkAction:
    """One of the job actions that moves selected jobs through a transition."""

    # Which selected jobs it changes; the others are skipped.
    eligible: Q
    # The transition: (jobs, actor=, now=, audit=) -> how many changed.
    transition: Callable[..., int]
    title: str
    summary: str
    changing: str  # the count label of the jobs that change
    skipped: str  # why the other selected jobs are left alone
    remaining: str  # what the jobs not reached yet still are ("leased")
    effects: tuple[str, ...]  # "{chunk}": the chunk size
    button: str  # "{n}": "3 jobs"
    done: str  # "{n}": "3 jobs"
    audit: str  # the admin log's change message for each job


IN_CHUNKS = (
    "Jobs are changed in chunks of {chunk}, each chunk in a short transaction of "
    "its own, so a large selection never holds many locks for long. After "
    "{seconds} seconds no new chunk is started: run the action again for the rest."
)

FORCE_RECLAIM = BulkAction(
    eligible=Q(status=JobStatus.LEASED),
    transition=transitions.force_reclaim_many,
    title="Force reclaim leased jobs",
    summary="End the leases of the selected leased jobs now.",
    changing="Leased: force-reclaimed",
    skipped="not leased (any more)",
    remaining="leased",
    effects=(
        "Each job goes back to queued with its item, in a transaction of its own; "
        "the attempt is not counted.",
        "Its lease-ledger row is closed as “forced”.",
        "The worker that held it is fenced out: its next heartbeat, completion, "
        "failure or release for the job gets 409 and changes nothing.",
    ),
    button="Force reclaim {n}",
    done="Force-reclaimed {n}: queued again, their old workers fenced out.",
    audit="Force reclaim: lease ended (ledger row closed as forced), job queued "
    "again; the old worker is fenced out.",
)

REQUEUE_FAILED = BulkAction(
    eligible=Q(status=JobStatus.FAILED, batch__cancelled_at__isnull=True),
    transition=transitions.retry_failed,
    title="Requeue failed jobs",
    summary="Queue the selected failed jobs again, with fresh attempts.",
    changing="Failed: queued again",
    skipped="not failed, or in a cancelled batch (retry leaves those failed)",
    remaining="failed",
    effects=(
        "Each job and its item go back to queued with fresh attempts (0 used); the "
        "lease ledger keeps the failed attempts.",
        "A batch marked finished is reopened so workers claim its jobs again.",
        IN_CHUNKS,
    ),
    button="Requeue {n}",
    done="Queued {n} again with fresh attempts.",
    audit="Requeue: queued again with fresh attempts.",
)

CANCEL_QUEUED = BulkAction(
    eligible=Q(status=JobStatus.QUEUED),
    transition=transitions.cancel_queued,
    title="Cancel queued jobs",
    summary="Cancel the selected queued jobs.",
    changing="Queued: cancelled",
    skipped="not queued",
    remaining="queued",
    effects=(
        "Each job and its item become cancelled; workers will never claim them.",
        "A job a worker is claiming at this very moment is left alone (it is no "
        "longer queued).",
        IN_CHUNKS,
    ),
    button="Cancel {n}",
    done="Cancelled {n}.",
    audit="Cancel: job and item cancelled.",
)

REPORT_LABELS = {
    "items_healed": "Items brought in line with their job",
    "leases_closed": "Stray lease-ledger rows closed",
    "leases_restored": "Missing lease-ledger rows restored",
    "exhausted_failed": "Queued jobs with no attempts left, failed",
    "cancels_finished": "Jobs of interrupted batch cancels, cancelled",
    "batches_reopened": "Batches wrongly marked finished, reopened",
    "counters_fixed": "Batches whose progress counters were wrong, recounted",
}
