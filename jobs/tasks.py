"""django-q2 task entry points (thin: they call the same code as the commands)."""

from __future__ import annotations

from .sweep import sweep as run_sweep
from .webhooks.delivery import dispatch


def sweep() -> dict:
    """The scheduled sweep (``recall-sweep`` schedule, every minute)."""
    return run_sweep()


def deliver_webhooks(delivery_ids: list[int]) -> dict:
    """First attempts, queued when their event commits; then the dispatcher's
    work while a retry falls due soon."""
    return dispatch(delivery_ids).as_dict()


def dispatch_webhooks(handover: str = "") -> dict:
    """The dispatcher: scheduled every minute (``recall-webhooks``), or queued
    by the previous one as its successor (``handover``)."""
    return dispatch(handover=handover).as_dict()
