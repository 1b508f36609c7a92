"""System tests: Recall as it runs, not its parts. A real server (gunicorn with
gunicorn.conf.py through ``harness/``) on the test database or a private
PostgreSQL server, real clients over sockets, a real browser (``browser/``),
the chaos run (``chaos.py``, also ``make chaos``), the README's quick start and
``make bench``."""
