"""``make bench``: Recall's speed, side by side with the raw-SQL limit and peers.

Starts a private PostgreSQL server with stock settings (autovacuum on, as in
production; ``--database-url`` measures another server instead), migrates a
fresh database, runs the scenarios of BENCHMARKS.md and prints one table. Each
throughput figure is the median of ``--runs`` runs; latencies are pooled over
them. Absolute figures depend on the machine: the ratios, measured in the same
run on the same server, are what the targets are about.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from bench.cpu import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sizes:
    processes: int = 8
    runs: int = 3
    throughput_seconds: float = 10.0
    throughput_jobs: int = 60_000
    peer_jobs: int = 5_000
    finished: int = 1_000_000
    live_leases: int = 10_000
    idle_seconds: float = 10.0
    page_requests: int = 30
    hot_batches: int = 100
    intake_items: int = 100_000
    sustain_seconds: float = 600.0
    sustain_bucket: float = 60.0
    share_batches: tuple[int, ...] = (1, 100, 1_000)
    share_jobs: int = 100_000
    share_seconds: float = 10.0
    exports: int = 10
    heartbeaters: int = 32
    heartbeat_interval: float = 1.0
    scrapes: int = 30
    mix_finished: int = 40
    mix_open: int = 10
    fleet_workers: int = 1_000
    fleet_poll_min: float = 1.0
    fleet_poll_max: float = 30.0
    fleet_baseline_seconds: float = 20.0
    fleet_cpu_seconds: float = 60.0
    fleet_trials: int = 8
    purge_items: int = 200_000
    purge_batches: int = 10
    purge_baseline_seconds: float = 20.0
    long_poll_workers: int = 500
    long_poll_wait: float = 25.0
    long_poll_cpu_seconds: float = 60.0
    long_poll_beaters: int = 20
    long_poll_spread: float = 10.0
    hostile_claims: int = 5_000
    hostile_claim_bytes: int = 1024 * 1024
    hostile_slow: int = 500
    hostile_seconds: float = 60.0

    @classmethod
    def quick(cls, processes: int) -> Sizes:
        """Tiny sizes: the smoke run in `make test` (the harness cannot rot)."""
        return cls(
            processes=processes,
            runs=1,
            throughput_seconds=1.0,
            throughput_jobs=400,
            peer_jobs=40,
            finished=2_000,
            live_leases=40,
            idle_seconds=0.5,
            page_requests=3,
            hot_batches=5,
            intake_items=300,
            sustain_seconds=3.0,
            sustain_bucket=1.0,
            share_batches=(1, 3, 6),
            share_jobs=600,
            share_seconds=0.5,
            exports=2,
            heartbeaters=4,
            heartbeat_interval=0.2,
            scrapes=3,
            mix_finished=2,
            mix_open=2,
            fleet_workers=40,
            fleet_poll_min=0.2,
            fleet_poll_max=1.0,
            fleet_baseline_seconds=1.0,
            fleet_cpu_seconds=2.0,
            fleet_trials=2,
            purge_items=2_000,
            purge_batches=2,
            purge_baseline_seconds=1.0,
            long_poll_workers=40,
            long_poll_wait=2.0,
            long_poll_cpu_seconds=2.0,
            long_poll_beaters=4,
            long_poll_spread=0.5,
            hostile_claims=100,
            hostile_claim_bytes=64 * 1024,
            hostile_slow=20,
            hostile_seconds=3.0,
        )


@dataclass
class Row:
    number: str
    scenario: str
    figure: str
    value: str
    target: str = ""
    verdict: str = ""


@dataclass
class Bench:
    sizes: Sizes
    database_url: str
    scenarios: set[str]
    rows: list[Row] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    server: object = None  # the gunicorn process, while it runs
    server_port: int = 0
    postmaster: int | None = None  # the private PostgreSQL server's, if any

    def add(self, number, scenario, figure, value, target="", verdict=None):
        ok = "" if verdict is None else ("ok" if verdict else "MISSED")
        self.rows.append(Row(number, scenario, figure, value, target, ok))
        print(f"  {scenario}: {figure} = {value}  {target} {ok}", flush=True)

    @property
    def p(self) -> int:
        return self.sizes.processes


# --- Set-up ------------------------------------------------------------------------


def _start_database(args) -> tuple[str, object | None]:
    if args.database_url:
        return args.database_url, None
    sys.path.insert(0, str(ROOT))
    from tests.pgserver import PrivatePostgres

    server = PrivatePostgres()
    # Stock PostgreSQL (fsync on, autovacuum on) with room for the clients.
    server.start(settings={"fsync": "on", "max_connections": "300"})
    return server.create_database("recall_bench"), server


def _create_database(url: str, name: str) -> str:
    import psycopg

    base, _, _ = url.rpartition("/")
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        connection.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"


def _setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    os.environ["RECALL_HTTPS"] = "off"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ["CONN_MAX_AGE"] = "600"
    os.environ["RECALL_METRICS_TOKEN"] = secrets.token_urlsafe(24)
    # A bench worker's no-op jobs make it claim and complete hundreds of times
    # a second, far past any real worker's request rate: the limit is counted
    # on every request, here and in the servers started below, but never bites.
    os.environ.setdefault("RECALL_WORKER_RATE_PER_SECOND", "1000000")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "recall_site.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    call_command("collectstatic", verbosity=0, interactive=False)


def _launch_gunicorn(**extra: str) -> tuple[subprocess.Popen, int]:
    """The production configuration (gunicorn.conf.py, README) on a free port;
    ``extra`` environment on top (WEB_CONCURRENCY, RECALL_WEB_THREADS ... set in
    the environment of `make bench` reach it too)."""
    from tests.pgserver import free_port

    port = free_port()
    env = {
        **os.environ,
        "RECALL_BIND": f"127.0.0.1:{port}",
        "RECALL_STARTUP_SWEEP": "quick",
        **extra,
    }
    log = open(Path(tempfile.gettempdir()) / "recall-bench-gunicorn.log", "ab")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    import http.client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            connection = http.client.HTTPConnection("127.0.0.1", port)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                return server, port
        time.sleep(0.2)
    _terminate(server)
    raise RuntimeError("gunicorn did not start (see recall-bench-gunicorn.log)")


def _terminate(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _start_gunicorn(bench: Bench) -> None:
    bench.server, bench.server_port = _launch_gunicorn()


def _stop_gunicorn(bench: Bench) -> None:
    if bench.server is not None:
        _terminate(bench.server)
        bench.server = None


# --- Helpers ------------------------------------------------------------------------


def _rate(results: list[dict]) -> float:
    done = sum(r["done"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    return done / elapsed if elapsed else 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _workers(n: int):
    from bench import seed

    return seed.workers(n)


def _queue(
    bench: Bench, jobs: int, batches: int = 1, history: int | None = None
) -> list[int]:
    """``jobs`` queued jobs over ``batches`` batches, with ``history`` finished
    ones (as many as queued unless said) in front of them.

    A table of nothing but queued jobs is not what production looks like: a
    batch is partly done for most of its life.
    """
    from bench import seed
    from bench.loops import utcnow

    seed.reset()
    now = utcnow() - timedelta(seconds=1)
    per = max(1, jobs // batches)
    done = per if history is None else history // batches
    return [
        seed.batch(
            f"bench-{i}", now=now, completed=done, queued=per, analyze=i == batches - 1
        ).pk
        for i in range(batches)
    ]


def _throughput(bench: Bench, kind: str, batches: int = 1) -> float:
    from bench import loops

    workers = _workers(bench.p)
    batch_ids = _queue(bench, bench.sizes.throughput_jobs, batches)
    if kind == "raw":
        args = [
            {"dsn": bench.database_url, "batch": batch_ids[0], "worker": w.pk}
            for w, _ in workers
        ]
    elif kind == "model":
        args = [{"worker": w.pk} for w, _ in workers]
    else:
        args = [
            {"host": "127.0.0.1", "port": bench.server_port, "token": token}
            for _, token in workers
        ]
    results = loops.run(kind, args, duration=bench.sizes.throughput_seconds)
    if kind == "http_api" and any(r["errors"] for r in results):
        raise RuntimeError(f"HTTP errors: {[r['errors'] for r in results]}")
    return _rate(results)


# --- Scenarios ----------------------------------------------------------------------


def throughput(bench: Bench) -> None:
    """1-3 and 8: claim + complete per second, raw SQL vs model layer vs HTTP."""
    runs: dict[str, list[float]] = {"raw": [], "model": [], "http": [], "spread": []}
    want_http = bool({"3", "8"} & bench.scenarios)
    for _ in range(bench.sizes.runs):
        # Interleaved, so a slow spell of the machine hits every kind alike.
        runs["raw"].append(_throughput(bench, "raw"))
        runs["model"].append(_throughput(bench, "model"))
        if want_http:
            runs["http"].append(_throughput(bench, "http_api"))
            if "8" in bench.scenarios:
                spread = _throughput(bench, "http_api", bench.sizes.hot_batches)
                runs["spread"].append(spread)
    raw = statistics.median(runs["raw"])
    model = statistics.median(runs["model"])
    bench.figures.update(raw=raw, model=model)
    p = bench.p
    bench.add("1", "raw-SQL limit", f"claim+complete/s, P={p}", f"{raw:.0f}/s")
    bench.add(
        "2",
        "model layer",
        f"claim+complete/s, P={p}",
        f"{model:.0f}/s = {model / raw:.2f} x raw",
        ">= 0.70 x raw",
        model / raw >= 0.7,
    )
    if want_http:
        one = statistics.median(runs["http"])
        bench.figures["http"] = one
        bench.add(
            "3",
            "HTTP API (gunicorn)",
            f"claim+complete/s, P={p}",
            f"{one:.0f}/s = {one / raw:.2f} x raw",
            ">= 0.25 x raw",
            one / raw >= 0.25,
        )
    if "8" in bench.scenarios:
        spread = statistics.median(runs["spread"])
        bench.add(
            "8",
            "hot rows",
            f"HTTP 1 batch vs {bench.sizes.hot_batches} batches",
            f"{one:.0f}/s vs {spread:.0f}/s = {one / spread:.2f}",
            ">= 0.90",
            one / spread >= 0.9,
        )


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


def _seed_million(bench: Bench) -> int:
    """Empty the tables, then a batch of a million finished jobs and 10,000
    live leases (held for an hour): the production-sized table the idle,
    sweep, progress and metrics scenarios read."""
    from bench import seed
    from bench.loops import utcnow

    seed.reset()
    now = utcnow()
    # Not one of the claiming workers: it holds far more than their lease cap.
    holder, _ = _workers_named("bench-holder", 1)[0]
    big = seed.batch(
        "bench-million",
        now=now - timedelta(minutes=5),
        completed=bench.sizes.finished,
        leased=bench.sizes.live_leases,
        lease_expires_at=now + timedelta(hours=1),
        worker=holder,
    )
    bench.figures["big_batch"] = big.pk
    return big.pk


def _million(bench: Bench) -> int:
    """The million-job batch, seeded again if a later scenario emptied the tables."""
    from batches.models import Batch

    big = bench.figures.get("big_batch")
    if big is not None and Batch.objects.filter(pk=big).exists():
        return big
    return _seed_million(bench)


def idle(bench: Bench) -> None:
    """5: claims on an empty queue with a million finished jobs and live leases."""
    from bench import loops

    _seed_million(bench)
    workers = _workers(bench.p)
    latencies: list[float] = []
    rates = []
    for _ in range(bench.sizes.runs):
        # The rate with P clients at once (the CPU saturated); the server time
        # with one (P clients on 2 cores would measure their queueing).
        for clients in (workers, workers[:1]):
            results = loops.run(
                "idle_claim",
                [{"token": t} for _, t in clients],
                duration=bench.sizes.idle_seconds,
            )
            statuses = {s for r in results for s in r["statuses"]}
            if statuses != {204}:
                raise RuntimeError(f"idle claims answered {statuses}, not only 204")
            if len(clients) > 1:
                rates.append(_rate(results))
            else:
                latencies.extend(results[0]["latencies"])
    p50, p99 = _pct(latencies, 0.5), _pct(latencies, 0.99)
    label = f"{bench.sizes.finished:,} done + {bench.sizes.live_leases:,} live leases"
    bench.add(
        "5",
        "idle claims",
        f"claims/s, P={bench.p} ({label})",
        f"{statistics.median(rates):.0f}/s",
    )
    bench.add(
        "5",
        "idle claims",
        "server time p50 / p99 (one client)",
        f"{_ms(p50)} / {_ms(p99)}",
        "<= 3 ms / <= 15 ms",
        p50 <= 0.003 and p99 <= 0.015,
    )


def sweep(bench: Bench) -> None:
    """6: reclaim the live leases once they have expired, with claims going on."""
    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.models import Job
    from jobs.sweep import sweep as run_sweep

    big = bench.figures.get("big_batch")
    if big is None:
        idle(bench)
        big = bench.figures["big_batch"]
    now = utcnow()
    expired = seed.expire_leases(big, at=now - timedelta(seconds=1))
    side = seed.batch(
        "bench-side",
        now=now - timedelta(seconds=1),
        queued=max(5_000, bench.sizes.throughput_jobs // 2),
        priority=10,
    )
    workers = _workers(bench.p)
    claims: list[dict] = []
    going = threading.Event()
    thread = threading.Thread(
        target=lambda: claims.extend(
            loops.run(
                "model",
                [{"worker": w.pk, "latency": True} for w, _ in workers],
                duration=max(3.0, bench.sizes.throughput_seconds / 2),
                started=going,
            )
        )
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)  # the claimers are going
    # The sweep runs in a thread of its own; reclaiming is its first step (and
    # claims reclaim some too): the time is until no expired lease is left.
    swept: dict[str, float] = {}

    def sweep_once() -> None:
        from django.db import connection

        t0 = time.perf_counter()
        run_sweep()
        swept["all"] = time.perf_counter() - t0
        connection.close()

    started = time.perf_counter()
    sweeper = threading.Thread(target=sweep_once)
    sweeper.start()
    while Job.objects.expired(utcnow()).exists():
        time.sleep(0.005)
    took = time.perf_counter() - started
    sweeper.join()
    thread.join()
    Batch.objects.filter(pk=side.pk).update(paused_at=utcnow())
    waits = [x for r in claims for x in r["latencies"]]
    bench.add(
        "6",
        "sweep",
        f"reclaim {expired:,} expired leases (P={bench.p} claiming)",
        f"{took:.2f} s",
        "<= 2 s",
        took <= 2.0,
    )
    bench.add(
        "6",
        "sweep",
        "the whole sweep (reclaim, reconcile scan, settle)",
        f"{swept['all']:.2f} s",
    )
    bench.add(
        "6",
        "sweep",
        "longest claim meanwhile (p99)",
        f"{_ms(max(waits))} ({_ms(_pct(waits, 0.99))})",
        "<= 200 ms",
        max(waits) <= 0.2,
    )


def progress(bench: Bench) -> None:
    """7: progress.json and the batch page of the million-item batch, live."""
    from django.contrib.auth import get_user_model
    from django.db.models import Count
    from django.test import Client

    from batches.models import Batch, BatchItem
    from bench import loops

    big = bench.figures.get("big_batch")
    if big is None or "6" not in bench.scenarios:
        sweep(bench)  # leaves the batch with its expired leases queued again
        big = bench.figures["big_batch"]
    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_user(
        "bench", is_staff=True, is_superuser=True
    )
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    workers = _workers(bench.p)
    done_before = Batch.objects.get(pk=big).counts()["done"]
    going = threading.Event()
    thread = threading.Thread(
        target=loops.run,
        args=("model", [{"worker": w.pk} for w, _ in workers]),
        kwargs={
            "duration": max(3.0, bench.sizes.throughput_seconds),
            "started": going,
        },
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)
    timings: dict[str, list[float]] = {"json": [], "page": []}
    for _ in range(bench.sizes.page_requests):
        for key, path in (
            ("json", f"/batches/{big}/progress.json"),
            ("page", f"/batches/{big}/"),
        ):
            t0 = time.perf_counter()
            response = client.get(path)
            timings[key].append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"GET {path} answered {response.status_code}")
    during = Batch.objects.get(pk=big).counts()["done"] - done_before
    thread.join()
    shown = client.get(f"/batches/{big}/progress.json").json()
    fresh = {
        row["status"]: row["n"]
        for row in BatchItem.objects.filter(batch_id=big)
        .values("status")
        .annotate(n=Count("id"))
        .order_by()
    }
    exact = all(shown["counts"][s] == fresh.get(s, 0) for s in shown["counts"])
    label = f"{shown['total']:,} items, {during:,} finished meanwhile"
    for key, name, limit in (
        ("json", "progress.json", 0.1),
        ("page", "batch page", 0.3),
    ):
        median = statistics.median(timings[key])
        bench.add(
            "7",
            "progress",
            f"{name} median (max), {label}",
            f"{_ms(median)} ({_ms(max(timings[key]))})",
            f"<= {limit * 1000:.0f} ms",
            median <= limit,
        )
    bench.add(
        "7",
        "progress",
        "counts equal a fresh recount once quiet",
        "yes" if exact else "NO",
        "exact",
        exact,
    )


def _measure_child(
    command: list[str], env: dict | None = None
) -> tuple[float, float, str]:
    """Run a command; return its wall time, peak RSS (MB) and output."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        _, status, usage = os.wait4(process.pid, 0)
        took = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{text}")
    return took, usage.ru_maxrss / 1024, text


