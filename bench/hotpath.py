"""What one claim and its completion cost the app, measured so that a loaded
machine does not move the figure: ``python -m bench.hotpath``.

Throughput figures (``make bench`` rows 2 and 3) are wall-clock rates: on a
shared machine they move by tens of percent from one hour to the next. This
runs the same claim + complete in one process, one after another, and prints
the CPU time per step, the app's and its database backends' (read from /proc:
a server on this machine); under callgrind the instruction count of those steps
alone, which is the same on a quiet machine and a busy one:

    valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=sys_call_tracing --callgrind-out-file=hot.cg \\
        .venv/bin/python -m bench.hotpath --database-url URL model 300
    grep ^summary hot.cg    # instructions of the 300 steps

Only the measured steps run inside ``sys.call_tracing`` (which nothing else
calls), so callgrind counts them and not Django's start-up. ``raw`` sends row
1's two statements (bench/loops.py) over psycopg, the floor the model layer
is measured against; ``model`` calls
``transitions.claim_next`` and ``transitions.complete`` as bench/loops.py's
model loop does (row 2); ``http`` sends the worker's two requests through
Django's WSGI handler in process (every middleware, the views, the request
metrics as gunicorn's processes keep them), without a socket or gunicorn
(row 3 less the server); ``http_many`` a claim of 8 jobs then a completion
request each, ``http_batched`` the same claim then one batched completion
(row 21 less the server; CPU per step and per job). The queue is seeded
fresh each run (bench/seed.py), finished jobs in front, and one job more than
the steps take, so no step finishes the batch; ``--batches N`` spreads it over
N open batches of one priority, so that each claim is charged to its batch's
fair share as in row 11 (one batch has no share to charge); ``--live N``
has another worker hold N leases through the steps, as a fleet's GPUs do.
``--profile FILE`` writes a cProfile of the steps (CPU time, so waits for the
database do not count) instead.

``--statements`` prints what the database did for the steps instead of
leaving it to guess: each statement run at least once per two steps, from
``pg_stat_statements`` (loaded into the private server; with
``--database-url``, a server that loads it), with its calls and plans per
step, its planning and execution time per call, and the buffers it touched.
A statement planned on every call shows there at once: that is how the
claim's re-planning was found (docs/development/benchmark-history.md, "The
claim planned on every call").
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

WARM_UP = 50
# The jobs of one claim of the http_many and http_batched steps (row 21's).
JOBS_PER_CLAIM = 8


def _model_step(worker) -> Callable[[], None]:
    from jobs import transitions

    def step() -> None:
        job = transitions.claim_next(worker)
        if job is None:
            raise RuntimeError("the queue ran dry")
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "ok"})

    return step


def _raw_step(batch: int, worker: int) -> Callable[[], None]:
    """Row 1's two statements, as its loop sends them (bench/loops.py)."""
    import psycopg

    from bench.loops import raw_step

    # The database Django was set up on (bench.core._setup_django).
    raw = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
    claim_and_complete = raw_step(raw, batch=batch, worker=worker)

    def step() -> None:
        if not claim_and_complete():
            raise RuntimeError("the queue ran dry")

    return step


def _http_step(token: str) -> Callable[[], None]:
    post = _poster(token)

    def step() -> None:
        job = json.loads(post("/api/v1/claim", b"{}"))["job"]
        body = {"lease_token": job["lease_token"], "result": {"text": "ok"}}
        post(f"/api/v1/jobs/{job['id']}/complete", json.dumps(body).encode())

    return step


def _http_many_step(token: str, *, batched: bool) -> Callable[[], None]:
    """A claim of JOBS_PER_CLAIM jobs (``max_jobs``), then their completions:
    one batched completion, or one request each (row 21 before it)."""
    post = _poster(token)
    claim = json.dumps({"max_jobs": JOBS_PER_CLAIM}).encode()
    ok = {"text": "ok"}

    def step() -> None:
        jobs = json.loads(post("/api/v1/claim", claim))["jobs"]
        if batched:
            results = [
                {"job_id": job["id"], "lease_token": job["lease_token"], "result": ok}
                for job in jobs
            ]
            post("/api/v1/complete", json.dumps({"results": results}).encode())
            return
        for job in jobs:
            body = {"lease_token": job["lease_token"], "result": ok}
            post(f"/api/v1/jobs/{job['id']}/complete", json.dumps(body).encode())

    return step


