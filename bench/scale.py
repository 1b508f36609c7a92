"""``python -m bench --scale 10m``: Recall with ten million items.

Seeds ``total`` jobs over ``batches`` batches the way a production database
looks after months: nine tenths finished (in settled batches), one tenth queued
in open batches, and a thousandth of the total in live leases, all in the
largest batch (a tenth of the total: half done). Then it times what operators
and workers touch: an idle claim, a claim that finds work among the open
batches, ``progress.json`` and the page of the largest batch, the batches list,
the admin's job list, one sweep, ``recall_check``, and the database's size.

The rows are written by ``bench.seed`` (set-based SQL, one batch at a time);
with a superuser connection the seeding skips the foreign-key triggers
(``session_replication_role = replica``): the seeded rows agree by
construction (``recall_check`` runs at the end and must find nothing), and
checking some 40 million references one by one would take longer than writing them.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


def parse_scale(text: str) -> int:
    """``10m`` -> 10,000,000; ``250k`` -> 250,000; a plain number as it is."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not found:
        raise ValueError(f"not a size: {text!r} (say 10m, 250k or 5000)")
    factor = {"": 1, "k": 1_000, "m": 1_000_000}[found.group(2).lower()]
    total = int(float(found.group(1)) * factor)
    if total < 1_000:
        raise ValueError(f"{text!r} is too small: at least 1k jobs")
    return total


