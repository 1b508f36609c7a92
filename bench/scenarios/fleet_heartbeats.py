"""Row 20 of ``make bench`` (``--only 20``, BENCHMARKS.md): a fleet of busy
workers, several leases each, heartbeating once per lease and then once per
worker: the server's CPU of each (issue 26).
"""

from __future__ import annotations

import time

from bench.core import Bench, _ms, _pct, _queue, _server_cpu, _workers_named


def _phase(bench: Bench, workers, *, batched: bool) -> dict:
    """The fleet heartbeating for one interval (every worker has started), then
    the server's CPU over ``beat_seconds``, with the calls and renewals."""
    from bench.beat_fleet import HeartbeatFleet

    sizes = bench.sizes
    fleet = HeartbeatFleet(
        "127.0.0.1",
        bench.server_port,
        workers,
        batched=batched,
        interval=sizes.beat_interval,
    )
    fleet.start()
    try:
        time.sleep(sizes.beat_interval)  # every worker has begun its rounds
        calls, renewed = fleet.polls.value, fleet.renewed.value
        cpu = _server_cpu(bench, sizes.beat_seconds)
        calls = fleet.polls.value - calls
        renewed = fleet.renewed.value - renewed
        errors = fleet.errors.value
    finally:
        latencies = fleet.stop()
    if errors:
        kind = "once per worker" if batched else "once per lease"
        raise RuntimeError(f"heartbeats {kind}: {errors} leases not renewed")
    return {
        "cpu": cpu,
        "calls": calls / sizes.beat_seconds,
        "renewed": renewed / sizes.beat_seconds,
        "latencies": latencies,
    }


def fleet_heartbeats(bench: Bench) -> None:
    """20: busy workers heartbeating their leases once per lease, then once per
    worker (one call for all its leases): the server's CPU of each."""
    from jobs import transitions
    from jobs.models import Job, JobStatus

    sizes = bench.sizes
    n, per = sizes.beat_workers, sizes.beat_leases
    (batch,) = _queue(bench, n * per)
    fleet = _workers_named("bench-beat", n)
    baseline = _server_cpu(bench, sizes.fleet_baseline_seconds)
    # Claimed last, so no lease is old when the first round of heartbeats comes.
    workers = []
    for worker, token in fleet:
        leases = []
        for _ in range(per):
            job = transitions.claim_next(worker)
            if job is None:
                raise RuntimeError("the heartbeating workers did not get their leases")
            leases.append((job.pk, job.lease_token))
        workers.append((token, leases))
    # The same leases, the same fleet, one way and then the other.
    single = _phase(bench, workers, batched=False)
    batched = _phase(bench, workers, batched=True)
    live = Job.objects.filter(batch_id=batch, status=JobStatus.LEASED).count()

    idle = " + ".join(f"{share:.1f}%" for share in baseline.values())
    label = (
        f"{n:,} workers holding {per} leases each ({n * per:,}), every "
        f"{sizes.beat_interval:g} s"
    )
    totals, costs = {}, {}
    for kind, phase in (("once per lease", single), ("once per worker", batched)):
        total = totals[kind] = sum(phase["cpu"].values())
        parts = " + ".join(
            f"{name} {share:.1f}%" for name, share in phase["cpu"].items()
        )
        latencies = phase["latencies"]
        # CPU per renewal: a percent of one core is 10 ms of CPU per second.
        each = costs[kind] = (
            total * 10 / phase["renewed"] if phase["renewed"] else float("nan")
        )
        bench.add(
            "20",
            "heartbeats at fleet scale",
            f"{kind}: server CPU, {label} ({phase['calls']:.0f} calls/s renewing "
            f"{phase['renewed']:.0f} leases/s; call p50 / p99; {idle} with none)",
            f"{total:.1f}% of one core ({parts}) = {each:.2f} ms per lease; "
            f"{_ms(_pct(latencies, 0.5))} / {_ms(_pct(latencies, 0.99))}",
        )
    # When the server falls behind the fleet's calls once per lease, its CPU
    # there is less than the fleet asks for: the cost per lease renewed says
    # so, and the target holds only if both ratios meet it.
    single_cpu, batched_cpu = totals["once per lease"], totals["once per worker"]
    ratio = single_cpu / batched_cpu if batched_cpu else float("inf")
    per_lease = costs["once per lease"] / costs["once per worker"]
    bench.add(
        "20",
        "heartbeats at fleet scale",
        f"server CPU once per lease / once per worker (per lease renewed); "
        f"leases live at the end, of {n * per:,}",
        f"{ratio:.1f} x ({per_lease:.1f} x); {live:,}",
        f">= 4 x; all {n * per:,}",
        min(ratio, per_lease) >= 4 and live == n * per,
    )
