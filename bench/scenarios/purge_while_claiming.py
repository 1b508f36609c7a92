"""Row 17 of ``make bench`` (``--only 17``, BENCHMARKS.md): purge finished batches
(retention) while P workers claim and complete.
"""

from __future__ import annotations

import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench.core import Bench, _ms, _pct, _workers


def purge_while_claiming(bench: Bench) -> None:
    """17: purge finished batches (retention) while P workers claim and complete."""
    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from engine.checks import find_violations
    from engine.retention import purge

    now = utcnow()
    items, batches = bench.sizes.purge_items, bench.sizes.purge_batches
    old = [
        seed.batch(
            f"bench-old-{i}",
            now=now - timedelta(days=40),
            completed=items // batches,
            analyze=i == batches - 1,
        ).pk
        for i in range(batches)
    ]
    Batch.objects.filter(pk__in=old).update(finished_at=now - timedelta(days=31))
    # Enough queued work that the claimers outlast the time before the purge
    # and the purge (at most about 1,000 claims a second here, and at least
    # as many claims as items purged: a paced purge ran them dry at half).
    side = seed.batch(
        "bench-purge-side",
        now=now - timedelta(seconds=1),
        queued=max(2_000, items + int(1_000 * bench.sizes.purge_baseline_seconds)),
        priority=20,
    )
    workers = _workers(bench.p)
    stop = Path(tempfile.mkdtemp()) / "stop"
    claims: list[dict] = []
    going = threading.Event()
    thread = threading.Thread(
        target=lambda: claims.extend(
            loops.run(
                "model",
                [
                    {
                        "worker": w.pk,
                        "latency": True,
                        "stamps": True,
                        "stop_file": str(stop),
                    }
                    for w, _ in workers
                ],
                duration=3_600,
                started=going,
            )
        )
    )
    thread.start()
    going.wait(timeout=180)
    # The same claims before the purge: what this machine gives without one.
    quiet_from = time.time() + 0.5
    time.sleep(0.5 + bench.sizes.purge_baseline_seconds)
    began = time.time()
    started = time.perf_counter()
    report = purge(older_than=timedelta(days=30))
    took = time.perf_counter() - started
    ended = time.time()
    stop.touch()
    thread.join()
    Batch.objects.filter(pk=side.pk).update(paused_at=utcnow())
    stamped = [
        (at, latency)
        for r in claims
        for at, latency in zip(r["stamps"], r["latencies"], strict=True)
    ]
    waits = [latency for at, latency in stamped if began <= at <= ended]
    quiet = [latency for at, latency in stamped if quiet_from <= at < began]
    done = sum(r["done"] for r in claims)
    left = Batch.objects.filter(pk__in=old).count()
    violations = find_violations()
    bench.add(
        "17",
        "purge",
        f"delete {report.jobs:,} finished items in {len(report.batches)} batches "
        f"(P={bench.p} claiming)",
        f"{took:.1f} s = {report.jobs / took:,.0f} items/s",
        "all gone",
        report.jobs == items and left == 0,
    )
    bench.add(
        "17",
        "purge",
        f"longest claim meanwhile (p99), of {len(waits):,}; {done:,} completed",
        f"{_ms(max(waits))} ({_ms(_pct(waits, 0.99))})",
        "<= 200 ms",
        bool(waits) and max(waits) <= 0.2,
    )
    bench.add(
        "17",
        "purge",
        f"the same claims just before the purge, {len(quiet):,}; longest purge chunk",
        f"{_ms(max(quiet))} ({_ms(_pct(quiet, 0.99))}); {_ms(report.longest_chunk)}",
    )
    bench.add(
        "17",
        "purge",
        "claims over 200 ms: during the purge / just before",
        f"{sum(w > 0.2 for w in waits)} of {len(waits):,} / "
        f"{sum(w > 0.2 for w in quiet)} of {len(quiet):,}",
    )
    bench.add(
        "17",
        "purge",
        "recall_check after the purge",
        f"{len(violations)} violations",
        "0",
        not violations,
    )
