"""gunicorn settings for Recall: ``gunicorn -c gunicorn.conf.py``.

Every value can be overridden from the environment (see
docs/reference/configuration.md). Before the first worker starts, the master
runs a start-up sweep: expired leases are reclaimed and the records reconciled,
so a restart after a crash heals first.

Threads, not processes, carry the requests (the ``gthread`` worker): a request
that takes long, an export of a million items streaming for a minute or a
background intake's upload, holds one thread of one process while the other
threads go on answering the worker API. With sync workers it held a whole
process, and a handful of operators exporting at once held them all: heartbeats
queued behind the exports and healthy leases expired. Each thread keeps its
own persistent database connection (settings.py).

The worker API's request metrics are prometheus_client multiprocess metrics:
each worker writes its own files in ``PROMETHEUS_MULTIPROC_DIR`` (set here
before any worker starts, emptied at start), and a worker that exits has its
counts folded into an archive (``recall_site/metric_files.py``).

The files the processes share (those metrics, the long-poll probe's answer and
nudge sockets, spooled request bodies) live in Recall's private run directory
(``RECALL_RUN_DIR``, by default ``recall-<uid>`` in the temporary directory;
``recall_site/rundir.py``): created with mode 0700 and checked before the
first worker starts. The server refuses to start if it, or a
``PROMETHEUS_MULTIPROC_DIR`` given, is not its own.
"""

import contextlib
import glob
import os
import shutil

wsgi_app = "recall_site.wsgi:application"
bind = os.environ.get("RECALL_BIND", "127.0.0.1:8000")
# Processes x threads. Python runs one thread at a time per process, so the
# processes use the cores (cores + 1: one more keeps the cores busy while a
# process waits on the database); the threads are there to wait: on
# PostgreSQL, on a slow client, on an export's next chunk. 8 threads per
# process keep the worker API's throughput (BENCHMARKS.md, HTTP row) and leave
# room for several long exports per process. RECALL_WEB_THREADS=1 runs the old
# sync workers.
workers = int(os.environ.get("WEB_CONCURRENCY", str((os.cpu_count() or 1) + 1)))
threads = int(os.environ.get("RECALL_WEB_THREADS", "8"))
# gunicorn's gthread worker, listening only while a thread is free (see
# recall_site/gunicorn_worker.py): a heartbeat never queues behind an export in
# a process whose threads are all busy while another process has one free.
worker_class = "recall_site.gunicorn_worker.ThreadWorker" if threads > 1 else "sync"
os.environ["RECALL_WEB_THREADS"] = str(threads)
timeout = 60
graceful_timeout = 30
keepalive = 5
# Recycle workers now and then so a slow leak can never grow without bound.
max_requests = 20_000
max_requests_jitter = 2_000
# gunicorn's control socket (``gunicornc``) is one path per user by default
# ($XDG_RUNTIME_DIR/gunicorn.ctl or $HOME/.gunicorn/gunicorn.ctl), which each
# master binds again after every fork: two Recall nodes on one host took it
# from each other, and the first to stop removed it for both. Off unless
# RECALL_CONTROL_SOCKET names this master's own path.
if os.environ.get("RECALL_CONTROL_SOCKET"):
    control_socket = os.environ["RECALL_CONTROL_SOCKET"]
else:
    control_socket_disable = True
accesslog = os.environ.get("RECALL_ACCESS_LOG", "-")
# gunicorn's logger, whose access lines cost less to gather (the same lines).
logger_class = "recall_site.gunicorn_worker.AccessLogger"
errorlog = "-"
if os.environ.get("LOG_FORMAT", "text") == "json":
    # One JSON object per line on stdout, error and access log alike.
    from recall_site.logs import gunicorn_logging

    logconfig_dict = gunicorn_logging(os.environ.get("LOG_LEVEL", "INFO"), accesslog)

# Recall's private run directory (checked in on_starting), for the workers too.
from recall_site import rundir  # noqa: E402 (standard library only)

RUN_DIR = os.environ[rundir.ENV] = os.path.abspath(rundir.path())
# One metrics directory per server; by default a fresh one in the run directory
# named after the master, which a configuration reload (same master) finds again.
OWN_METRICS_DIR = os.path.join(RUN_DIR, f"metrics-{os.getpid()}")
METRICS_DIR = os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", OWN_METRICS_DIR)

# full: check every job and recount counters; quick: a normal sweep; off: none.
STARTUP_SWEEP = os.environ.get("RECALL_STARTUP_SWEEP", "full")


def on_starting(server):
    from api import worker_limits
    from recall_site import metric_files
    from recall_site.gunicorn_worker import remove_leftovers

    owner = (server.cfg.uid, server.cfg.gid)  # the workers' user (--user)
    try:
        rundir.ensure(RUN_DIR, owner=owner)
        rundir.ensure(
            METRICS_DIR, owner=owner, others_may_read=METRICS_DIR != OWN_METRICS_DIR
        )
    except rundir.UnsafeDirectory as error:
        message = f"Recall will not start: {error}."
        server.log.error(message)
        raise SystemExit(message) from None
    metric_files.prepare(METRICS_DIR)
    # The per-worker limits' shared table, made before the first fork so that
    # every worker process counts in it (api/worker_limits.py).
    worker_limits.prepare()
    for path in remove_leftovers(RUN_DIR):
        server.log.info("removed %s, left by a server no longer running", path)
    if STARTUP_SWEEP == "off":
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "recall_site.settings")
    import django

    django.setup()
    from django.db import connections

    from engine.sweep import sweep
    from jobs.exceptions import DATABASE_DOWN

    try:
        report = sweep(full=STARTUP_SWEEP == "full")
        server.log.info("start-up sweep done: %s", report["reclaimed"])
    except DATABASE_DOWN as error:
        # An outage, not a bug: one line, as the API's 503s log it.
        server.log.error("start-up sweep failed, database unavailable: %s", error)
    except Exception:
        # Serve anyway: the scheduled sweep retries, and /readyz reports a sweep
        # that has not run.
        server.log.exception("start-up sweep failed")
    finally:
        # Never share a connection with forked workers: each opens its own.
        connections.close_all()


def post_worker_init(worker):
    """Recall is loaded in this worker: take its start-up objects out of the
    garbage collector's reach (``gc.freeze``).

    A Django process holds some 80,000 objects once loaded, and every full
    collection walks them all: about 40 ms of CPU here, while no other thread
    of the process runs. On a busy machine such a pause stretches to several
    hundred milliseconds: in the bench's claiming processes, which stand for
    web workers, they were the slowest claims (BENCHMARKS.md, row 17). Objects
    made at start-up live as long as the process, so walking them again and
    again finds nothing. The URLconf is loaded first, so that every view is
    frozen too.
    """
    import gc

    from django.urls import get_resolver

    from recall_site.gunicorn_worker import free_large_allocations

    free_large_allocations()

    get_resolver().url_patterns  # noqa: B018 (imports every view)
    gc.freeze()


def child_exit(server, worker):
    from api import worker_limits
    from recall_site import metric_files

    metric_files.retire(worker.pid, METRICS_DIR)
    # Its waiting claims went with it (killed or not): stop counting them.
    worker_limits.forget_process(worker.pid)


def on_exit(server):
    from recall_site.gunicorn_worker import probe_file

    own = probe_file(os.getpid(), RUN_DIR)
    for path in [own, *glob.glob(glob.escape(own) + "-*.sock")]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    if METRICS_DIR == OWN_METRICS_DIR:
        shutil.rmtree(METRICS_DIR, ignore_errors=True)
