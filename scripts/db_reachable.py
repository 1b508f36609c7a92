"""Exit 0 if the PostgreSQL server in the URL accepts a connection, else 1."""

import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg

url = urlsplit(sys.argv[1])
if url.scheme not in ("postgres", "postgresql", "pgsql"):
    sys.exit(1)
# Connect to the maintenance database: the named one may not exist yet.
server = urlunsplit(("postgresql", url.netloc, "/postgres", url.query, ""))
try:
    psycopg.connect(server, connect_timeout=3).close()
except psycopg.Error:
    sys.exit(1)
