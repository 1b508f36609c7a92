"""gunicorn settings for Recall: ``gunicorn -c gunicorn.conf.py``.

Every value can be overridden from the environment (see the README). Before the
first worker starts, the master runs a start-up sweep: expired leases are
reclaimed and the records reconciled, so a restart after a crash heals first.
"""

import os

wsgi_app = "recall_site.wsgi:application"
bind = os.environ.get("RECALL_BIND", "127.0.0.1:8000")
# gunicorn's documented starting point, 2 x cores + 1: sync workers each wait on
# the database for part of every request (see BENCHMARKS.md).
workers = int(os.environ.get("WEB_CONCURRENCY", str(2 * (os.cpu_count() or 1) + 1)))
threads = int(os.environ.get("RECALL_WEB_THREADS", "1"))
worker_class = "gthread" if threads > 1 else "sync"
timeout = 60
graceful_timeout = 30
keepalive = 5
# Recycle workers now and then so a slow leak can never grow without bound.
max_requests = 20_000
max_requests_jitter = 2_000
accesslog = os.environ.get("RECALL_ACCESS_LOG", "-")
errorlog = "-"

# full: check every job and recount counters; quick: a normal sweep; off: none.
STARTUP_SWEEP = os.environ.get("RECALL_STARTUP_SWEEP", "full")


def on_starting(server):
    if STARTUP_SWEEP == "off":
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "recall_site.settings")
    import django

    django.setup()
    from django.db import connections

    from jobs.sweep import sweep

    try:
        report = sweep(full=STARTUP_SWEEP == "full")
        server.log.info("start-up sweep done: %s", report["reclaimed"])
    except Exception:
        # Serve anyway: the scheduled sweep retries, and /readyz reports a sweep
        # that has not run.
        server.log.exception("start-up sweep failed")
    finally:
        connections.close_all()  # never share a connection with forked workers
