"""Row 15 of ``make bench`` (``--only 15``, BENCHMARKS.md): idle workers long-polling
an empty queue, then a batch for all of them.
"""

from __future__ import annotations

import statistics
import time

from bench.core import Bench, _million, _ms, _pct, _server_cpu, _workers_named


def long_poll(bench: Bench) -> None:
    """15: idle workers long-polling an empty queue, then a batch for all of them."""
    from batches.models import Batch
    from bench import seed
    from bench.long_poll import LongPollFleet
    from bench.loops import utcnow
    from engine.manifests import create_batch
    from jobs import transitions
    from jobs.models import Job, JobStatus

    sizes = bench.sizes
    n = sizes.long_poll_workers
    _million(bench)  # production-sized tables, nothing claimable in them
    Batch.objects.filter(
        paused_at__isnull=True, cancelled_at__isnull=True, finished_at__isnull=True
    ).exclude(pk=bench.figures["big_batch"]).update(paused_at=utcnow())
    # Workers that hold a lease all along and heartbeat it every second.
    side = seed.batch(
        "bench-long-poll-side", now=utcnow(), queued=sizes.long_poll_beaters
    )
    leases = []
    for worker, token in _workers_named("bench-lp-busy", sizes.long_poll_beaters):
        job = transitions.claim_next(worker)
        if job is None or job.batch_id != side.pk:
            raise RuntimeError("the heartbeating workers did not get their leases")
        leases.append((token, job.pk, job.lease_token))
    tokens = [token for _, token in _workers_named("bench-lp", n)]
    baseline = _server_cpu(bench, sizes.fleet_baseline_seconds)
    fleet = LongPollFleet(
        "127.0.0.1",
        bench.server_port,
        tokens,
        leases,
        wait=sizes.long_poll_wait,
        interval=sizes.heartbeat_interval,
        spread=sizes.long_poll_spread,
    )
    fleet.start()
    try:
        time.sleep(1)
        # The 20 heartbeating workers alone: what the waiting ones add is the rest.
        beaters = _server_cpu(bench, sizes.fleet_baseline_seconds)
        fleet.go.set()
        deadline = time.monotonic() + 120
        while fleet.polls.value < n:  # every worker has claimed once: all wait
            if time.monotonic() > deadline:
                raise RuntimeError("the long-polling fleet did not start")
            time.sleep(0.1)
        time.sleep(1)
        waiting = time.time()  # heartbeats count from here: all workers wait
        polls = fleet.polls.value
        cpu = _server_cpu(bench, sizes.long_poll_cpu_seconds)
        rate = (fleet.polls.value - polls) / sizes.long_poll_cpu_seconds
        lines = [f"s3://bench/long-poll/{i}.wav\n" for i in range(n)]
        batch = create_batch("bench-long-poll", lambda: iter(lines))
        created = time.time()
        picked = [fleet.next_claim(timeout=60)[0] - created for _ in range(n)]
        time.sleep(3 * sizes.heartbeat_interval)  # the new leases heartbeat too
        errors = fleet.errors.value
    finally:
        beats = fleet.stop()
    latencies = [latency for sent, latency in beats if sent >= waiting]
    if errors:
        raise RuntimeError(f"the long-polling fleet got {errors} unexpected answers")
    leased = Job.objects.filter(batch=batch, status=JobStatus.LEASED).count()
    total = sum(cpu.values())
    beating = sum(beaters.values())
    parts = " + ".join(f"{name} {share:.1f}%" for name, share in cpu.items())
    idle_parts = " + ".join(f"{share:.1f}%" for share in baseline.values())
    label = f"{n:,} workers waiting {sizes.long_poll_wait:g} s per claim"
    bench.add(
        "15",
        "long-poll",
        f"server CPU, {label} ({rate:.0f} claims/s): all, less the "
        f"{sizes.long_poll_beaters} heartbeating workers' {beating:.1f}% "
        f"({idle_parts} with neither)",
        f"{total - beating:.1f}% of one core (all: {total:.1f}%: {parts})",
        "<= 10% of one core",
        total - beating <= 10,
    )
    bench.add(
        "15",
        "long-poll",
        f"a {n}-item batch: all claimed after (median pick-up); {leased} leased",
        f"{_ms(max(picked))} ({_ms(statistics.median(picked))})",
        "<= 2 s (<= 0.5 s)",
        max(picked) <= 2 and statistics.median(picked) <= 0.5 and leased == n,
    )
    bench.add(
        "15",
        "long-poll",
        f"heartbeat p50 / p99 / max ({len(latencies)} heartbeats: "
        f"{sizes.long_poll_beaters} leases every {sizes.heartbeat_interval:g} s "
        f"while all wait and through the batch; the {n} new leases' first "
        f"come one interval after their claims)",
        f"{_ms(_pct(latencies, 0.5))} / {_ms(_pct(latencies, 0.99))} / "
        f"{_ms(max(latencies))}",
        "p99 < 1 s",
        _pct(latencies, 0.99) < 1.0,
    )
