"""No-op jobs/s of two peer job queues: the baseline Recall is measured against.

"What a Django user would pick instead", each on the given PostgreSQL at its best
*documented* configuration. Each function owns the database named by its ``dsn``
(an existing, otherwise empty database; one per peer): it (re)creates or empties
its tables there, enqueues ``jobs`` no-op jobs (not timed), starts the peer's own
worker processes, and times from the moment the workers are started until the
database shows all ``jobs`` finished (polled every 50 ms). Worker start-up is
therefore *inside* the measurement, as it would be for Recall's workers. The
workers are then stopped whatever happens (one SIGTERM to each, then SIGKILL
to its process group after a timeout). A finished job leaves no row behind for
either peer (their best documented setting), so "finished" means "no row left".
Neither peer keeps a result row for a successful job in this configuration.

procrastinate (``requirements-bench.txt``)
    * Schema: ``App.schema_manager.apply_schema()`` on first use; later runs
      ``TRUNCATE`` its tables.
    * Enqueue: ``Task.batch_defer`` (docs: "Batch defer multiple jobs"), in chunks.
    * Task: an ``async def`` no-op, since asynchronous tasks are what the
      ``concurrency`` setting is for (docs: "Execute multiple jobs at the same
      time"; sync tasks run in a thread and the docs advise against concurrency
      for them).
    * Workers: ``processes`` OS processes (``python -m bench.peers
      procrastinate-worker``, DSN in the environment), each ``App.run_worker``
      on a ``PsycopgConnector`` with:
        - ``concurrency=4`` async sub-workers (docs: "multiple workers, each in
          their own process", plus ``concurrency`` for async tasks); 4 was the
          best of 1-16 measured on a 2-core box with the connector's default
          pool (psycopg_pool's 4 connections, one held by the listener); 10+
          needs a bigger pool, and 8 processes x 12 connections nears
          PostgreSQL's default ``max_connections=100``, for no gain;
        - ``listen_notify=True`` (the default: LISTEN/NOTIFY wake-ups, polling
          only as a fallback);
        - ``delete_jobs="successful"`` (docs: "Delete finished jobs"): keeps
          ``procrastinate_jobs`` small as ``"always"`` would, but a failed job
          stays visible so the run fails loudly instead of counting it;
        - ``fetch_job_polling_interval=0.5``: only used once the queue is empty
          (the worker fetches back to back while jobs remain).
    * Finished when ``procrastinate_jobs`` is empty.

django-q2 (Recall's own dependency) with its ORM broker (``bench/q2_settings.py``)
    * Tables: ``migrate`` with ``bench.q2_settings``; later runs ``TRUNCATE`` them.
    * Enqueue: ``django_q.tasks.async_task("bench.peers.noop")`` in one
      transaction (the ORM broker has no bulk enqueue).
    * Database: ``CONN_MAX_AGE=60`` (Django's documented persistent connections;
      with the default 0 the ORM broker's ``close_old_connections()`` reconnects
      on every dequeue and acknowledgement: about 5x slower here).
    * Workers: ``python -m django qcluster`` with ``workers=processes`` (plus the
      cluster's own sentinel, pusher and monitor processes), ``sync=False``,
      ``bulk=10`` and ``queue_limit=max(50, workers**2)`` (the ORM broker example
      in the "Configuration" docs; ``bulk`` "can improve performance"),
      ``save_limit=-1`` ("no success storage at all": with the default 250 the
      monitor scans and prunes ``django_q_task`` under ``select_for_update`` for
      every result), ``ack_failures=True`` (a failure leaves the queue and is
      saved, so the run fails loudly), ``recycle=1_000_000`` (no worker restart
      every 500 tasks; a no-op frees no memory), ``compress=False`` ("overhead
      with many small packages"), ``scheduler=False`` and ``catch_up=False`` (no
      schedules), ``poll=0.2`` (the default; the pusher only sleeps on an empty
      queue), ``timeout=30`` below ``retry=60`` (as the docs require),
      ``log_level="WARNING"`` (no log line per task). ``bulk=50`` measured no
      better than 10; ``bulk=1`` (the default) is about 40% slower.
    * Finished when ``django_q_ormq`` is empty: the monitor acknowledges (deletes)
      a task's queue row only after its result is handled.

Usage: ``python -m bench.peers --dsn postgres://root@127.0.0.1:5432/db --jobs 2000
--processes 8`` prints both figures (both peers can share one database: their
tables differ).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import psycopg

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Asynchronous sub-workers per procrastinate worker process.
PROCRASTINATE_CONCURRENCY = 4
#: procrastinate's fallback poll (seconds) when LISTEN/NOTIFY brings nothing.
PROCRASTINATE_POLL = 0.5
#: The task name both the deferring side and the workers register.
PROCRASTINATE_TASK = "bench_noop"
#: Jobs per ``batch_defer`` call (one INSERT each).
PROCRASTINATE_BATCH = 1000

POLL_SECONDS = 0.05
STOP_TIMEOUT = 15.0
DEFAULT_TIMEOUT = 300.0

_PROCRASTINATE_TABLES = (
    "procrastinate_events",
    "procrastinate_periodic_defers",
    "procrastinate_jobs",
    "procrastinate_workers",
)
_Q2_TABLES = ("django_q_ormq", "django_q_task", "django_q_schedule")


def noop() -> None:
    """The django-q2 job: does nothing."""


async def _procrastinate_noop() -> None:
    """The procrastinate job: does nothing (asynchronously)."""


# --------------------------------------------------------------------------
# Shared plumbing


def _env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this repo importable, ``extra`` set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(extra)
    return env


def _spawn(
    args: Sequence[str], env: dict[str, str], log: IO[bytes]
) -> subprocess.Popen:
    """Start ``python args`` in its own session (so its process group can be killed)."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop(procs: Sequence[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """One SIGTERM to each worker, then SIGKILL to its process group after ``timeout``.

    SIGTERM goes to the session leader only: that is each peer's documented clean
    stop (procrastinate's worker finishes its jobs and exits; qcluster's Cluster
    stops its sentinel, which stops pusher, workers and monitor in order). Sent
    to the whole qcluster group instead, it kills the sentinel outright (it runs
    with SIGTERM at SIG_DFL) and the leader's handler then deadlocks. The final
    SIGKILL to the group also removes any child that outlived its leader.
    """
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _tail(log: IO[bytes], limit: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-limit:]


@contextlib.contextmanager
def _workers(
    argv_list: Sequence[Sequence[str]], env: dict[str, str]
) -> Iterator[tuple[list[subprocess.Popen], IO[bytes], float]]:
    """Run worker processes (output to one temporary log), always stopping them.

    Yields the processes, their log and the ``perf_counter()`` taken just before
    the first of them was started.
    """
    with tempfile.TemporaryFile() as log:
        procs: list[subprocess.Popen] = []
        try:
            started = time.perf_counter()
            for argv in argv_list:
                procs.append(_spawn(argv, env, log))
            yield procs, log, started
        finally:
            _stop(procs)


def _time_until_done(
    remaining: Callable[[], int],
    procs: Sequence[subprocess.Popen],
    log: IO[bytes],
    started: float,
    timeout: float,
) -> float:
    """Poll ``remaining()`` every 50 ms; seconds from ``started`` until it is 0."""
    deadline = started + timeout
    while True:
        if remaining() == 0:
            return time.perf_counter() - started
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(
                f"worker exited early (code {dead[0].returncode}):\n{_tail(log)}"
            )
        if time.perf_counter() > deadline:
            raise TimeoutError(f"jobs not finished after {timeout}s:\n{_tail(log)}")
        time.sleep(POLL_SECONDS)


def _counter(conn: psycopg.Connection, sql: str, failed_sql: str) -> Callable[[], int]:
    """``remaining()`` for ``_time_until_done``: raises if any job failed."""

    def remaining() -> int:
        row = conn.execute(failed_sql).fetchone()
        if row and row[0]:
            raise RuntimeError(f"{row[0]} benchmark job(s) failed")
        count = conn.execute(sql).fetchone()
        return count[0] if count else 0

    return remaining


def _table_exists(conn: psycopg.Connection, table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    return bool(row and row[0])


def _check(jobs: int, processes: int) -> None:
    if jobs < 1 or processes < 1:
        raise ValueError("jobs and processes must be at least 1")


# --------------------------------------------------------------------------
# procrastinate


def _procrastinate_app(connector: Any) -> Any:
    """A procrastinate App on ``connector`` with the no-op task registered."""
    import procrastinate

    app = procrastinate.App(connector=connector)
    app.task(name=PROCRASTINATE_TASK)(_procrastinate_noop)
    return app


def procrastinate_jobs_per_second(
    dsn: str,
    *,
    jobs: int,
    processes: int,
    concurrency: int = PROCRASTINATE_CONCURRENCY,
    timeout: float = DEFAULT_TIMEOUT,
    tuned: bool = True,
) -> float:
    """No-op jobs/s of procrastinate with ``processes`` worker processes on ``dsn``.

    ``tuned=False``: the worker's defaults instead (``concurrency=1``, finished
    jobs kept), what a user who follows the quickstart runs.
    """
    import procrastinate

    _check(jobs, processes)
    with psycopg.connect(dsn, autocommit=True) as conn:
        fresh = not _table_exists(conn, "procrastinate_jobs")
        if not fresh:
            conn.execute(f"TRUNCATE {', '.join(_PROCRASTINATE_TABLES)} CASCADE")
        app = _procrastinate_app(procrastinate.SyncPsycopgConnector(conninfo=dsn))
        with app.open():
            if fresh:
                app.schema_manager.apply_schema()
            task = app.tasks[PROCRASTINATE_TASK]
            for start in range(0, jobs, PROCRASTINATE_BATCH):
                task.batch_defer(
                    *({} for _ in range(min(PROCRASTINATE_BATCH, jobs - start)))
                )
        remaining = _counter(
            conn,
            "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'failed'",
        )
        if remaining() != jobs:
            raise RuntimeError("procrastinate: enqueued job count is off")
        worker = ["-m", "bench.peers", "procrastinate-worker"]
        env = _env(
            BENCH_PROCRASTINATE_DSN=dsn,
            BENCH_PROCRASTINATE_CONCURRENCY=str(concurrency),
            BENCH_PROCRASTINATE_TUNED="1" if tuned else "0",
        )
        with _workers([worker] * processes, env) as (procs, log, started):
            elapsed = _time_until_done(remaining, procs, log, started, timeout)
    return jobs / elapsed


def _procrastinate_worker() -> None:
    """One procrastinate worker process at the configuration described above.

    The DSN and concurrency come from the environment (``BENCH_PROCRASTINATE_*``),
    which keeps a password in the DSN out of the process list.
    """
    import procrastinate

    dsn = os.environ["BENCH_PROCRASTINATE_DSN"]
    concurrency = int(os.environ["BENCH_PROCRASTINATE_CONCURRENCY"])
    connector = procrastinate.PsycopgConnector(conninfo=dsn)
    app = _procrastinate_app(connector)
    if os.environ.get("BENCH_PROCRASTINATE_TUNED") == "0":
        app.run_worker()  # the defaults
        return
    app.run_worker(
        concurrency=concurrency,
        listen_notify=True,
        delete_jobs="successful",
        fetch_job_polling_interval=PROCRASTINATE_POLL,
    )


# --------------------------------------------------------------------------
# django-q2


def _q2_env(dsn: str, processes: int, tuned: bool = True) -> dict[str, str]:
    return _env(
        DJANGO_SETTINGS_MODULE="bench.q2_settings",
        BENCH_Q2_DATABASE_URL=dsn,
        BENCH_Q2_WORKERS=str(processes),
        BENCH_Q2_TUNED="1" if tuned else "0",
    )


def _run(args: Sequence[str], env: dict[str, str]) -> None:
    """Run ``python args`` to completion; raise with its output if it fails."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        start_new_session=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}{done.stderr}")


