"""What every benchmark scenario shares: the sizes of a run, its rows and the
``Bench`` they are added to; the database (a private PostgreSQL server through
``harness/pgserver.py``, or ``--database-url``) and Django set up on it; the
production server (gunicorn.conf.py through ``harness/server.py``); and the
small helpers the scenarios (``bench/scenarios/``) time and count with.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from bench.cpu import cpu_seconds
from harness.pgserver import PrivatePostgres
from harness.server import Server, ServerError

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sizes:
    processes: int = 8
    runs: int = 3
    throughput_seconds: float = 10.0
    throughput_jobs: int = 60_000
    peer_jobs: int = 5_000
    # A peer's run gives up after this long (a shared machine slows a stock
    # peer to a few jobs a second: django-q2's took over 300 s on 2026-12-03).
    peer_timeout: float = 900.0
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
    routing_batches: int = 1_000
    routing_sets: int = 20
    routing_jobs: int = 100_000
    routing_seconds: float = 10.0
    beat_workers: int = 250
    beat_leases: int = 8
    beat_interval: float = 10.0
    beat_seconds: float = 60.0
    claim_max_jobs: int = 8
    search_items: int = 1_000_000
    search_queries: int = 100

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
            routing_batches=40,
            routing_jobs=800,
            routing_seconds=0.5,
            beat_workers=10,
            beat_interval=0.5,
            beat_seconds=2.0,
            search_items=2_000,
            search_queries=10,
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
    server: Server | None = None  # the gunicorn master, while it runs
    server_port: int = 0
    postmaster: int | None = None  # the private PostgreSQL server's, if any
    # The peers' no-op jobs/s by (name, tuned), measured once per run (rows 4, 21).
    peer_rates: dict[tuple[str, bool], float] = field(default_factory=dict)

    def add(self, number, scenario, figure, value, target="", verdict=None):
        ok = "" if verdict is None else ("ok" if verdict else "MISSED")
        self.rows.append(Row(number, scenario, figure, value, target, ok))
        print(f"  {scenario}: {figure} = {value}  {target} {ok}", flush=True)

    @property
    def p(self) -> int:
        return self.sizes.processes


def _start_database(
    args, more: dict[str, str] | None = None
) -> tuple[str, object | None]:
    """The database to measure: ``--database-url``'s, else a private server's
    (with ``more`` PostgreSQL settings)."""
    if args.database_url:
        return args.database_url, None
    server = PrivatePostgres()
    # Stock PostgreSQL (fsync on, autovacuum on) with room for the clients.
    server.start(settings={"fsync": "on", "max_connections": "300", **(more or {})})
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


def _launch_gunicorn(**extra: str) -> tuple[Server, int]:
    """The production configuration (gunicorn.conf.py, README) on a free port,
    through the harness; ``extra`` environment on top (WEB_CONCURRENCY,
    RECALL_WEB_THREADS ... set in the environment of `make bench` reach it too)."""
    server = Server(
        {**os.environ, "RECALL_STARTUP_SWEEP": "quick", **extra},
        Path(tempfile.gettempdir()) / "recall-bench-gunicorn.log",
    )
    try:
        server.wait_until_up(60, interval=0.2)
    except ServerError as error:
        raise RuntimeError(
            "gunicorn did not start (see recall-bench-gunicorn.log)"
        ) from error
    return server, server.port


def _terminate(server: Server) -> None:
    """SIGTERM to the master; SIGKILL the lot if it is not gone in 30 s."""
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def _start_gunicorn(bench: Bench) -> None:
    bench.server, bench.server_port = _launch_gunicorn()


def _stop_gunicorn(bench: Bench) -> None:
    if bench.server is not None:
        _terminate(bench.server)
        bench.server = None


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
    bench: Bench,
    jobs: int,
    batches: int = 1,
    history: int | None = None,
    requires: Callable[[int], dict[str, str]] | None = None,
) -> list[int]:
    """``jobs`` queued jobs over ``batches`` batches, with ``history`` finished
    ones (as many as queued unless said) in front of them; batch ``i`` requires
    the labels ``requires(i)`` (none unless said).

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
            f"bench-{i}",
            now=now,
            completed=done,
            queued=per,
            analyze=i == batches - 1,
            requires=requires(i) if requires else None,
        ).pk
        for i in range(batches)
    ]


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
