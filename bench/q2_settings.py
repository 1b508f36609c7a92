"""Standalone Django settings for the django-q2 peer benchmark (bench/peers.py).

Only django-q2 and its ORM broker: no Recall app, no admin, no auth. The database
comes from ``BENCH_Q2_DATABASE_URL`` (a libpq URL, parsed with django-environ) and
the number of worker processes from ``BENCH_Q2_WORKERS``. ``Q_CLUSTER`` holds
django-q2's best documented throughput configuration for the ORM broker; the
reason for each setting is in the module docstring of ``bench.peers``. With
``BENCH_Q2_TUNED=0`` it holds the defaults instead (the ORM broker and the
worker count are all that is set), as a user who follows the quickstart runs it.
"""

import os

import environ

_WORKERS = int(os.environ.get("BENCH_Q2_WORKERS", "1"))

# Throwaway: django-q2 signs task packages with it; nothing here is deployed.
SECRET_KEY = "bench-q2-not-a-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_q"]
DATABASES = {
    "default": {
        **environ.Env.db_url_config(
            os.environ.get("BENCH_Q2_DATABASE_URL", "postgres://127.0.0.1:5432/bench")
        ),
        # Persistent connections (Django's documented setting): with the default 0,
        # the ORM broker's close_old_connections() reconnects on every dequeue and
        # acknowledgement.
        "CONN_MAX_AGE": 60,
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

Q_CLUSTER = {
    "name": "bench",
    "orm": "default",  # the ORM broker: queue rows in django_q_ormq
    "workers": _WORKERS,
    "sync": False,  # really run tasks in the cluster's worker processes
    "bulk": 10,  # dequeue 10 tasks per broker call (the ORM example in the docs)
    "queue_limit": max(50, _WORKERS**2),  # tasks held in memory by the cluster
    "poll": 0.2,  # the documented default: only matters once the queue is empty
    "save_limit": -1,  # no success storage: no Success row, no pruning scan
    "ack_failures": True,  # a failed task leaves the queue (and is saved as failed)
    "recycle": 1_000_000,  # no worker restarts during a run (the default is 500)
    "compress": False,  # documented as overhead for many small packages
    "scheduler": False,  # no schedules: skip the guard's scheduler queries
    "catch_up": False,
    "timeout": 30,  # must stay below retry (django-q2 warns otherwise)
    "retry": 60,
    "cpu_affinity": 0,
    "log_level": "WARNING",  # no log line per task
}

if os.environ.get("BENCH_Q2_TUNED", "1") == "0":
    Q_CLUSTER = {
        "name": "bench",
        "orm": "default",
        "workers": _WORKERS,
        "timeout": 30,  # must stay below retry (django-q2 warns otherwise)
        "retry": 60,
    }