@dataclass(frozen=True)
class Layout:
    """How ``total`` jobs are spread over ``batches`` batches."""

    total: int
    batches: int
    finished: list[int]  # completed items of each finished batch
    queued: list[int]  # queued items of each other open batch
    largest: tuple[int, int, int]  # the largest batch: done, leased, queued

    @classmethod
    def of(cls, total: int, batches: int) -> Layout:
        leases = max(1, total // 1_000)
        largest_size = total // 10
        largest_done = largest_size // 2
        largest = (largest_done, leases, largest_size - largest_done - leases)
        open_count = max(1, batches // 10)  # the largest is one of them
        finished_count = batches - open_count
        done = total * 9 // 10 - largest_done
        queued = total - largest_size - done
        if open_count == 1:  # the largest batch is the only open one
            largest = (largest[0], largest[1], largest[2] + queued)
            queued = 0
        return cls(
            total=total,
            batches=batches,
            finished=_spread(done, finished_count),
            queued=_spread(queued, open_count - 1),
            largest=largest,
        )


def _spread(n: int, parts: int) -> list[int]:
    if parts <= 0:
        return []
    each, extra = divmod(n, parts)
    return [each + (1 if i < extra else 0) for i in range(parts)]


@contextlib.contextmanager
def _without_reference_checks() -> Iterator[bool]:
    """Skip foreign-key triggers for this connection if it may (a superuser)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        (superuser,) = cursor.fetchone()
        if superuser:
            cursor.execute("SET session_replication_role = replica")
    try:
        yield bool(superuser)
    finally:
        if superuser:
            with connection.cursor() as cursor:
                cursor.execute("SET session_replication_role = DEFAULT")


def _say(text: str) -> None:
    print(text, flush=True)


def seed(layout: Layout, progress: Callable[[str], None] = _say) -> dict[str, Any]:
    """Empty the tables and write the layout; return the ids and the time."""
    from django.db import connection

    from bench import seed as rows
    from bench.loops import utcnow

    rows.reset()
    holder, _ = rows.workers(1, prefix="bench-holder")[0]
    now = utcnow()
    old = now - timedelta(days=1)
    started = time.perf_counter()
    with _without_reference_checks() as unchecked:
        for i, done in enumerate(layout.finished):
            rows.batch(f"scale-done-{i}", now=old, completed=done, analyze=False)
            if i % 100 == 99:
                progress(
                    f"  {i + 1} finished batches seeded "
                    f"({time.perf_counter() - started:.0f} s)"
                )
        open_ids = [
            rows.batch(f"scale-open-{i}", now=now, queued=queued, analyze=False).pk
            for i, queued in enumerate(layout.queued)
        ]
        done, leased, queued = layout.largest
        largest = rows.batch(
            "scale-largest",
            now=now - timedelta(minutes=5),
            completed=done,
            leased=leased,
            queued=queued,
            lease_expires_at=now + timedelta(hours=2),
            worker=holder,
            analyze=False,
        ).pk
    seeded = time.perf_counter() - started
    progress(f"  all {layout.batches} batches seeded ({seeded:.0f} s); analyzing")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")  # what autovacuum would have done by now
    return {
        "largest": largest,
        "open": [*open_ids, largest],
        "seconds": seeded,
        "analyze_seconds": time.perf_counter() - started - seeded,
        "unchecked": unchecked,
    }


def _timed(call: Callable[[], Any], n: int) -> tuple[list[float], list[float]]:
    """Wall times and this process's CPU times of ``n`` calls (the CPU time is
    what the request costs the web node, whatever else shares the cores)."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        call()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return wall, cpu


@contextlib.contextmanager
def _cpu(bench) -> Iterator[dict[str, float]]:
    """CPU seconds PostgreSQL spends meanwhile (the private server's processes,
    its background writers included; the caller adds the loops' own as
    ``app``): per-operation costs that hold whatever else runs on the machine,
    unlike wall times."""
    from bench.cpu import cpu_seconds

    spent: dict[str, float] = {"app": 0.0}
    database = cpu_seconds(bench.postmaster) if bench.postmaster else None
    yield spent
    if database is not None:
        spent["database"] = cpu_seconds(bench.postmaster) - database


def _each(spent: dict[str, float], n: int) -> str:
    """The app's and PostgreSQL's CPU per operation, as "x ms + y ms" (PostgreSQL's
    only when the run can see the server's processes)."""
    n = max(1, n)
    database = spent.get("database")
    return f"{spent['app'] / n * 1000:.2f} ms + " + (
        "(not measured)" if database is None else f"{database / n * 1000:.2f} ms"
    )


def _get(client, path: str) -> Callable[[], None]:
    def fetch() -> None:
        response = client.get(path)
        if response.status_code != 200:
            raise RuntimeError(f"GET {path} answered {response.status_code}")
        if getattr(response, "streaming", False):
            b"".join(response.streaming_content)

    return fetch


def _seeded_before(layout: Layout) -> dict[str, Any]:
    """The ids of a layout seeded by an earlier run (kept with ``--keep``)."""
    from batches.models import Batch

    largest = Batch.objects.filter(name="scale-largest").values_list("pk", flat=True)
    if not largest:
        raise RuntimeError("--reuse: no seeded database here (seed one with --keep)")
    opened = Batch.objects.filter(name__startswith="scale-open-").values_list(
        "pk", flat=True
    )
    if len(opened) != len(layout.queued):
        raise RuntimeError("--reuse: the database holds another --scale layout")
    return {"largest": largest[0], "open": [*opened, largest[0]]}


def run(bench, total: int, batches: int, *, reuse: bool = False) -> None:
    """The ``--scale`` run: seed (unless ``reuse``: measure a database an
    earlier run kept), then the rows of BENCHMARKS.md's scale table."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    from batches.models import Batch
    from bench import loops
    from bench import seed as rows
    from bench.loops import utcnow
    from engine.checks import find_violations
    from engine.sweep import sweep
    from jobs.models import Job, JobStatus

    add, ms, pct = bench.add, _ms, _pct
    layout = Layout.of(total, batches)
    label = f"{total:,} jobs, {batches:,} batches"
    done, leased, queued = layout.largest
    if reuse:
        seeded = _seeded_before(layout)
        # The last run's heartbeats left its leases a minute long: live again.
        rows.expire_leases(seeded["largest"], at=utcnow() + timedelta(hours=2))
    else:
        print(f"== Seeding {label}", flush=True)
        seeded = seed(layout)
        add(
            "S",
            "seed",
            f"{label} ({sum(layout.finished) + done:,} done, "
            f"{sum(layout.queued) + queued:,} queued, {leased:,} leased)",
            f"{seeded['seconds']:.0f} s + {seeded['analyze_seconds']:.0f} s "
            "VACUUM ANALYZE"
            + ("" if seeded["unchecked"] else " (foreign keys checked)"),
        )
    largest, open_ids = seeded["largest"], seeded["open"]

    # Idle claims: every open batch paused, so a million queued jobs wait
    # behind pauses and nothing is claimable (the claim must not look at them).
    claimers = rows.workers(2, prefix="bench-scale")
    Batch.objects.filter(pk__in=open_ids).update(paused_at=utcnow())
    samples = bench.sizes.page_requests
    latencies: list[float] = []
    with _cpu(bench) as spent:
        for _ in range(bench.sizes.runs):
            result = loops.run(
                "idle_claim",
                [{"token": claimers[0][1]}],
                duration=bench.sizes.idle_seconds,
            )[0]
            if set(result["statuses"]) != {204}:
                raise RuntimeError(f"idle claims answered {result['statuses']}")
            latencies.extend(result["latencies"])
            spent["app"] += result["cpu"]
    p50, p99 = pct(latencies, 0.5), pct(latencies, 0.99)
    add(
        "S",
        "idle claim",
        f"server time p50 / p99, one client ({len(latencies):,} claims)",
        f"{ms(p50)} / {ms(p99)}",
        "<= 3 ms / <= 15 ms",
        p50 <= 0.003 and p99 <= 0.015,
    )
    add(
        "S",
        "idle claim",
        "CPU per idle claim (whole request): app + PostgreSQL",
        _each(spent, len(latencies)),
    )

    # Claims that find work: the open batches resumed, one client claiming and
    # completing (the claim's time only; the fair share picks among them).
    Batch.objects.filter(pk__in=open_ids).update(paused_at=None)
    latencies = []
    with _cpu(bench) as spent:
        for _ in range(bench.sizes.runs):
            result = loops.run(
                "model",
                [{"worker": claimers[1][0].pk, "latency": True}],
                duration=bench.sizes.idle_seconds,
            )[0]
            latencies.extend(result["latencies"])
            spent["app"] += result["cpu"]
    add(
        "S",
        "claim with work",
        f"model layer p50 / p99, one client, {len(open_ids)} open batches "
        f"({len(latencies):,} claims, each completed)",
        f"{ms(pct(latencies, 0.5))} / {ms(pct(latencies, 0.99))}",
    )
    add(
        "S",
        "claim with work",
        "CPU per claim + complete: app (one process) + PostgreSQL",
        _each(spent, len(latencies)),
    )

    user_model = get_user_model()
    user = user_model.objects.filter(username="bench").first()
    if user is None:
        user = user_model.objects.create_user("bench", is_staff=True, is_superuser=True)
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    size = sum(layout.largest)
    pages = [
        ("progress.json", f"/batches/{largest}/progress.json", f"{size:,} items", 0.1),
        ("batch page", f"/batches/{largest}/", f"{size:,} items", 0.3),
        ("batches list", "/", f"{batches:,} batches", 0.3),
        ("admin job list", "/admin/jobs/job/", f"{total:,} jobs", 0.3),
        (
            "admin job list, leased",
            "/admin/jobs/job/?status__exact=leased",
            f"{leased:,} of {total:,} jobs",
            0.3,
        ),
    ]
    for name, path, of, limit in pages:
        fetch = _get(client, path)
        fetch()  # the first request warms the caches (templates, plans)
        with _cpu(bench) as spent:
            times, cpu = _timed(fetch, samples)
        median = statistics.median(times)
        database = spent.get("database")
        add(
            "S",
            name,
            f"median (max) of {samples}, {of}; CPU per request: app + PostgreSQL",
            f"{ms(median)} ({ms(max(times))}); {ms(statistics.median(cpu))} + "
            + ("?" if database is None else ms(database / samples)),
            f"<= {limit * 1000:.0f} ms",
            median <= limit,
        )

    t0 = time.perf_counter()
    report = sweep()
    took = time.perf_counter() - t0
    reclaimed = report["reclaimed"]["requeued"] + report["reclaimed"]["failed"]
    add("S", "sweep", f"one sweep ({reclaimed:,} expired leases)", f"{took:.2f} s")
    print(f"  sweep: {report}", flush=True)

    t0 = time.perf_counter()
    violations = find_violations()
    took = time.perf_counter() - t0
    add(
        "S",
        "recall_check",
        f"all invariants over {total:,} jobs ({len(violations)} violations)",
        f"{took:.1f} s",
        "0 violations",
        not violations,
    )
    for violation in violations[:10]:
        print(f"  {violation}", flush=True)

    # Heartbeats: P processes extending the largest batch's live leases (last:
    # a heartbeat shortens a seeded lease to RECALL_LEASE_SECONDS, and the
    # sweep above is timed with nothing expired).
    live = list(
        Job.objects.filter(batch_id=largest, status=JobStatus.LEASED)
        .order_by("pk")
        .values_list("pk", "lease_token", "leased_by_id")
    )
    p = min(bench.p, len(live))
    rates, latencies = [], []
    with _cpu(bench) as spent:
        for _ in range(bench.sizes.runs):
            results = loops.run(
                "heartbeats",
                [
                    {"worker": live[0][2], "leases": [r[:2] for r in live[i::p]]}
                    for i in range(p)
                ],
                duration=bench.sizes.idle_seconds,
            )
            elapsed = max(r["elapsed"] for r in results)
            rates.append(sum(r["done"] for r in results) / elapsed)
            latencies.extend(x for r in results for x in r["latencies"])
            spent["app"] += sum(r["cpu"] for r in results)
    add(
        "S",
        "heartbeat",
        f"model layer, P={p}: heartbeats/s, p50 / p99 ({len(live):,} live leases)",
        f"{statistics.median(rates):,.0f}/s, "
        f"{ms(pct(latencies, 0.5))} / {ms(pct(latencies, 0.99))}",
    )
    add(
        "S",
        "heartbeat",
        "CPU per heartbeat: app (the P processes) + PostgreSQL",
        _each(spent, len(latencies)),
    )

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_database_size(current_database())")
        (size_bytes,) = cursor.fetchone()
        cursor.execute(
            """SELECT c.relname, pg_total_relation_size(c.oid)
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' AND c.relkind = 'r'
            ORDER BY 2 DESC LIMIT 5"""
        )
        tables = cursor.fetchall()
    per_million = size_bytes / (total / 1_000_000)
    millions = total / 1_000_000
    biggest = ", ".join(
        f"{name} {table / millions / 2**20:,.0f} MB" for name, table in tables
    )
    add(
        "S",
        "database size",
        f"per million items ({size_bytes / 2**30:.1f} GB in all)",
        f"{per_million / 2**20:,.0f} MB ({biggest})",
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
