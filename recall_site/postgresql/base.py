"""Django's PostgreSQL backend, with a health check that costs no round trip
while the connection is quiet.

Recall keeps one persistent connection per web thread (settings.py), and with
``CONN_HEALTH_CHECKS`` Django checks it with a ``SELECT 1`` before the first
query of every request: a round trip to the server for each worker API call,
as many as the call's own statement. A server that drops a connection (a
restart, ``pg_terminate_backend``, an idle timeout) says so on its socket: it
sends its FATAL error and closes, so the socket turns readable. An idle
connection that nobody has written to has nothing to read. So: nothing to read
means usable, without asking; anything to read means the full ``SELECT 1``
check, which reads what the server said and answers. A connection the server
lost without a word (a cable cut) fails its next statement instead, as it could
right after a ``SELECT 1`` too: that request answers 503 and Django closes the
connection at the request's end.
"""

from __future__ import annotations

import select

from django.db.backends.postgresql import base
from psycopg.pq import TransactionStatus


class DatabaseWrapper(base.DatabaseWrapper):
    def is_usable(self) -> bool:
        connection = self.connection
        if connection is None or connection.closed or connection.broken:
            return False
        if connection.info.transaction_status != TransactionStatus.IDLE:
            return super().is_usable()
        poller = select.poll()  # not select(): a long-poller holds many sockets
        poller.register(connection.fileno(), select.POLLIN)
        if poller.poll(0):
            return super().is_usable()
        return True
