"""Domain errors raised by the transitions; the worker API maps them to JSON."""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

# What a lost or refused database connection raises: a 503, not a 500.
DATABASE_DOWN = (InterfaceError, OperationalError)


class LeaseLost(Exception):
    """The caller does not hold a live lease on the job (stale, wrong or reclaimed
    token, or a job leased to another worker). Nothing was changed."""


class InvalidTransition(Exception):
    """The job is not in a state that allows the requested change."""
