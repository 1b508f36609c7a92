"""Row 10 of ``make bench`` (``--only 10``, BENCHMARKS.md): throughput after sustained
load vs its first minute (bloat in check).
"""

from __future__ import annotations

from bench.core import Bench, _queue, _workers


def sustained(bench: Bench) -> None:
    """10: throughput after sustained load vs its first minute (bloat in check)."""
    from django.db import connection

    from bench import loops

    rate = bench.figures.get("model") or 1_500  # without scenario 2: a guess above it
    seconds, bucket = bench.sizes.sustain_seconds, bench.sizes.sustain_bucket
    jobs = int(max(2_000, rate * seconds * 1.3))
    workers = _workers(bench.p)
    _queue(bench, jobs, history=min(jobs, 100_000))
    results = loops.run(
        "model",
        [{"worker": w.pk, "bucket": bucket} for w, _ in workers],
        duration=seconds,
    )
    buckets = [0] * max(len(r["buckets"]) for r in results)
    for r in results:
        for i, n in enumerate(r["buckets"]):
            buckets[i] += n
    full = buckets[: int(seconds // bucket)]  # whole buckets only
    if len(full) < 2 or not full[0]:
        raise RuntimeError(f"sustained run too short or empty: {buckets}")
    ratio = full[-1] / full[0]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup, n_live_tup, autovacuum_count FROM pg_stat_user_tables "
            "WHERE relname = 'jobs_job'"
        )
        dead, live, autovacuums = cursor.fetchone()
    bench.add(
        "10",
        "sustained load",
        f"last vs first {bucket:.0f} s of {seconds:.0f} s (model layer, P={bench.p})",
        f"{full[-1] / bucket:.0f}/s vs {full[0] / bucket:.0f}/s = {ratio:.2f}",
        ">= 0.80",
        ratio >= 0.8,
    )
    bench.add(
        "10",
        "sustained load",
        "jobs table at the end",
        f"{live:,} live, {dead:,} dead tuples, autovacuumed {autovacuums} times",
    )
