"""Domain errors raised by the transitions; the worker API maps them to JSON."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django.db import InterfaceError, OperationalError

# What a lost or refused database connection raises: a 503, not a 500.
DATABASE_DOWN = (InterfaceError, OperationalError)


class LeaseLost(Exception):
    """The caller does not hold a live lease on the job (stale, wrong or reclaimed
    token, or a job leased to another worker). Nothing was changed."""


class TooManyLeases(Exception):
    """A claim by a worker that already holds its limit of live leases
    (``RECALL_MAX_LEASES_PER_WORKER``), counted under the worker's claim lock
    in the claim's own transaction. Nothing was changed."""

    def __init__(self, worker_name: str, held: int, limit: int) -> None:
        super().__init__(
            f"Worker {worker_name!r} already holds {held} live leases (the limit "
            f"is {limit}): finish, fail or release one before claiming more."
        )
        self.held, self.limit = held, limit


class WorkerDisabled(Exception):
    """A claim by a worker that was disabled after its request was
    authenticated, seen under the worker's claim lock in the claim's own
    transaction (``disable_and_reclaim`` takes the same lock). Nothing was
    changed: a disabled worker never gets a lease, however the two race."""

    def __init__(self, worker_name: str) -> None:
        super().__init__(f"Worker {worker_name!r} is disabled.")


class InvalidTransition(Exception):
    """The job is not in a state that allows the requested change."""


class BatchClosed(InvalidTransition):
    """The batch is finished or cancelled: what it requires of workers is
    fixed (nothing of it will be claimed again)."""

    def __init__(self, batch_id: int, why: str):
        self.batch_id = batch_id
        super().__init__(
            f"Batch {batch_id} is {why}: its requirements can be changed only "
            f"while it is open."
        )


class RerunRefused(InvalidTransition):
    """A re-run named items it cannot re-run: ``missing`` are not items of the
    batch, ``busy`` (item id to status) are not done or failed (still queued,
    in flight, or cancelled). Nothing was written."""

    def __init__(
        self,
        batch_id: int,
        *,
        missing: Iterable[int] = (),
        busy: Mapping[int, str] | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.missing: list[int] = sorted(missing)
        self.busy: dict[int, str] = dict(sorted((busy or {}).items()))
        parts = []
        if self.missing:
            parts.append(
                f"not items of batch {batch_id}: "
                + ", ".join(str(i) for i in self.missing[:20])
                + (" ..." if len(self.missing) > 20 else "")
            )
        if self.busy:
            parts.append(
                "only done or failed items can be re-run, not "
                + ", ".join(f"{i} ({s})" for i, s in list(self.busy.items())[:20])
                + (" ..." if len(self.busy) > 20 else "")
            )
        super().__init__("Nothing was re-run: " + "; ".join(parts) + ".")