def django_q2_jobs_per_second(
    dsn: str,
    *,
    jobs: int,
    processes: int,
    timeout: float = DEFAULT_TIMEOUT,
    tuned: bool = True,
) -> float:
    """No-op jobs/s of a django-q2 ORM-broker cluster of ``processes`` workers.

    ``tuned=False``: django-q2's defaults but for the ORM broker and the worker
    count (one task per dequeue, successes saved), see ``bench.q2_settings``.
    """
    _check(jobs, processes)
    env = _q2_env(dsn, processes, tuned)
    _run(["-m", "django", "migrate", "--no-input", "-v", "0"], env)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(_Q2_TABLES)}")
        _run(["-m", "bench.peers", "q2-enqueue", "--jobs", str(jobs)], env)
        remaining = _counter(
            conn,
            "SELECT count(*) FROM django_q_ormq",
            "SELECT count(*) FROM django_q_task WHERE NOT success",
        )
        if remaining() != jobs:
            raise RuntimeError("django-q2: enqueued job count is off")
        with _workers([["-m", "django", "qcluster"]], env) as (procs, log, started):
            elapsed = _time_until_done(remaining, procs, log, started, timeout)
    return jobs / elapsed


def _q2_enqueue(jobs: int) -> None:
    """Enqueue ``jobs`` no-op tasks (run with ``bench.q2_settings``)."""
    import django

    django.setup()
    from django.db import transaction
    from django_q.tasks import async_task

    with transaction.atomic():
        for _ in range(jobs):
            async_task("bench.peers.noop")


