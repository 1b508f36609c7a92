"""Row 19 of ``make bench`` (``--only 19``, BENCHMARKS.md): claims with labels
among 1,000 open batches spread over 20 requirement sets, from workers that
match some of them and workers that match none (issue 26).
"""

from __future__ import annotations

from collections import Counter

from bench.core import Bench, _ms, _pct, _queue, _workers_named

GPUS = ("a100", "h100", "l4", "t4")

# The labels the claiming workers declare, each worker always the same. The
# first four serve two requirement sets each (a GPU and a model, and the GPU
# alone), two of them with labels no batch asks for (which never hurt).
MATCHING: list[dict[str, str]] = [
    {"gpu": "a100", "model": "m0", "host": "box-1"},
    {"gpu": "h100", "model": "m1"},
    {"gpu": "l4", "model": "m3", "lang": "de"},
    {"gpu": "t4", "model": "m2"},
]
# These serve none: they declare nothing, a GPU no batch requires, a model
# without its GPU, and a GPU in the wrong case (values match exactly).
NOT_MATCHING: list[dict[str, str]] = [
    {},
    {"gpu": "v100", "model": "m0"},
    {"model": "m2"},
    {"gpu": "A100", "model": "m1"},
]


def requirement_sets(n: int) -> list[dict[str, str]]:
    """``n`` distinct requirement sets (n >= 5): a GPU and a model, then each
    GPU alone (a worker with that GPU serves it whatever its model)."""
    pairs = [{"gpu": GPUS[i % 4], "model": f"m{i // 4}"} for i in range(n - 4)]
    return pairs + [{"gpu": gpu} for gpu in GPUS]


def routing(bench: Bench) -> None:
    """19: claims with labels among open batches with requirements: latency, and
    no worker given a job it cannot serve."""
    from batches.labels import satisfies
    from bench import loops
    from bench.loops import utcnow
    from jobs.models import Lease, Worker

    sizes = bench.sizes
    sets = requirement_sets(sizes.routing_sets)
    labels = MATCHING + NOT_MATCHING
    for offered in labels:
        serves = any(satisfies(offered, required) for required in sets)
        if serves != (offered in MATCHING):
            raise RuntimeError(f"labels {offered} do not serve as the row says")
    _queue(
        bench,
        sizes.routing_jobs,
        sizes.routing_batches,
        requires=lambda i: sets[i % len(sets)],
    )
    since = utcnow()
    workers = _workers_named("bench-route", len(labels))
    sent = {
        worker.pk: offered for (worker, _), offered in zip(workers, labels, strict=True)
    }
    clients = [
        (token, offered) for (_, token), offered in zip(workers, labels, strict=True)
    ]
    pks = [worker.pk for worker, _ in workers]
    by_token = {token: worker.pk for worker, token in workers}
    latencies: dict[int, list[float]] = {}
    cpu: Counter[int] = Counter()
    racing: Counter[int] = Counter()
    answers: dict[int, Counter[int]] = {pk: Counter() for pk in pks}
    done, elapsed = 0, 0.0
    for _ in range(sizes.runs):
        # P clients at once, each one worker (matching and not in turn): their
        # claims race for the same batches, which is what the check is about.
        results = loops.run(
            "routed_claims",
            [{"workers": [clients[k % len(clients)]]} for k in range(bench.p)],
            duration=sizes.routing_seconds,
        )
        for result in results:
            for status, times in result["by_status"].items():
                racing[int(status)] += len(times)
            for token, answered in result["answers"].items():
                answers[by_token[token]].update(answered)
        done += sum(r["done"] for r in results)
        elapsed += max(r["elapsed"] for r in results)
        # One client, the workers' claims in turn: the server time of a claim
        # (P clients on 2 cores would measure their own queueing), as row 5.
        (one,) = loops.run(
            "routed_claims", [{"workers": clients}], duration=sizes.routing_seconds
        )
        for status, times in one["by_status"].items():
            latencies.setdefault(int(status), []).extend(times)
        cpu.update(one["cpu_by_status"])
        for token, answered in one["answers"].items():
            answers[by_token[token]].update(answered)
    unexpected = (set(latencies) | set(racing)) - {200, 204}
    if unexpected:
        raise RuntimeError(f"claims with labels answered {sorted(unexpected)}")

    # Every lease handed out since the seed (the ledger keeps one per claim,
    # finished or not): was its batch one its worker's labels can serve?
    leases = list(
        Lease.objects.filter(claimed_at__gte=since).values_list(
            "worker_id", "job__batch__requires"
        )
    )
    wrong = [
        (worker, requires)
        for worker, requires in leases
        if worker not in sent or not satisfies(sent[worker], requires)
    ]
    serving = [pk for pk in pks if sent[pk] in MATCHING]
    # From the workers' side: the ones that serve nothing were never given a
    # job; the ones that serve some were (their batches never run dry here).
    misrouted = sum(answers[pk][200] for pk in pks if pk not in serving)
    refused = sum(answers[pk][204] for pk in serving)
    starved = [sent[pk] for pk in serving if not answers[pk][200]]
    # The server keeps the labels of each worker's latest claim.
    kept = dict(Worker.objects.filter(pk__in=sent).values_list("pk", "labels"))
    forgotten = [pk for pk in pks if sum(answers[pk].values()) and kept[pk] != sent[pk]]

    job, idle = latencies.get(200, []), latencies.get(204, [])
    p50, p99 = _pct(job, 0.5), _pct(job, 0.99)
    idle50, idle99 = _pct(idle, 0.5), _pct(idle, 0.99)
    job_cpu = cpu[200] / len(job) if job else float("nan")
    idle_cpu = cpu[204] / len(idle) if idle else float("nan")
    label = (
        f"{sizes.routing_batches:,} open batches over {len(sets)} requirement "
        f"sets, {len(MATCHING)} workers that serve some and {len(NOT_MATCHING)} "
        "that serve none, in turn"
    )
    bench.add(
        "19",
        "routing",
        f"{label}: claim p50 / p99 (one client), given a job ({len(job):,}); "
        f"nothing to serve, 204 ({len(idle):,}) (the app's CPU per claim, mean)",
        f"{_ms(p50)} / {_ms(p99)}; {_ms(idle50)} / {_ms(idle99)} "
        f"({_ms(job_cpu)}; {_ms(idle_cpu)})",
        "<= 3 ms / <= 15 ms",
        bool(job) and max(p50, idle50) <= 0.003 and max(p99, idle99) <= 0.015,
    )
    bench.add(
        "19",
        "routing",
        f"P={bench.p} clients at once ({racing[200]:,} claims given a job, "
        f"{racing[204]:,} answered 204; {done / elapsed:.0f} claim+complete/s), "
        f"then the one client: leases whose batch requires labels its worker "
        f"did not send, of {len(leases):,} (claims of the workers that serve "
        f"none given a job: {misrouted}; of those that serve some answered "
        f"204: {refused:,})",
        f"{len(wrong)}",
        "0",
        not wrong and not misrouted and not forgotten,
    )
    if wrong or misrouted or starved or forgotten:
        print(
            f"  routing: wrong {wrong[:5]}; serving workers given nothing "
            f"{starved}; labels not kept for workers {forgotten}",
            flush=True,
        )