def intake_export(bench: Bench) -> None:
    """9: create_batch of a large manifest; CSV export of the million-item batch."""
    n = bench.sizes.intake_items
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as manifest:
        manifest.write("source,duration_seconds,language\n")
        for i in range(n):
            manifest.write(f"s3://bench/audio/{i:07d}.flac,{30 + i % 600},en\n")
    try:
        took, rss, _ = _measure_child(
            [sys.executable, "manage.py", "create_batch", "bench-intake", manifest.name]
        )
    finally:
        os.unlink(manifest.name)
    bench.add(
        "9",
        "intake",
        f"create_batch of {n:,} items (peak RSS {rss:.0f} MB)",
        f"{took:.1f} s",
        "<= 10 s",
        took <= 10,
    )
    big = bench.figures.get("big_batch")
    if big is None:
        idle(bench)
        big = bench.figures["big_batch"]
    took, rss, text = _measure_child(
        [sys.executable, "-m", "bench.export_child", str(big), "csv"]
    )
    rows = int(text.split()[-1])
    bench.add(
        "9",
        "export",
        f"CSV of {rows:,} items ({took:.1f} s)",
        f"peak RSS {rss:.0f} MB",
        "<= 200 MB",
        rss <= 200,
    )


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


def exports_vs_heartbeats(bench: Bench) -> None:
    """12: operators exporting a million items at once while workers heartbeat."""
    import multiprocessing

    from django.contrib.auth import get_user_model
    from django.test import Client

    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.models import Job, JobStatus, Lease, LeaseEnd

    sizes = bench.sizes
    lease_seconds = 15  # the demo's; heartbeats come every `interval` meanwhile
    seed.reset()
    now = utcnow()
    big = seed.batch("bench-export", now=now, completed=sizes.finished)
    side = seed.batch("bench-heartbeat", now=now, queued=sizes.heartbeaters)
    tokens = [t for _, t in _workers_named("bench-hb", sizes.heartbeaters)]
    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_user(
        "bench", is_staff=True, is_superuser=True
    )
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    session = client.cookies["sessionid"].value
    server, port = _launch_gunicorn(RECALL_LEASE_SECONDS=str(lease_seconds))
    done = multiprocessing.get_context("spawn").Event()
    cap = 1800.0  # the exports end it well before
    outcome: dict[str, list[dict]] = {}
    try:
        beating = threading.Thread(
            target=lambda: outcome.update(
                beats=loops.run(
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
                    duration=cap,
                )
            )
        )
        beating.start()
        # The workers hold their leases before the operators start exporting.
        deadline = time.monotonic() + 120
        while Job.objects.filter(batch=side, status=JobStatus.LEASED).count() < len(
            tokens
        ):
            if time.monotonic() > deadline or not beating.is_alive():
                raise RuntimeError("the heartbeating workers did not claim their jobs")
            time.sleep(0.1)
        started = time.perf_counter()
        outcome["exports"] = loops.run(
            "export_clients",
            [
                {
                    "host": "127.0.0.1",
                    "port": port,
                    "batch": big.pk,
                    "session": session,
                    "exports": sizes.exports,
                    "done": done,
                }
            ],
            duration=cap,
        )
        took = time.perf_counter() - started
        beating.join()
        still_live = Job.objects.filter(
            batch=side, status=JobStatus.LEASED, lease_expires_at__gt=utcnow()
        ).count()
    finally:
        done.set()
        _terminate(server)
    exports = outcome["exports"][0]["exports"]
    beats = outcome["beats"][0]
    latencies = beats["latencies"]
    lapsed = sum(1 for gap in beats["gaps"] if gap >= lease_seconds)
    expired = lapsed + (len(tokens) - still_live)
    expired += Lease.objects.filter(
        job__batch=side, end_reason=LeaseEnd.EXPIRED
    ).count()
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(beats["statuses"].items()))
    ok = [e for e in exports if e["status"] == 200 and e["bytes"]]
    refused = ", ".join(str(e["status"]) for e in exports if e not in ok)
    server_model = os.environ.get("RECALL_WEB_THREADS", "8")
    label = (
        f"{sizes.exports} CSV exports of {sizes.finished:,} items, "
        f"{len(tokens)} workers heartbeating every {sizes.heartbeat_interval:g} s"
    )
    bench.add(
        "12",
        "exports vs workers",
        f"{label}: exports done / time",
        f"{len(ok)}/{len(exports)} in {took:.0f} s "
        f"({statistics.median(e['bytes'] for e in exports) / 1e6:.0f} MB each)"
        + (f", others: {refused}" if refused else ""),
        f"all {sizes.exports}",
        len(ok) == len(exports),
    )
    bench.add(
        "12",
        "exports vs workers",
        f"heartbeat p50 / p99 / max ({len(latencies)} heartbeats; {statuses})",
        f"{_ms(_pct(latencies, 0.5))} / {_ms(_pct(latencies, 0.99))} / "
        f"{_ms(max(latencies))}",
        "p99 < 1 s",
        _pct(latencies, 0.99) < 1.0,
    )
    bench.add(
        "12",
        "exports vs workers",
        f"leases expired ({lease_seconds} s leases; threads per process "
        f"{server_model})",
        str(expired),
        "0",
        expired == 0,
    )


