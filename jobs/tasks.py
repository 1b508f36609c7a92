"""django-q2 task entry points (thin: they call the same code as the commands)."""

from __future__ import annotations

from .sweep import sweep as run_sweep


def sweep() -> dict:
    """The scheduled sweep (``recall-sweep`` schedule, every minute)."""
    return run_sweep()
