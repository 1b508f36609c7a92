"""Writes to workers: creating one, its token, enabling and disabling, and when
it was last seen. Portable ORM code, the same on every backend."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from jobs.models import Worker
from jobs.tokens import issue_worker_token


def create_worker(name: str) -> tuple[Worker, str]:
    """Create a worker; its token is returned here and never stored in clear."""
    worker = Worker(name=name)
    token = issue_worker_token(worker)
    worker.save()
    return worker, token


def rotate_token(worker: Worker) -> str:
    """Issue a new token; the old one stops working as soon as this commits."""
    token = issue_worker_token(worker)
    Worker.objects.filter(pk=worker.pk).update(
        token_prefix=worker.token_prefix, token_hash=worker.token_hash
    )
    return token


def set_active(worker: Worker, active: bool) -> bool:
    """Disable or re-enable the worker; False if it already was so. A disabled
    worker's requests get 403 at once."""
    changed = Worker.objects.filter(pk=worker.pk, is_active=not active).update(
        is_active=active
    )
    worker.is_active = active
    return bool(changed)


def touch(worker: Worker, now: datetime) -> None:
    """Record that the worker was seen (at most once per its resolution)."""
    if worker.seen_long_ago(now):
        Worker.objects.filter(pk=worker.pk).update(last_seen=now)
        worker.last_seen = now


def declare_labels(worker: Worker, labels: Mapping[str, str]) -> None:
    """Keep ``labels`` as the worker's latest declared labels, writing the row
    only when they changed: a worker declares the same labels with every
    claim, and claims are the hot path."""
    if worker.labels != labels:
        Worker.objects.filter(pk=worker.pk).update(labels=dict(labels))
        worker.labels = dict(labels)
