"""Row 6 of ``make bench`` (``--only 6``, BENCHMARKS.md): reclaim the live leases once
they have expired, with claims going on.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from bench.core import Bench, _ms, _pct, _workers
from bench.scenarios.idle import idle


def sweep(bench: Bench) -> None:
    """6: reclaim the live leases once they have expired, with claims going on."""
    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from engine.sweep import sweep as run_sweep
    from jobs.models import Job

    big = bench.figures.get("big_batch")
    if big is None:
        idle(bench)
        big = bench.figures["big_batch"]
    now = utcnow()
    expired = seed.expire_leases(big, at=now - timedelta(seconds=1))
    side = seed.batch(
        "bench-side",
        now=now - timedelta(seconds=1),
        queued=max(5_000, bench.sizes.throughput_jobs // 2),
        priority=10,
    )
    workers = _workers(bench.p)
    claims: list[dict] = []
    going = threading.Event()
    thread = threading.Thread(
        target=lambda: claims.extend(
            loops.run(
                "model",
                [{"worker": w.pk, "latency": True} for w, _ in workers],
                duration=max(3.0, bench.sizes.throughput_seconds / 2),
                started=going,
            )
        )
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)  # the claimers are going
    # The sweep runs in a thread of its own; reclaiming is its first step (and
    # claims reclaim some too): the time is until no expired lease is left.
    swept: dict[str, float] = {}

    def sweep_once() -> None:
        from django.db import connection

        t0 = time.perf_counter()
        run_sweep()
        swept["all"] = time.perf_counter() - t0
        connection.close()

    started = time.perf_counter()
    sweeper = threading.Thread(target=sweep_once)
    sweeper.start()
    while Job.objects.expired(utcnow()).exists():
        time.sleep(0.005)
    took = time.perf_counter() - started
    sweeper.join()
    thread.join()
    Batch.objects.filter(pk=side.pk).update(paused_at=utcnow())
    waits = [x for r in claims for x in r["latencies"]]
    bench.add(
        "6",
        "sweep",
        f"reclaim {expired:,} expired leases (P={bench.p} claiming)",
        f"{took:.2f} s",
        "<= 2 s",
        took <= 2.0,
    )
    bench.add(
        "6",
        "sweep",
        "the whole sweep (reclaim, reconcile scan, settle)",
        f"{swept['all']:.2f} s",
    )
    bench.add(
        "6",
        "sweep",
        "longest claim meanwhile (p99)",
        f"{_ms(max(waits))} ({_ms(_pct(waits, 0.99))})",
        "<= 200 ms",
        max(waits) <= 0.2,
    )
