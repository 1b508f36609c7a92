"""Row 4 of ``make bench`` (``--only 4``, BENCHMARKS.md): no-op jobs per second of
procrastinate and django-q2's ORM broker.
"""

from __future__ import annotations

import statistics

from bench.core import Bench, _create_database


def peers(bench: Bench) -> None:
    """4: no-op jobs per second of procrastinate and django-q2's ORM broker."""
    from bench import peers as peer

    model, raw = bench.figures.get("model"), bench.figures.get("raw")
    for name, measure in (
        ("procrastinate", peer.procrastinate_jobs_per_second),
        ("django-q2 (ORM broker)", peer.django_q2_jobs_per_second),
    ):
        dsn = _create_database(bench.database_url, f"bench_{measure.__name__[:12]}")
        # Stock: the defaults, what the targets compare with. Tuned: the best
        # documented configuration (bench/peers.py says which and why).
        for tuned in (False, True):
            rates = [
                measure(dsn, jobs=bench.sizes.peer_jobs, processes=bench.p, tuned=tuned)
                for _ in range(bench.sizes.runs)
            ]
            rate = statistics.median(rates)
            label = f"peer: {name}, {'tuned' if tuned else 'stock'}"
            if not (model and raw):
                bench.add("4", label, "no-op jobs/s", f"{rate:.0f}/s")
                continue
            bench.add(
                "4",
                label,
                f"no-op jobs/s, P={bench.p}",
                f"{rate:.0f}/s = {rate / raw:.2f} x raw; Recall {model / rate:.2f} x",
                "" if tuned else "Recall ahead",
                None if tuned else model > rate,
            )
