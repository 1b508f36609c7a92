"""Row 11 of ``make bench`` (``--only 11``, BENCHMARKS.md): claims among 1, 100 and
1,000 open batches of one priority (fair share).
"""

from __future__ import annotations

import statistics

from bench.core import Bench, _ms, _pct, _queue, _rate, _workers


def fair_share(bench: Bench) -> None:
    """11: claims among 1, 100 and 1,000 open batches of one priority (fair share)."""
    from bench import loops

    workers = _workers(bench.p)
    rates: dict[int, list[float]] = {n: [] for n in bench.sizes.share_batches}
    latencies: dict[int, list[float]] = {n: [] for n in bench.sizes.share_batches}
    for _ in range(bench.sizes.runs):
        # Interleaved, as scenario 1, so a slow spell hits every size alike.
        for n in bench.sizes.share_batches:
            # Every claim among several batches is charged to its batch's
            # share; among 1,000 each claim goes to another batch's rows.
            _queue(bench, bench.sizes.share_jobs, n)
            results = loops.run(
                "model",
                [{"worker": w.pk} for w, _ in workers],
                duration=bench.sizes.share_seconds,
            )
            rates[n].append(_rate(results))
            _queue(bench, bench.sizes.share_jobs, n)
            (one,) = loops.run(
                "model",
                [{"worker": workers[0][0].pk, "latency": True}],
                duration=bench.sizes.share_seconds,
            )
            latencies[n].extend(one["latencies"])
    first, *_, last = bench.sizes.share_batches
    base = statistics.median(rates[first])
    for n in bench.sizes.share_batches:
        rate = statistics.median(rates[n])
        p50, p99 = _pct(latencies[n], 0.5), _pct(latencies[n], 0.99)
        bench.add(
            "11",
            "fair-share claims",
            f"{n:,} open batch{'es' if n > 1 else ''}: claim p50 / p99 (one "
            f"client); claim+complete/s, P={bench.p}",
            f"{_ms(p50)} / {_ms(p99)}; {rate:.0f}/s = {rate / base:.2f} x 1 batch",
            "<= 3 ms / <= 15 ms; >= 0.80 x 1 batch" if n == last else "",
            (p50 <= 0.003 and p99 <= 0.015 and rate / base >= 0.8)
            if n == last
            else None,
        )
