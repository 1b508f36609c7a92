"""One harness for everything that runs a real Recall: the tests, `make chaos`,
`make bench` and `make demo` start the server and the database through it.

``harness.server`` starts gunicorn with ``gunicorn.conf.py`` (optionally under
libfaketime, on PostgreSQL or SQLite) and any other child process in a session
of its own; ``harness.pgserver`` starts a private PostgreSQL server. Standard
library only, so `make demo` (the runtime requirements alone) can use it, and
nothing here imports Django or the tests.
"""
