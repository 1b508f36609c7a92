"""Row 12 of ``make bench`` (``--only 12``, BENCHMARKS.md): operators exporting a
million items at once while workers heartbeat.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from bench.core import Bench, _launch_gunicorn, _ms, _pct, _terminate, _workers_named


def exports_vs_heartbeats(bench: Bench) -> None:
    """12: operators exporting a million items at once while workers heartbeat."""
    import multiprocessing

    from django.contrib.auth import get_user_model
    from django.test import Client

    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.models import Job, JobStatus, Lease, LeaseEnd

    sizes = bench.sizes
    lease_seconds = 15  # the demo's; heartbeats come every `interval` meanwhile
    seed.reset()
    now = utcnow()
    big = seed.batch("bench-export", now=now, completed=sizes.finished)
    side = seed.batch("bench-heartbeat", now=now, queued=sizes.heartbeaters)
    tokens = [t for _, t in _workers_named("bench-hb", sizes.heartbeaters)]
    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_user(
        "bench", is_staff=True, is_superuser=True
    )
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    session = client.cookies["sessionid"].value
    server, port = _launch_gunicorn(RECALL_LEASE_SECONDS=str(lease_seconds))
    done = multiprocessing.get_context("spawn").Event()
    cap = 1800.0  # the exports end it well before
    outcome: dict[str, list[dict]] = {}
    try:
        beating = threading.Thread(
            target=lambda: outcome.update(
                beats=loops.run(
                    "heartbeaters",
                    [
                        {
                            "host": "127.0.0.1",
                            "port": port,
                            "tokens": tokens,
                            "interval": sizes.heartbeat_interval,
                            "timeout": 30.0,
                            "done": done,
                        }
                    ],
                    duration=cap,
                )
            )
        )
        beating.start()
        # The workers hold their leases before the operators start exporting.
        deadline = time.monotonic() + 120
        while Job.objects.filter(batch=side, status=JobStatus.LEASED).count() < len(
            tokens
        ):
            if time.monotonic() > deadline or not beating.is_alive():
                raise RuntimeError("the heartbeating workers did not claim their jobs")
            time.sleep(0.1)
        started = time.perf_counter()
        outcome["exports"] = loops.run(
            "export_clients",
            [
                {
                    "host": "127.0.0.1",
                    "port": port,
                    "batch": big.pk,
                    "session": session,
                    "exports": sizes.exports,
                    "done": done,
                }
            ],
            duration=cap,
        )
        took = time.perf_counter() - started
        beating.join()
        still_live = Job.objects.filter(
            batch=side, status=JobStatus.LEASED, lease_expires_at__gt=utcnow()
        ).count()
    finally:
        done.set()
        _terminate(server)
    exports = outcome["exports"][0]["exports"]
    beats = outcome["beats"][0]
    latencies = beats["latencies"]
    lapsed = sum(1 for gap in beats["gaps"] if gap >= lease_seconds)
    expired = lapsed + (len(tokens) - still_live)
    expired += Lease.objects.filter(
        job__batch=side, end_reason=LeaseEnd.EXPIRED
    ).count()
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(beats["statuses"].items()))
    ok = [e for e in exports if e["status"] == 200 and e["bytes"]]
    refused = ", ".join(str(e["status"]) for e in exports if e not in ok)
    server_model = os.environ.get("RECALL_WEB_THREADS", "8")
    label = (
        f"{sizes.exports} CSV exports of {sizes.finished:,} items, "
        f"{len(tokens)} workers heartbeating every {sizes.heartbeat_interval:g} s"
    )
    bench.add(
        "12",
        "exports vs workers",
        f"{label}: exports done / time",
        f"{len(ok)}/{len(exports)} in {took:.0f} s "
        f"({statistics.median(e['bytes'] for e in exports) / 1e6:.0f} MB each)"
        + (f", others: {refused}" if refused else ""),
        f"all {sizes.exports}",
        len(ok) == len(exports),
    )
    bench.add(
        "12",
        "exports vs workers",
        f"heartbeat p50 / p99 / max ({len(latencies)} heartbeats; {statuses})",
        f"{_ms(_pct(latencies, 0.5))} / {_ms(_pct(latencies, 0.99))} / "
        f"{_ms(max(latencies))}",
        "p99 < 1 s",
        _pct(latencies, 0.99) < 1.0,
    )
    bench.add(
        "12",
        "exports vs workers",
        f"leases expired ({lease_seconds} s leases; threads per process "
        f"{server_model})",
        str(expired),
        "0",
        expired == 0,
    )
