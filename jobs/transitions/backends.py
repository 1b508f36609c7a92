"""Which backend writes the transitions: chosen once per database connection.

As Django gives each connection its ``connection.ops``, each connection gets
one transition backend the first time it is asked for: the PostgreSQL
statement backend on PostgreSQL (unless ``RECALL_TRANSITIONS_BACKEND=orm``),
the ORM backend everywhere else. Nothing else in Recall looks at the vendor.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from django.conf import settings
from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.dispatch import receiver

from .orm import OrmBackend
from .postgres import PostgresBackend

CHOICES = ("auto", "orm")

_chosen: WeakKeyDictionary[BaseDatabaseWrapper, OrmBackend] = WeakKeyDictionary()


def backend(using: str = DEFAULT_DB_ALIAS) -> OrmBackend:
    """The transition backend of this thread's connection ``using``."""
    connection = connections[using]
    try:
        return _chosen[connection]
    except KeyError:
        chosen = _choose(connection)
        _chosen[connection] = chosen
        return chosen


def _choose(connection: BaseDatabaseWrapper) -> OrmBackend:
    if (
        connection.vendor == "postgresql"
        and settings.RECALL_TRANSITIONS_BACKEND == "auto"
    ):
        return PostgresBackend(connection)
    return OrmBackend(connection)


@receiver(setting_changed)
def _forget(*, setting: str, **kwargs: Any) -> None:
    # Tests switch backends with override_settings.
    if setting in ("RECALL_TRANSITIONS_BACKEND", "RECALL_PREPARED_STATEMENTS"):
        _chosen.clear()
