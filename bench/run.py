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
import os
import signal
import sys
import time
from pathlib import Path

from bench.core import (
    ROOT,
    Bench,
    Sizes,
    _create_database,
    _setup_django,
    _start_database,
    _start_gunicorn,
    _stop_gunicorn,
    print_table,
)
from bench.scenarios import ALIASES, SCENARIOS
from harness.pgserver import PrivatePostgres


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


def _against_main(parser: argparse.ArgumentParser, args) -> int:
    """``--against``: this tree and earlier commits interleaved (bench/against.py)."""
    from bench import against

    if args.scale:
        parser.error("--against compares the scenarios' rows, not --scale")
    extra = []
    for flag, value in (
        ("--sustain-minutes", args.sustain_minutes),
        ("--purge-items", args.purge_items),
        ("--purge-baseline-seconds", args.purge_baseline_seconds),
    ):
        if value is not None:
            extra += [flag, str(value)]
    options = against.Options(
        only=args.only,
        runs=args.runs or (1 if args.quick else Sizes().runs),
        processes=args.processes,
        quick=args.quick,
        database_url=args.database_url,
        extra=extra,
    )
    try:
        return against.main(args.against, options)
    except against.AgainstError as error:
        print(f"bench --against: {error}", file=sys.stderr)
        return 2


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
        "--beat-seconds",
        type=float,
        help="how long scenario 20 measures the server's CPU in each of its two "
        "phases (default 60)",
    )
    parser.add_argument(
        "--search-items",
        type=int,
        help="transcripts scenario 22 searches (default 1,000,000)",
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
    parser.add_argument(
        "--against",
        metavar="COMMIT[,COMMIT...]",
        help="run the selected rows of this tree and of each commit's own bench "
        "in turn, --runs rounds of --runs 1 each, and print them side by side "
        "(bench/against.py; docs/development/benchmarks.md, 'Comparing commits')",
    )
    args = parser.parse_args(argv)
    if args.against:
        return _against_main(parser, args)
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
    if args.beat_seconds is not None:
        sizes.beat_seconds = args.beat_seconds
    if args.search_items is not None:
        sizes.search_items = args.search_items
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
        if {"3", "8", "13", "14", "15", "20", "21"} & wanted:
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
