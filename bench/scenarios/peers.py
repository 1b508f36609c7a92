"""Row 4 of ``make bench`` (``--only 4``, BENCHMARKS.md): no-op jobs per second of
procrastinate and django-q2's ORM broker.
"""

from __future__ import annotations

import statistics

from bench.core import Bench, _create_database

PEERS = (
    ("procrastinate", "procrastinate_jobs_per_second"),
    ("django-q2 (ORM broker)", "django_q2_jobs_per_second"),
)


def peer_rates(bench: Bench) -> dict[tuple[str, bool], float]:
    """Each peer's no-op jobs per second, stock and tuned (the median of the
    runs), by (name, tuned): measured once in a run of ``make bench``, for the
    rows that compare Recall with them (4 and 21)."""
    from bench import peers as peer

    if bench.peer_rates:
        return bench.peer_rates
    for name, function in PEERS:
        measure = getattr(peer, function)
        dsn = _create_database(bench.database_url, f"bench_{function[:12]}")
        # Stock: the defaults, what the targets compare with. Tuned: the best
        # documented configuration (bench/peers.py says which and why).
        for tuned in (False, True):
            rates = [
                measure(
                    dsn,
                    jobs=bench.sizes.peer_jobs,
                    processes=bench.p,
                    tuned=tuned,
                    timeout=bench.sizes.peer_timeout,
                )
                for _ in range(bench.sizes.runs)
            ]
            bench.peer_rates[name, tuned] = statistics.median(rates)
    return bench.peer_rates


def peers(bench: Bench) -> None:
    """4: no-op jobs per second of procrastinate and django-q2's ORM broker."""
    model, raw = bench.figures.get("model"), bench.figures.get("raw")
    for (name, tuned), rate in peer_rates(bench).items():
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
