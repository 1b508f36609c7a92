"""The policy every transition follows, whichever backend writes it.

Messages left in the ledger and on jobs, how long a lease lasts, how failures
back off, how long an operator's cancel may take before reconciliation finishes
it. Pure values and functions: both backends (and the tests) read them here.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings

MAX_ERROR_CHARS = 10_000

# What an expired lease leaves in the ledger and, on the last attempt, on the
# job ({n}: its max attempts).
LEASE_EXPIRED = "The lease expired: the worker stopped heartbeating."
GAVE_UP = (
    "Gave up: the lease expired on the last allowed attempt ({n} of {n}). If this "
    "repeats after a retry, the audio may be crashing workers."
)
FORCED_BY_ADMIN = "The lease was ended by an administrator."
BATCH_CANCELLED = "The batch was cancelled."
EXHAUSTED = "Failed by reconciliation: queued with no attempts left."

# Why a lease of a batched heartbeat (``heartbeat_many``) was not renewed: the
# job exists but the caller does not hold its live lease under that token, or
# there is no such job. The worker API's per-lease error codes, as they are.
LEASE_LOST = "lease_lost"
NOT_FOUND = "not_found"
# The most leases one batched heartbeat renews (the worker API's limit).
MAX_HEARTBEAT_LEASES = 64
# A completion of a batched completion (``complete_many``) that was made: now,
# or before with the same token (a replay), as the single completion answers.
COMPLETED = "completed"
# The most completions one batched completion makes (the worker API's limit).
MAX_COMPLETIONS = 64

# How many open batches one claim looks at before it reports "nothing claimable".
CLAIM_BATCH_CANDIDATES = 50

# An operator's cancel normally finishes within its own request; one whose batch
# still has unfinished jobs after this long was interrupted, and the next claim
# or sweep finishes it.
CANCEL_GRACE = timedelta(seconds=30)


def gave_up(max_attempts: int) -> str:
    return GAVE_UP.replace("{n}", str(max_attempts))


def truncate_error(error: str) -> str:
    """Errors are diagnostics: keep a long one, cut to MAX_ERROR_CHARS."""
    if len(error) <= MAX_ERROR_CHARS:
        return error
    marker = "\n[… truncated]"
    return error[: MAX_ERROR_CHARS - len(marker)] + marker


def retry_delay(attempts: int) -> timedelta:
    """Exponential backoff after a retryable failure of attempt number ``attempts``."""
    base = settings.RECALL_RETRY_BACKOFF_SECONDS
    seconds = min(
        base * 2 ** max(attempts - 1, 0), settings.RECALL_RETRY_BACKOFF_MAX_SECONDS
    )
    return timedelta(seconds=seconds)


def max_leases() -> int:
    """Live leases one worker may hold: a claim beyond it is refused."""
    return settings.RECALL_MAX_LEASES_PER_WORKER


def lease_duration() -> timedelta:
    return timedelta(seconds=settings.RECALL_LEASE_SECONDS)


def heartbeat_interval() -> int:
    """Seconds between heartbeats we ask of workers: three chances per lease."""
    return max(1, settings.RECALL_LEASE_SECONDS // 3)


def silent_after() -> timedelta:
    """How long after its last heartbeat a live lease is *silent*: its next
    heartbeat is overdue by more than one interval (two intervals without one).
    Nobody is known to be working on it; it stays live until it expires and is
    reclaimed, or heartbeats again."""
    return timedelta(seconds=2 * heartbeat_interval())
