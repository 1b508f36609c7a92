"""The transition backends, one per database vendor, behind one interface.

``base.py`` declares the interface (``TransitionBackend``); ``orm.py`` is the
portable ORM backend, ``postgres.py`` the PostgreSQL statement backend with its
statements in ``statements.py``. ``build`` picks one for a connection; the
per-connection choice is kept in ``jobs/transitions/choice.py``. These modules
import only the models and the transition layer's building blocks (``rows``,
``rules``, ``outbox``, ``workers``), never the actions or repairs above them.
"""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from .base import Chores, ItemRow, TransitionBackend
from .orm import OrmBackend
from .postgres import PostgresBackend

__all__ = ["Chores", "ItemRow", "TransitionBackend", "build"]

# mypy checks both implementations against the declared interface here.
_ORM: type[TransitionBackend] = OrmBackend
_POSTGRES: type[TransitionBackend] = PostgresBackend


def build(
    connection: BaseDatabaseWrapper, chores: Chores, *, statements: bool
) -> TransitionBackend:
    """The backend for ``connection``: PostgreSQL's statements when asked for
    and the vendor is PostgreSQL, the portable ORM backend otherwise."""
    if statements and connection.vendor == "postgresql":
        return PostgresBackend(connection, chores)
    return OrmBackend(connection, chores)
