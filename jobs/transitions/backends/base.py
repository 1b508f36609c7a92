"""The hot operations every transition backend implements, declared once.

``TransitionBackend`` is what the catalogue (``jobs/transitions/__init__.py``)
calls: worker authentication, the claim, a live lease's own transitions, the
reclaim of expired leases and a batch's creation. ``orm.py`` (portable, the
reference) and ``postgres.py`` (PostgreSQL statements) implement it, and mypy
checks both against it (``backends/__init__.py``). ``Chores`` is what a claim
runs first that belongs to the layers above (finishing an interrupted cancel,
closing a stray ledger row): they are handed to a backend when it is built, so
the backends import nothing above them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import QuerySet

from batches.labels import Labels
from batches.models import Batch
from jobs.models import Job, Worker

ItemRow = tuple[str, dict[str, Any], int | None]
"""One item of a new batch: its audio URI, its metadata, its priority."""


@dataclass(frozen=True)
class Chores:
    """Writes of the layers above that a claim runs before it hands out work."""

    finish_interrupted_cancel: Callable[..., int]
    """One chunk of the oldest interrupted batch cancel (``now=``)."""
    close_stray_leases: Callable[..., int]
    """Close a job's open ledger rows no live lease stands behind (``now=``)."""


class TransitionBackend(Protocol):
    """The hot transitions, one implementation per database vendor."""

    name: str
    connection: BaseDatabaseWrapper

    def now(self) -> datetime: ...

    def authenticate(self, token: str) -> tuple[Worker | None, datetime | None]: ...

    def authenticate_many(
        self, tokens: Sequence[str]
    ) -> list[tuple[Worker | None, datetime | None]]: ...

    def touch(self, worker: Worker, now: datetime) -> None: ...

    def claim_next(
        self,
        worker: Worker,
        *,
        labels: Labels,
        now: datetime | None,
        max_leases: int,
    ) -> Job | None: ...

    def claim_many(
        self,
        worker: Worker,
        *,
        labels: Labels,
        max_jobs: int,
        now: datetime | None,
        max_leases: int,
    ) -> list[Job]: ...

    def heartbeat(
        self, job_id: int, lease_token: str, *, worker: Worker, now: datetime | None
    ) -> datetime: ...

    def heartbeat_many(
        self,
        leases: Sequence[tuple[int, str]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[datetime | str]: ...

    def complete(
        self,
        job_id: int,
        lease_token: str,
        *,
        worker: Worker,
        result: dict[str, Any],
        now: datetime | None,
    ) -> Job | None: ...

    def complete_many(
        self,
        completions: Sequence[tuple[int, str, dict[str, Any]]],
        *,
        worker: Worker,
        now: datetime | None,
    ) -> list[Job | str | None]: ...

    def fail(
        self,
        job_id: int,
        lease_token: str,
        *,
        worker: Worker,
        error: str,
        retryable: bool,
        now: datetime | None,
    ) -> Job: ...

    def release(
        self, job_id: int, lease_token: str, *, worker: Worker, now: datetime | None
    ) -> Job: ...

    def reclaim_expired(
        self,
        *,
        now: datetime | None,
        limit: int | None = None,
        wait: bool = True,
        among: QuerySet[Job] | None = None,
    ) -> dict[str, int]: ...

    def create_batch(
        self,
        *,
        name: str,
        items: Iterable[ItemRow],
        priority: int,
        weight: int,
        max_in_flight: int | None,
        created_by: Any,
        now: datetime,
        on_created: Callable[[Batch], None] | None = None,
        requires: dict[str, str] | None = None,
    ) -> Batch: ...
