"""Row 14 of ``make bench`` (``--only 14``, BENCHMARKS.md): a thousand idle workers
polling an empty queue, as the reference worker does (poll-min 1 s, poll-max 30 s,
jittered).
"""

from __future__ import annotations

import statistics
import time

from bench.core import Bench, _fleet_workers, _million, _ms, _server_cpu


def idle_fleet(bench: Bench) -> None:
    """14: a thousand idle workers polling an empty queue, as the reference
    worker does (poll-min 1 s, poll-max 30 s, jittered)."""
    import random

    from batches.models import Batch
    from bench.fleet import Fleet
    from bench.loops import utcnow
    from engine.manifests import create_batch
    from jobs import transitions

    sizes = bench.sizes
    _million(bench)  # production-sized tables, nothing claimable in them
    Batch.objects.filter(
        paused_at__isnull=True, cancelled_at__isnull=True, finished_at__isnull=True
    ).exclude(pk=bench.figures["big_batch"]).update(paused_at=utcnow())
    tokens = [token for _, token in _fleet_workers(bench)]
    baseline = _server_cpu(bench, sizes.fleet_baseline_seconds)
    fleet = Fleet(
        "127.0.0.1",
        bench.server_port,
        tokens,
        poll_min=sizes.fleet_poll_min,
        poll_max=sizes.fleet_poll_max,
    )
    fleet.start()
    waits: list[float] = []
    try:
        time.sleep(sizes.fleet_poll_max)  # every worker has polled: steady state
        polls = fleet.polls.value
        cpu = _server_cpu(bench, sizes.fleet_cpu_seconds)
        rate = (fleet.polls.value - polls) / sizes.fleet_cpu_seconds
        for trial in range(sizes.fleet_trials):
            # Long enough for the last claimer to be back at poll-max; a random
            # phase of the fleet's polls.
            time.sleep(random.uniform(1.5, 2.0) * sizes.fleet_poll_max)
            line = [f"s3://bench/fleet/{trial}.wav\n"]
            batch = create_batch(f"bench-fleet-{trial}", lambda line=line: iter(line))
            created = time.time()
            claimed, _ = fleet.next_claim(timeout=10 * sizes.fleet_poll_max)
            waits.append(claimed - created)
            time.sleep(0.5)  # its completion, then what the sweep would do
            transitions.settle(Batch.objects.filter(pk=batch.pk), now=utcnow())
        errors = fleet.errors.value
    finally:
        fleet.stop()
    if errors:
        raise RuntimeError(f"the idle fleet got {errors} answers but 204 and 200")
    total = sum(cpu.values())
    parts = " + ".join(f"{name} {share:.1f}%" for name, share in cpu.items())
    idle_parts = " + ".join(f"{share:.1f}%" for share in baseline.values())
    bench.add(
        "14",
        "idle fleet",
        f"server CPU, {len(tokens):,} workers polling ({rate:.0f} claims/s; "
        f"{idle_parts} without them)",
        f"{total:.1f}% of one core ({parts})",
        "<= 10% of one core",
        total <= 10,
    )
    bench.add(
        "14",
        "idle fleet",
        f"a new batch's wait for its first claim, median (max) of {len(waits)}",
        f"{_ms(statistics.median(waits))} ({_ms(max(waits))})",
    )
