"""gunicorn settings for Recall: ``gunicorn -c gunicorn.conf.py``.

Every value can be overridden from the environment (see the README). Before the
first worker starts, the master runs a start-up sweep: expired leases are
reclaimed and the records reconciled, so a restart after a crash heals first.

The worker API's request metrics are prometheus_client multiprocess metrics:
each worker writes its own files in ``PROMETHEUS_MULTIPROC_DIR`` (set here
before any worker starts, emptied at start), and a worker that exits has its
counts folded into an archive (``observability/multiprocess.py``).
"""

import os
import shutil
import tempfile

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
if os.environ.get("LOG_FORMAT", "text") == "json":
    # One JSON object per line on stdout, error and access log alike.
    from recall_site.logs import gunicorn_logging

    logconfig_dict = gunicorn_logging(os.environ.get("LOG_LEVEL", "INFO"), accesslog)

# One directory per server; by default a fresh one named after the master, which
# a configuration reload (same master) finds again.
OWN_METRICS_DIR = os.path.join(tempfile.gettempdir(), f"recall-metrics-{os.getpid()}")
METRICS_DIR = os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", OWN_METRICS_DIR)

# full: check every job and recount counters; quick: a normal sweep; off: none.
STARTUP_SWEEP = os.environ.get("RECALL_STARTUP_SWEEP", "full")


def on_starting(server):
    from observability import multiprocess

    multiprocess.prepare(METRICS_DIR)
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


def child_exit(server, worker):
    from observability import multiprocess

    multiprocess.retire(worker.pid, METRICS_DIR)


def on_exit(server):
    if METRICS_DIR == OWN_METRICS_DIR:
        shutil.rmtree(METRICS_DIR, ignore_errors=True)