# --------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> None:
    """``--dsn --jobs --processes``: print both peers' jobs/s (or run a helper)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["procrastinate-worker"]:
        _procrastinate_worker()
        return
    if args[:1] == ["q2-enqueue"]:
        parser = argparse.ArgumentParser(prog="bench.peers q2-enqueue")
        parser.add_argument("--jobs", type=int, required=True)
        _q2_enqueue(parser.parse_args(args[1:]).jobs)
        return

    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dsn", required=True, help="libpq URL of a scratch database")
    parser.add_argument("--q2-dsn", help="a separate database for django-q2")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument(
        "--peer", choices=("all", "procrastinate", "django-q2"), default="all"
    )
    ns = parser.parse_args(args)
    if ns.peer in ("all", "procrastinate"):
        rate = procrastinate_jobs_per_second(
            ns.dsn, jobs=ns.jobs, processes=ns.processes
        )
        print(f"procrastinate: {rate:.1f} jobs/s")
    if ns.peer in ("all", "django-q2"):
        rate = django_q2_jobs_per_second(
            ns.q2_dsn or ns.dsn, jobs=ns.jobs, processes=ns.processes
        )
        print(f"django-q2: {rate:.1f} jobs/s")


if __name__ == "__main__":
    # Run as ``bench.peers``, not ``__main__``: the workers must register the
    # procrastinate task (and django-q2 must find ``noop``) under that name.
    from bench import peers

    peers.main()
