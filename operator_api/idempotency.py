"""Idempotent batch submission: the same Idempotency-Key from the same user
within IDEMPOTENCY_TTL gets the batch the first request created.

Expired keys are deleted as their users come back (the unique constraint
would refuse the new row otherwise) and, for users who never do, by
``forget_expired``, which django-q2 runs every hour (schedule
``recall-idempotency-keys``).

The key's row is inserted first, in the transaction that creates the batch, so
the unique constraint on (user, key) decides a race: on PostgreSQL the twin's
insert waits for the winner's commit, fails, and the twin answers with the
winner's batch; if the winner rolled back (invalid items), the twin's insert
goes through and it creates the batch itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from datetime import datetime

from django.db import IntegrityError, transaction

from batches.models import Batch

from .models import IDEMPOTENCY_TTL, IdempotencyKey


class IdempotencyConflict(Exception):
    """The key was used for a submission with another body."""


def body_hash(body: dict) -> str:
    """The body's SHA-256 in canonical form (key order and spacing don't count)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def submit_once(
    user, key: str, digest: str, create: Callable[[], Batch], *, now: datetime
) -> tuple[Batch, bool]:
    """The batch ``create()`` makes, or the one this key already made: (batch,
    created). Raises IdempotencyConflict when the key went with another body;
    whatever ``create`` raises leaves no key behind."""
    existing = _live_key(user, key, digest, now)
    if existing is not None:
        return existing, False
    try:
        with transaction.atomic():
            # Expired keys are forgotten as their users come back.
            IdempotencyKey.objects.filter(
                user=user, created_at__lte=now - IDEMPOTENCY_TTL
            ).delete()
            row = IdempotencyKey.objects.create(
                user=user, key=key, body_hash=digest, created_at=now
            )
            batch = create()
            IdempotencyKey.objects.filter(pk=row.pk).update(batch=batch)
            return batch, True
    except IntegrityError:
        # A twin holds the key, committed now: answer with its batch.
        existing = _live_key(user, key, digest, now)
        if existing is None:
            raise
        return existing, False


def forget_expired(*, now: datetime, chunk: int = 5_000) -> int:
    """Delete the keys older than IDEMPOTENCY_TTL, ``chunk`` rows per
    statement (each its own transaction, through the ``created_at`` index);
    returns how many went. An expired key answers nothing, so deleting it
    changes no submission's outcome."""
    cutoff = now - IDEMPOTENCY_TTL
    forgotten = 0
    while True:
        ids = list(
            IdempotencyKey.objects.filter(created_at__lte=cutoff)
            .order_by("created_at")
            .values_list("pk", flat=True)[:chunk]
        )
        if not ids:
            return forgotten
        deleted, _ = IdempotencyKey.objects.filter(
            pk__in=ids, created_at__lte=cutoff
        ).delete()
        forgotten += deleted


def _live_key(user, key: str, digest: str, now: datetime) -> Batch | None:
    """The batch of the key's unexpired use, or None; IdempotencyConflict if
    that use had another body."""
    row = (
        IdempotencyKey.objects.filter(
            user=user, key=key, created_at__gt=now - IDEMPOTENCY_TTL
        )
        .select_related("batch")
        .first()
    )
    if row is None or row.batch is None:
        return None
    if not hmac.compare_digest(row.body_hash, digest):
        raise IdempotencyConflict(
            f"The Idempotency-Key {key!r} was used within the last "
            f"{IDEMPOTENCY_TTL.total_seconds() / 3600:.0f} hours for another "
            f"submission (batch {row.batch.pk}); use a new key for a new batch."
        )
    return row.batch