def _workers_named(prefix: str, n: int):
    from bench import seed

    return seed.workers(n, prefix=prefix)


def _server_cpu(bench: Bench, seconds: float) -> dict[str, float]:
    """Percent of one core that gunicorn (master and workers) and the private
    PostgreSQL server (every backend) used over the next ``seconds``."""
    roots = {"gunicorn": bench.server.pid}
    if bench.postmaster:
        roots["PostgreSQL"] = bench.postmaster
    before = {name: cpu_seconds(pid) for name, pid in roots.items()}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {
        name: 100 * (cpu_seconds(pid) - before[name]) / elapsed
        for name, pid in roots.items()
    }


def _fleet_workers(bench: Bench) -> list:
    from bench import seed

    if "fleet" not in bench.figures:
        bench.figures["fleet"] = seed.workers(bench.sizes.fleet_workers, prefix="fleet")
    return bench.figures["fleet"]


def metrics_scrape(bench: Bench) -> None:
    """13: GET /metrics with a million jobs, as Prometheus scrapes it."""
    import http.client

    from django.db.models import Count
    from prometheus_client.parser import text_string_to_metric_families

    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.models import Job, Worker

    _million(bench)
    now = utcnow()
    sizes = bench.sizes
    if not Batch.objects.filter(name__startswith="bench-mix-").exists():
        for i in range(sizes.mix_finished):
            seed.batch(f"bench-mix-done-{i}", now=now, completed=200)
        for i in range(sizes.mix_open):
            seed.batch(f"bench-mix-open-{i}", now=now, completed=100, queued=400)
    fleet = _fleet_workers(bench)
    Worker.objects.filter(pk__in=[w.pk for w, _ in fleet[::2]]).update(last_seen=now)
    token = os.environ["RECALL_METRICS_TOKEN"]

    def scrape() -> tuple[float, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", bench.server_port)
        started = time.perf_counter()
        connection.request(
            "GET", "/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        response = connection.getresponse()
        body = response.read()
        took = time.perf_counter() - started
        connection.close()
        if response.status != 200:
            raise RuntimeError(f"GET /metrics answered {response.status}: {body[:200]}")
        return took, body

    for _ in range(10):  # every gunicorn process answers its first request
        scrape()
    # The stall check reads a batch's live leases until it finds a recent
    # heartbeat: with silent leases (a stalled batch) it reads all of them.
    big = Job.objects.filter(batch_id=bench.figures["big_batch"], status="leased")
    big.update(heartbeat_at=now - timedelta(minutes=10))
    silent = [scrape()[0] for _ in range(sizes.scrapes)]
    big.update(heartbeat_at=utcnow())  # workers heartbeating, as they do
    quiet = [scrape()[0] for _ in range(sizes.scrapes)]
    body = scrape()[1]
    shown = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(body.decode())
        if family.name == "recall_jobs"
        for sample in family.samples
    }
    # The CPU a scrape costs, app and database: unlike its wall time, it does
    # not grow when other processes share the cores.
    from django.db import connection
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")  # loads the URLs
    # /proc counts in ticks (10 ms): the database's share is taken over them all.
    app, database = time.process_time(), cpu_seconds(backend)
    for _ in range(sizes.scrapes):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
        if response.status_code != 200:
            raise RuntimeError(f"GET /metrics answered {response.status_code}")
    app = (time.process_time() - app) / sizes.scrapes
    database = (cpu_seconds(backend) - database) / sizes.scrapes
    fresh = dict(Job.objects.values_list("status").annotate(n=Count("pk")).order_by())
    exact = all(shown[s] == fresh.get(s, 0) for s in shown)
    jobs = sum(fresh.values())

    load = seed.batch(
        "bench-scrape-load", now=now, queued=sizes.throughput_jobs, priority=10
    )
    going = threading.Event()
    thread = threading.Thread(
        target=loops.run,
        args=("model", [{"worker": w.pk} for w, _ in _workers(bench.p)]),
        kwargs={"duration": max(3.0, sizes.throughput_seconds), "started": going},
    )
    thread.start()
    going.wait(timeout=180)
    time.sleep(0.3)
    loaded = [scrape()[0] for _ in range(sizes.scrapes)]
    thread.join()
    Batch.objects.filter(pk=load.pk).update(paused_at=utcnow())

    label = (
        f"{jobs:,} jobs ({sizes.live_leases:,} leased), {Batch.objects.count()} "
        f"batches, {Worker.objects.count():,} workers"
    )
    median = statistics.median(quiet)
    bench.add(
        "13",
        "metrics",
        f"GET /metrics over HTTP, median (max), {label}",
        f"{_ms(median)} ({_ms(max(quiet))})",
        "< 50 ms",
        median < 0.05,
    )
    bench.add(
        "13",
        "metrics",
        f"CPU per scrape, mean of {sizes.scrapes}: app + database",
        f"{_ms(app + database)} ({_ms(app)} + {_ms(database)})",
    )
    bench.add(
        "13",
        "metrics",
        f"the same with the {bench.sizes.live_leases:,} leases silent (stalled)",
        f"{_ms(statistics.median(silent))} ({_ms(max(silent))})",
    )
    bench.add(
        "13",
        "metrics",
        f"the same while P={bench.p} workers claim and complete",
        f"{_ms(statistics.median(loaded))} ({_ms(max(loaded))})",
    )
    bench.add(
        "13",
        "metrics",
        "recall_jobs equals a fresh count of the jobs",
        "yes" if exact else "NO",
        "exact",
        exact,
    )


def idle_fleet(bench: Bench) -> None:
    """14: a thousand idle workers polling an empty queue, as the reference
    worker does (poll-min 1 s, poll-max 30 s, jittered)."""
    import random

    from batches.manifests import create_batch
    from batches.models import Batch
    from bench.fleet import Fleet
    from bench.loops import utcnow
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


def purge_while_claiming(bench: Bench) -> None:
    """17: purge finished batches (retention) while P workers claim and complete."""
    from batches.models import Batch
    from bench import loops, seed
    from bench.loops import utcnow
    from jobs.checks import find_violations
    from jobs.retention import purge

    now = utcnow()
    items, batches = bench.sizes.purge_items, bench.sizes.purge_batches
    old = [
        seed.batch(
            f"bench-old-{i}",
            now=now - timedelta(days=40),
            completed=items // batches,
            analyze=i == batches - 1,
        ).pk
        for i in range(batches)
    ]
    Batch.objects.filter(pk__in=old).update(finished_at=now - timedelta(days=31))
    # Enough queued work that the claimers outlast the time before the purge
    # and the purge (at most about 1,000 claims a second here, and at least
    # as many claims as items purged: a paced purge ran them dry at half).
    side = seed.batch(
        "bench-purge-side",
        now=now - timedelta(seconds=1),
        queued=max(2_000, items + int(1_000 * bench.sizes.purge_baseline_seconds)),
        priority=20,
    )
    workers = _workers(bench.p)
    stop = Path(tempfile.mkdtemp()) / "stop"
    claims: list[dict] = []
    going = threading.Event()
    thread = threading.Thread(
        target=lambda: claims.extend(
            loops.run(
                "model",
                [
                    {
                        "worker": w.pk,
                        "latency": True,
                        "stamps": True,
                        "stop_file": str(stop),
                    }
                    for w, _ in workers
                ],
                duration=3_600,
                started=going,
            )
        )
    )
    thread.start()
    going.wait(timeout=180)
    # The same claims before the purge: what this machine gives without one.
    quiet_from = time.time() + 0.5
    time.sleep(0.5 + bench.sizes.purge_baseline_seconds)
    began = time.time()
    started = time.perf_counter()
    report = purge(older_than=timedelta(days=30))
    took = time.perf_counter() - started
    ended = time.time()
    stop.touch()
    thread.join()
    Batch.objects.filter(pk=side.pk).update(paused_at=utcnow())
    stamped = [
        (at, latency)
        for r in claims
        for at, latency in zip(r["stamps"], r["latencies"], strict=True)
    ]
    waits = [latency for at, latency in stamped if began <= at <= ended]
    quiet = [latency for at, latency in stamped if quiet_from <= at < began]
    done = sum(r["done"] for r in claims)
    left = Batch.objects.filter(pk__in=old).count()
    violations = find_violations()
    bench.add(
        "17",
        "purge",
        f"delete {report.jobs:,} finished items in {len(report.batches)} batches "
        f"(P={bench.p} claiming)",
        f"{took:.1f} s = {report.jobs / took:,.0f} items/s",
        "all gone",
        report.jobs == items and left == 0,
    )
    bench.add(
        "17",
        "purge",
        f"longest claim meanwhile (p99), of {len(waits):,}; {done:,} completed",
        f"{_ms(max(waits))} ({_ms(_pct(waits, 0.99))})",
        "<= 200 ms",
        bool(waits) and max(waits) <= 0.2,
    )
    bench.add(
        "17",
        "purge",
        f"the same claims just before the purge, {len(quiet):,}; longest purge chunk",
        f"{_ms(max(quiet))} ({_ms(_pct(quiet, 0.99))}); {_ms(report.longest_chunk)}",
    )
    bench.add(
        "17",
        "purge",
        "claims over 200 ms: during the purge / just before",
        f"{sum(w > 0.2 for w in waits)} of {len(waits):,} / "
        f"{sum(w > 0.2 for w in quiet)} of {len(quiet):,}",
    )
    bench.add(
        "17",
        "purge",
        "recall_check after the purge",
        f"{len(violations)} violations",
        "0",
        not violations,
    )


def long_poll(bench: Bench) -> None:
    """15: idle workers long-polling an empty queue, then a batch for all of them."""
    from batches.manifests import create_batch
    from batches.models import Batch
    from bench import seed
    from bench.long_poll import LongPollFleet
    from bench.loops import utcnow
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


SCENARIOS = {
    "1": throughput,
    "4": peers,
    "5": idle,
    "6": sweep,
    "7": progress,
    "9": intake_export,
    "10": sustained,
    "11": fair_share,
    "12": exports_vs_heartbeats,
    "13": metrics_scrape,
    "14": idle_fleet,
    "15": long_poll,
    "17": purge_while_claiming,
    "18": hostile_clients,
}
# 2, 3 and 8 are measured with 1, interleaved with it.
ALIASES = {"2": "1", "3": "1", "8": "1"}


def print_table(bench: Bench) -> None:
    header = Row("#", "scenario", "figure", "value", "target", "")
    rows = [header, *bench.rows]
    widths = [max(len(getattr(r, f)) for r in rows) for f in Row.__dataclass_fields__]
    print()
    for i, row in enumerate(rows):
        cells = [getattr(row, f) for f in Row.__dataclass_fields__]
        print(
            "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _scale_main(parser: argparse.ArgumentParser, args) -> int:
    """``--scale``: seed a database of its own and time it (bench/scale.py)."""
    from bench import scale

    try:
        total = scale.parse_scale(args.scale)
    except ValueError as error:
        parser.error(str(error))
    if not 1 <= args.scale_batches <= total // 10:
        parser.error(f"--scale-batches must be between 1 and {total // 10:,}")
    if args.reuse and not args.database_url:
        parser.error("--reuse needs --database-url (the kept database's URL)")
    sizes = Sizes.quick(args.processes) if args.quick else Sizes(args.processes)
    sizes.runs = args.runs or 1
    os.chdir(ROOT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    server = None
    if args.reuse:
        database_url = args.database_url
    elif args.database_url:
        database_url = _create_database(args.database_url, "recall_bench_scale")
    else:
        sys.path.insert(0, str(ROOT))
        from tests.pgserver import PrivatePostgres

        server = PrivatePostgres()
        # Stock settings but for memory and checkpoints sized for tables of
        # gigabytes (what any server holding them would be given).
        server.start(settings=SCALE_SERVER_SETTINGS)
        database_url = server.create_database("recall_bench_scale")
    keep = False
    try:
        _setup_django(database_url)
        bench = Bench(sizes, database_url, {"S"})
        bench.postmaster = _postmaster(server)
        scale.run(bench, total, args.scale_batches, reuse=args.reuse)
        print_table(bench)
        load = ", ".join(f"{n:.1f}" for n in os.getloadavg())
        print(
            f"\n{time.monotonic() - started:.0f} s in all; load average at the end "
            f"{load} on {os.cpu_count()} cores."
        )
        keep = args.keep or args.reuse
    finally:
        from django.db import connections

        connections.close_all()
        if keep:
            print(f"kept: {database_url}")
        elif server is not None:
            server.destroy()
        elif args.database_url:
            import psycopg

            with psycopg.connect(args.database_url, autocommit=True) as connection:
                connection.execute('DROP DATABASE IF EXISTS "recall_bench_scale"')
    return 0


def _postmaster(server) -> int | None:
    """The PostgreSQL server's main process, if it runs on this machine and
    its data directory is readable (for its CPU time), else None."""
    if server is not None:
        return int((server.data / "postmaster.pid").read_text().split()[0])
    from django.db import DatabaseError, connection

    try:
        with connection.cursor() as cursor:  # superusers only
            cursor.execute("SELECT current_setting('data_directory')")
            (directory,) = cursor.fetchone()
        return int((Path(directory) / "postmaster.pid").read_text().split()[0])
    except (DatabaseError, OSError, ValueError, IndexError):
        return None


# The private server of a --scale run: stock but for these.
SCALE_SERVER_SETTINGS = {
    "fsync": "on",
    "max_connections": "300",
    "shared_buffers": "2GB",
    "maintenance_work_mem": "512MB",
    "max_wal_size": "8GB",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", "-P", type=int, default=8)
    parser.add_argument("--runs", type=int, help="runs per figure (median)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks the harness runs"
    )
    parser.add_argument(
        "--only", help="comma-separated scenario numbers (default: all)", default=""
    )
    parser.add_argument("--sustain-minutes", type=float)
    parser.add_argument(
        "--purge-items",
        type=int,
        help="finished items scenario 17 purges (default 200,000; 1000000 for 1M)",
    )
    parser.add_argument(
        "--purge-baseline-seconds",
        type=float,
        help="how long scenario 17 times the claims before the purge starts "
        "(default 20; as long as the purge tells its tail from the machine's)",
    )
    parser.add_argument(
        "--database-url", help="measure this PostgreSQL (default: a private server)"
    )
    parser.add_argument(
        "--scale",
        help="instead of the scenarios: seed this many jobs (10m, 250k ...) over "
        "--scale-batches batches in a database of their own, and time what "
        "operators and workers touch (BENCHMARKS.md, 'Ten million items')",
    )
    parser.add_argument("--scale-batches", type=int, default=1_000)
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="with --scale and --database-url: measure the database at that URL, "
        "seeded and kept by an earlier --scale --keep run of the same size",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="with --scale: keep the seeded database (and the private server)",
    )
    args = parser.parse_args(argv)
    if args.scale:
        return _scale_main(parser, args)
    sizes = Sizes.quick(args.processes) if args.quick else Sizes(args.processes)
    if args.runs:
        sizes.runs = args.runs
    if args.sustain_minutes is not None:
        sizes.sustain_seconds = args.sustain_minutes * 60
    if args.purge_items is not None:
        sizes.purge_items = args.purge_items
    if args.purge_baseline_seconds is not None:
        sizes.purge_baseline_seconds = args.purge_baseline_seconds
    wanted = {n.strip() for n in args.only.split(",") if n.strip()} or set(SCENARIOS)
    unknown = wanted - set(SCENARIOS) - set(ALIASES)
    if unknown:
        parser.error(f"no scenario {', '.join(sorted(unknown))}")
    if wanted & set(ALIASES):
        wanted |= {"1"}
    if "1" in wanted and not args.only:
        wanted |= {"2", "3", "8"}

    os.chdir(ROOT)
    # A SIGTERM unwinds like an error: gunicorn and the private server stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    database_url, server = _start_database(args)
    try:
        _setup_django(database_url)
        bench = Bench(sizes, database_url, wanted)
        if server is not None:
            bench.postmaster = int(
                (server.data / "postmaster.pid").read_text().split()[0]
            )
        if {"3", "8", "13", "14", "15"} & wanted:
            _start_gunicorn(bench)
        try:
            for number, scenario in SCENARIOS.items():
                if number in wanted:
                    print(f"== {scenario.__doc__.splitlines()[0]}", flush=True)
                    scenario(bench)
        finally:
            _stop_gunicorn(bench)
        print_table(bench)
        load = ", ".join(f"{n:.1f}" for n in os.getloadavg())
        print(
            f"\nP={sizes.processes}, {sizes.runs} run(s) per figure, "
            f"{time.monotonic() - started:.0f} s in all; load average at the end "
            f"{load} on {os.cpu_count()} cores."
        )
    finally:
        if server is not None:
            from django.db import connections

            connections.close_all()
            server.destroy()
    return 0
