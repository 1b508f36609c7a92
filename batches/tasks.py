"""django-q2 task entry points of the batches app (thin)."""

from __future__ import annotations

from . import background


def run_intake(intake_id: int) -> str:
    """A background intake (queued by the new-batch form for large manifests)."""
    return background.run_intake(intake_id)
