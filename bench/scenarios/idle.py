"""Row 5 of ``make bench`` (``--only 5``, BENCHMARKS.md): claims on an empty queue with
a million finished jobs and live leases.
"""

from __future__ import annotations

import statistics

from bench.core import Bench, _ms, _pct, _rate, _seed_million, _workers


def idle(bench: Bench) -> None:
    """5: claims on an empty queue with a million finished jobs and live leases."""
    from bench import loops

    _seed_million(bench)
    workers = _workers(bench.p)
    latencies: list[float] = []
    rates = []
    for _ in range(bench.sizes.runs):
        # The rate with P clients at once (the CPU saturated); the server time
        # with one (P clients on 2 cores would measure their queueing).
        for clients in (workers, workers[:1]):
            results = loops.run(
                "idle_claim",
                [{"token": t} for _, t in clients],
                duration=bench.sizes.idle_seconds,
            )
            statuses = {s for r in results for s in r["statuses"]}
            if statuses != {204}:
                raise RuntimeError(f"idle claims answered {statuses}, not only 204")
            if len(clients) > 1:
                rates.append(_rate(results))
            else:
                latencies.extend(results[0]["latencies"])
    p50, p99 = _pct(latencies, 0.5), _pct(latencies, 0.99)
    label = f"{bench.sizes.finished:,} done + {bench.sizes.live_leases:,} live leases"
    bench.add(
        "5",
        "idle claims",
        f"claims/s, P={bench.p} ({label})",
        f"{statistics.median(rates):.0f}/s",
    )
    bench.add(
        "5",
        "idle claims",
        "server time p50 / p99 (one client)",
        f"{_ms(p50)} / {_ms(p99)}",
        "<= 3 ms / <= 15 ms",
        p50 <= 0.003 and p99 <= 0.015,
    )
