"""Row 13 of ``make bench`` (``--only 13``, BENCHMARKS.md): GET /metrics with a million
jobs, as Prometheus scrapes it.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from datetime import timedelta

from bench.core import Bench, _fleet_workers, _million, _ms, _workers
from bench.cpu import cpu_seconds


def metrics_scrape(bench: Bench) -> None:
    """13: GET /metrics with a million jobs, as Prometheus scrapes it."""
    import http.client

    from django.db.models import Count
    from prometheus_client.parser import text_string_to_metric_families

    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.models import Job, Worker

    _million(bench)
    now = utcnow()
    sizes = bench.sizes
    if not Batch.objects.filter(name__startswith="bench-mix-").exists():
        for i in range(sizes.mix_finished):
            seed.batch(f"bench-mix-done-{i}", now=now, completed=200)
        for i in range(sizes.mix_open):
            seed.batch(f"bench-mix-open-{i}", now=now, completed=100, queued=400)
    fleet = _fleet_workers(bench)
    Worker.objects.filter(pk__in=[w.pk for w, _ in fleet[::2]]).update(last_seen=now)
    token = os.environ["RECALL_METRICS_TOKEN"]

    def scrape() -> tuple[float, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", bench.server_port)
        started = time.perf_counter()
        connection.request(
            "GET", "/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        response = connection.getresponse()
        body = response.read()
        took = time.perf_counter() - started
        connection.close()
        if response.status != 200:
            raise RuntimeError(f"GET /metrics answered {response.status}: {body[:200]}")
        return took, body

    for _ in range(10):  # every gunicorn process answers its first request
        scrape()
    # The stall check reads a batch's live leases until it finds a recent
    # heartbeat: with silent leases (a stalled batch) it reads all of them.
    big = Job.objects.filter(batch_id=bench.figures["big_batch"], status="leased")
    big.update(heartbeat_at=now - timedelta(minutes=10))
    silent = [scrape()[0] for _ in range(sizes.scrapes)]
    big.update(heartbeat_at=utcnow())  # workers heartbeating, as they do
    quiet = [scrape()[0] for _ in range(sizes.scrapes)]
    body = scrape()[1]
    shown = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(body.decode())
        if family.name == "recall_jobs"
        for sample in family.samples
    }
    # The CPU a scrape costs, app and database: unlike its wall time, it does
    # not grow when other processes share the cores.
    from django.db import connection
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")  # loads the URLs
    # /proc counts in ticks (10 ms): the database's share is taken over them all.
    app, database = time.process_time(), cpu_seconds(backend)
    for _ in range(sizes.scrapes):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
        if response.status_code != 200:
            raise RuntimeError(f"GET /metrics answered {response.status_code}")
    app = (time.process_time() - app) / sizes.scrapes
    database = (cpu_seconds(backend) - database) / sizes.scrapes
    fresh = dict(Job.objects.values_list("status").annotate(n=Count("pk")).order_by())
    exact = all(shown[s] == fresh.get(s, 0) for s in shown)
    jobs = sum(fresh.values())

    load = seed.batch(
        "bench-scrape-load", now=now, queued=sizes.throughput_jobs, priority=10
    )
    going = threading.Event()
    thread = threading.Thread(
        target=loops.run,
        args=("model", [{"worker": w.pk} for w, _ in _workers(bench.p)]),
        kwargs={"duration": max(3.0, sizes.throughput_seconds), "started": going},
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)
    loaded = [scrape()[0] for _ in range(sizes.scrapes)]
    thread.join()
    Batch.objects.filter(pk=load.pk).update(paused_at=utcnow())

    label = (
        f"{jobs:,} jobs ({sizes.live_leases:,} leased), {Batch.objects.count()} "
        f"batches, {Worker.objects.count():,} workers"
    )
    median = statistics.median(quiet)
    bench.add(
        "13",
        "metrics",
        f"GET /metrics over HTTP, median (max), {label}",
        f"{_ms(median)} ({_ms(max(quiet))})",
        "< 50 ms",
        median < 0.05,
    )
    bench.add(
        "13",
        "metrics",
        f"CPU per scrape, mean of {sizes.scrapes}: app + database",
        f"{_ms(app + database)} ({_ms(app)} + {_ms(database)})",
    )
    bench.add(
        "13",
        "metrics",
        f"the same with the {bench.sizes.live_leases:,} leases silent (stalled)",
        f"{_ms(statistics.median(silent))} ({_ms(max(silent))})",
    )
    bench.add(
        "13",
        "metrics",
        f"the same while P={bench.p} workers claim and complete",
        f"{_ms(statistics.median(loaded))} ({_ms(max(loaded))})",
    )
    bench.add(
        "13",
        "metrics",
        "recall_jobs equals a fresh count of the jobs",
        "yes" if exact else "NO",
        "exact",
        exact,
    )
