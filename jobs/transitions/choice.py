"""Which backend writes the transitions: chosen once per database connection.

As Django gives each connection its ``connection.ops``, each connection gets
one transition backend (``backends/``) the first time it is asked for: the
PostgreSQL statement backend on PostgreSQL (unless
``RECALL_TRANSITIONS_BACKEND=orm``), the ORM backend everywhere else. Nothing
else in Recall looks at the vendor. The backend is handed the chores a claim
runs first (``actions``, ``repairs``), which sit above it.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from django.conf import settings
from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.dispatch import receiver

from . import actions, repairs
from .backends import Chores, TransitionBackend, build

CHOICES = ("auto", "orm")

CHORES = Chores(
    finish_interrupted_cancel=actions.finish_interrupted_cancel,
    close_stray_leases=repairs.close_stray_leases,
)

_chosen: WeakKeyDictionary[BaseDatabaseWrapper, TransitionBackend] = WeakKeyDictionary()


def backend(using: str = DEFAULT_DB_ALIAS) -> TransitionBackend:
    """The transition backend of this thread's connection ``using``."""
    connection = connections[using]
    try:
        return _chosen[connection]
    except KeyError:
        chosen = build(
            connection,
            CHORES,
            statements=settings.RECALL_TRANSITIONS_BACKEND == "auto",
        )
        _chosen[connection] = chosen
        return chosen


def forget() -> None:
    """Drop every connection's backend and what it kept (its cursor, the label
    sets it found claiming without a rival): the next use builds a new one.
    Tests start each from here, as a new process would."""
    _chosen.clear()


@receiver(setting_changed)
def _forget(*, setting: str, **kwargs: Any) -> None:
    # Tests switch backends with override_settings.
    if setting in ("RECALL_TRANSITIONS_BACKEND", "RECALL_PREPARED_STATEMENTS"):
        forget()
