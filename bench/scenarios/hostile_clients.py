"""Row 18 of ``make bench`` (``--only 18``, BENCHMARKS.md): one token's thousands of
waiting claims and slow anonymous connections, while workers heartbeat; beside the
same run without them.
"""

from __future__ import annotations

import threading
import time

from bench.core import Bench, _launch_gunicorn, _ms, _pct, _terminate, _workers_named


def _hostile_run(bench: Bench, lease_seconds: int, attacked: bool) -> dict:
    """Row 18's run on a fresh server: workers claim and heartbeat; after they
    hold their leases, ``sizes.hostile_seconds`` of heartbeats, /healthz
    probes and memory samples, with the attackers if ``attacked``."""
    import multiprocessing

    from bench import loops, seed
    from bench.hostile import HealthProbe, HostileClients, MemorySampler
    from bench.loops import utcnow
    from jobs.models import Job, JobStatus, Lease, LeaseEnd

    sizes = bench.sizes
    seed.reset()
    side = seed.batch("bench-hostile", now=utcnow(), queued=sizes.heartbeaters)
    tokens = [t for _, t in _workers_named("bench-hostile-hb", sizes.heartbeaters)]
    ((_, attacker),) = _workers_named("bench-attacker", 1)
    server, port = _launch_gunicorn(RECALL_LEASE_SECONDS=str(lease_seconds))
    done = multiprocessing.get_context("spawn").Event()
    outcome: dict = {}
    hostile = None

    def heartbeat() -> None:
        outcome["beats"] = loops.run(
            "heartbeaters",
            [
                {
                    "host": "127.0.0.1",
                    "port": port,
                    "tokens": tokens,
                    "interval": sizes.heartbeat_interval,
                    "timeout": 30.0,
                    "done": done,
                }
            ],
            duration=sizes.hostile_seconds + 600,
        )

    try:
        beating = threading.Thread(target=heartbeat)
        beating.start()
        deadline = time.monotonic() + 120
        leased = Job.objects.filter(batch=side, status=JobStatus.LEASED)
        while leased.count() < len(tokens):
            if time.monotonic() > deadline or not beating.is_alive():
                raise RuntimeError("the heartbeating workers did not claim their jobs")
            time.sleep(0.1)
        memory = MemorySampler(server.pid)
        memory.start()
        probe = HealthProbe("127.0.0.1", port)
        probe.start()
        if attacked:
            hostile = HostileClients(
                "127.0.0.1",
                port,
                attacker,
                claims=sizes.hostile_claims,
                claim_bytes=sizes.hostile_claim_bytes,
                slow=sizes.hostile_slow,
            )
            hostile.start()
        time.sleep(sizes.hostile_seconds)
        counted = hostile.stop() if hostile is not None else {}
        hostile = None
        probe.stop()
        memory.stop()
        done.set()
        beating.join()
        still_live = leased.filter(lease_expires_at__gt=utcnow()).count()
    finally:
        done.set()
        if hostile is not None:
            hostile.stop_event.set()
            hostile.join()
        _terminate(server)
    beats = outcome["beats"][0]
    lapsed = sum(1 for gap in beats["gaps"] if gap >= lease_seconds)
    expired = lapsed + (len(tokens) - still_live)
    expired += Lease.objects.filter(
        job__batch=side, end_reason=LeaseEnd.EXPIRED
    ).count()
    return {
        "beats": beats["latencies"],
        "statuses": beats["statuses"],
        "expired": expired,
        "health": probe.latencies,
        "health_failed": probe.failures,
        "grown": memory.peak - memory.first,
        "memory": memory.first,
        "counted": counted,
    }


def hostile_clients(bench: Bench) -> None:
    """18: one token's thousands of waiting claims and slow anonymous
    connections, while workers heartbeat; beside the same run without them."""
    lease_seconds = 15
    sizes = bench.sizes
    runs = {
        attacked: _hostile_run(bench, lease_seconds, attacked)
        for attacked in (False, True)
    }
    quiet, attacked_run = runs[False], runs[True]

    def beat_figures(run: dict) -> str:
        beats = run["beats"]
        return f"{_ms(_pct(beats, 0.5))} / {_ms(_pct(beats, 0.99))} / {_ms(max(beats))}"

    def statuses(run: dict) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(run["statuses"].items()))

    def health(run: dict) -> str:
        answered = len(run["health"]) - run["health_failed"]
        return f"{answered}/{len(run['health'])} (max {_ms(max(run['health']))})"

    counted = attacked_run["counted"]
    answers = (
        ", ".join(
            f"{k}: {v}" for k, v in sorted(counted.get("claims answered", {}).items())
        )
        or "none answered"
    )
    slow_answers = ", ".join(
        f"{k}: {v}" for k, v in sorted(counted.get("slow answered", {}).items())
    )
    attack = (
        f"1 token keeping {sizes.hostile_claims:,} waiting claims of "
        f"{sizes.hostile_claim_bytes / 1024 / 1024:g} MB open, "
        f"{sizes.hostile_slow} slow anonymous connections"
    )
    label = (
        f"{sizes.heartbeaters} workers heartbeating every "
        f"{sizes.heartbeat_interval:g} s, {lease_seconds} s leases, "
        f"{sizes.hostile_seconds:g} s; without vs with {attack}"
    )
    attacked_p99 = _pct(attacked_run["beats"], 0.99)
    bench.add(
        "18",
        "hostile clients",
        f"{label}: heartbeat p50 / p99 / max ({len(quiet['beats'])} vs "
        f"{len(attacked_run['beats'])} heartbeats; {statuses(quiet)} vs "
        f"{statuses(attacked_run)})",
        f"{beat_figures(quiet)} vs {beat_figures(attacked_run)}",
        "p99 < 1 s",
        attacked_p99 < 1.0 and set(attacked_run["statuses"]) == {"200"},
    )
    bench.add(
        "18",
        "hostile clients",
        "leases expired",
        f"{quiet['expired']} vs {attacked_run['expired']}",
        "0",
        quiet["expired"] == attacked_run["expired"] == 0,
    )
    bench.add(
        "18",
        "hostile clients",
        "/healthz answered every 0.5 s (5 s timeout)",
        f"{health(quiet)} vs {health(attacked_run)}",
        "all",
        attacked_run["health_failed"] == 0 and quiet["health_failed"] == 0,
    )
    bench.add(
        "18",
        "hostile clients",
        f"server memory growth, peak (from {quiet['memory']:.0f} MB vs "
        f"{attacked_run['memory']:.0f} MB, 3 processes and the master)",
        f"{quiet['grown']:.0f} MB vs {attacked_run['grown']:.0f} MB",
        "< 200 MB",
        attacked_run["grown"] < 200,
    )
    bench.add(
        "18",
        "hostile clients",
        "what the attackers sent and got",
        f"{counted.get('claims sent', 0):,} claims ({answers}; "
        f"{counted.get('claim errors', 0)} failed to connect or send), "
        f"{counted.get('slow connections', 0):,} slow connections "
        f"({counted.get('slow dropped', 0):,} dropped: {slow_answers or 'closed'})",
    )
