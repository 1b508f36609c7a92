"""The PostgreSQL backend's health check (recall_site/postgresql/base.py): a
quiet connection passes without a round trip, one the server dropped fails, and
one the server has said anything on gets the full ``SELECT 1``."""

from __future__ import annotations

import select
from collections.abc import Iterator

import pytest
from django.db import connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def other() -> Iterator[BaseDatabaseWrapper]:
    """A second connection, to look at and act on the first one."""
    other = connections.create_connection("default")
    try:
        yield other
    finally:
        other.close()


def last_query(other: BaseDatabaseWrapper, pid: int) -> str:
    with other.cursor() as cursor:
        cursor.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone()[0]


def test_a_quiet_connection_is_usable_without_a_round_trip(other):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 'the last thing said'")
    pid = connection.connection.info.backend_pid

    assert connection.is_usable() is True
    assert last_query(other, pid) == "SELECT 'the last thing said'"


def test_a_connection_the_server_dropped_is_not_usable(other):
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with other.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])

    assert connection.is_usable() is False

    connection.close()
    connection.ensure_connection()
    assert connection.connection.info.backend_pid != pid


def test_a_connection_with_something_to_read_gets_the_full_check(other):
    with connection.cursor() as cursor:
        cursor.execute("LISTEN recall_health_check_test")
    pid = connection.connection.info.backend_pid
    with other.cursor() as cursor:
        cursor.execute("NOTIFY recall_health_check_test")
    poller = select.poll()  # the server sends it on its own time: wait for it
    poller.register(connection.connection.fileno(), select.POLLIN)
    assert poller.poll(5000)

    try:
        assert connection.is_usable() is True
        assert last_query(other, pid) == "SELECT 1"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("UNLISTEN *")


def test_the_backend_is_djangos_postgresql_backend_underneath():
    assert connection.vendor == "postgresql"
    assert connection.settings_dict["ENGINE"] == "recall_site.postgresql"