def _poster(token: str) -> Callable[[str, bytes], bytes]:
    from django.core.wsgi import get_wsgi_application

    application = get_wsgi_application()

    def post(path: str, body: bytes) -> bytes:
        environ = {
            "REQUEST_METHOD": "POST",
            "SCRIPT_NAME": "",
            "PATH_INFO": path,
            "RAW_URI": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "HTTP_HOST": "127.0.0.1:8000",
            "HTTP_USER_AGENT": "Python-urllib/3.11",
            "HTTP_AUTHORIZATION": f"Bearer {token}",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
            "wsgi.version": (1, 0),
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        status: list[str] = []
        response = application(environ, lambda s, h, e=None: status.append(s))
        data = b"".join(response)
        response.close()
        if not status[0].startswith("200"):
            raise RuntimeError(f"{path}: {status[0]} {data[:200]!r}")
        return data

    return post


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hotpath", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "kind", choices=["raw", "model", "http", "http_many", "http_batched"]
    )
    parser.add_argument("steps", type=int, help="claim + complete steps to measure")
    parser.add_argument(
        "--database-url", help="a PostgreSQL database (default: a private server)"
    )
    parser.add_argument("--profile", help="write a cProfile of the steps here")
    parser.add_argument(
        "--batches",
        type=int,
        default=1,
        help="spread the queue over this many open batches (fair share, row 11)",
    )
    parser.add_argument(
        "--live",
        type=int,
        default=0,
        help="leases another worker holds through the steps (a fleet's)",
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="also print each statement's plans and times (pg_stat_statements)",
    )
    args = parser.parse_args(argv)
    if args.kind == "raw" and args.batches > 1:
        parser.error("raw claims from one batch, as row 1 does: no --batches")

    from bench.core import _setup_django, _start_database
    from bench.cpu import cpu_seconds

    # As gunicorn's processes keep the request metrics (recall_site/metric_files.py).
    os.environ.setdefault(
        "PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="recall-hotpath-")
    )
    url, server = _start_database(args, STATEMENTS_SERVER if args.statements else None)
    try:
        _setup_django(url)
        from bench import seed
        from bench.loops import utcnow

        seed.reset()
        (worker, token), (fleet, _) = seed.workers(2, prefix="hotpath")
        per_step = 1 if args.kind in ("raw", "model", "http") else JOBS_PER_CLAIM
        # Every batch keeps a job more than the steps (and the fleet's leases)
        # can take from it, so no step finishes one.
        jobs = ((WARM_UP + args.steps) * per_step + args.live) // args.batches + 1
        for n in range(args.batches):
            batch = seed.batch(
                f"hotpath-{n}",
                now=utcnow() - timedelta(seconds=1),
                completed=jobs,
                queued=jobs,
                analyze=n == args.batches - 1,
            )
        _lease(fleet, args.live)
        step = {
            "raw": lambda: _raw_step(batch.pk, worker.pk),
            "model": lambda: _model_step(worker),
            "http": lambda: _http_step(token),
            "http_many": lambda: _http_many_step(token, batched=False),
            "http_batched": lambda: _http_many_step(token, batched=True),
        }[args.kind]()
        for _ in range(WARM_UP):
            step()
        if args.statements:
            _reset_statements()

        def steps() -> None:
            for _ in range(args.steps):
                step()

        backends = _backends()
        database = sum(cpu_seconds(pid) for pid in backends)
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        cpu = time.process_time()
        sys.call_tracing(steps, ())
        cpu = time.process_time() - cpu
        database = sum(cpu_seconds(pid) for pid in backends) - database
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        print(
            f"{args.kind}: {args.steps} claim + complete steps, "
            + (f"over {args.batches} open batches, " if args.batches > 1 else "")
            + f"{1000 * cpu / args.steps:.3f} ms of CPU each"
            + f" (and {1000 * database / args.steps:.3f} ms of the database's)"
            + (
                f" ({1000 * cpu / args.steps / per_step:.3f} ms per job)"
                if per_step > 1
                else ""
            )
        )
        if args.statements:
            _print_statements(args.steps)
    finally:
        if server is not None:
            server.destroy()
    return 0


def _lease(worker, n: int) -> None:
    """``n`` live leases held by ``worker`` (the rest of a fleet), claimed
    before the steps and left live through them."""
    from jobs import transitions

    for _ in range(n):
        if transitions.claim_next(worker, max_leases=n) is None:
            raise RuntimeError("the queue ran dry")


def _backends() -> list[int]:
    """The database's client backends (the steps' connections among them)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT pid FROM pg_stat_activity
            WHERE datname = current_database() AND backend_type = 'client backend'"""
        )
        return [pid for (pid,) in cursor.fetchall()]


# The private server of --statements: the statistics module loaded, planning
# timed too.
STATEMENTS_SERVER = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track_planning": "on",
}


def _reset_statements() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        cursor.execute("SELECT pg_stat_statements_reset()")


def _print_statements(steps: int) -> None:
    """The statements of the measured steps (run at least once per two steps),
    dearest first: per step, per call, and the text's start."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT calls, plans, total_plan_time, total_exec_time,
                   shared_blks_hit + shared_blks_read, query
            FROM pg_stat_statements
            WHERE dbid = (SELECT oid FROM pg_database
                          WHERE datname = current_database())
              AND calls >= %s
            ORDER BY total_plan_time + total_exec_time DESC""",
            [max(1, steps // 2)],
        )
        rows = cursor.fetchall()
    print(
        f"{'calls/step':>10} {'plans/call':>10} {'plan ms':>8} {'exec ms':>8} "
        f"{'buffers':>8}  statement"
    )
    for calls, plans, plan_ms, exec_ms, buffers, query in rows:
        text = " ".join(query.split())[:60]
        print(
            f"{calls / steps:>10.2f} {plans / calls:>10.2f} "
            f"{plan_ms / calls:>8.3f} {exec_ms / calls:>8.3f} "
            f"{buffers / calls:>8.1f}  {text}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
