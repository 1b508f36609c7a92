"""django-q2 task entry points of the operator API (thin)."""

from __future__ import annotations

from jobs import transitions

from .idempotency import forget_expired


def forget_expired_keys() -> int:
    """The hourly ``recall-idempotency-keys`` schedule: expired keys go."""
    return forget_expired(now=transitions.now())
