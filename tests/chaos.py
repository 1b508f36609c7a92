"""``make chaos``: Recall under fire, then a check that nothing lies.

Starts a private PostgreSQL server, gunicorn with several processes, the
django-q2 cluster and many reference workers with short leases, on three
batches of different weights (sizes in proportion) with one planted poison item
(its engine kills the worker running it).
While it runs, it SIGKILLs random workers (and restarts them), SIGKILLs sweeps
mid-pass and the django-q2 cluster, and crashes PostgreSQL once. Then it stops
the violence, lets leases expire and sweeps run, and checks:

* ``recall_check`` passes (every invariant holds);
* every item is done, except the poison one, which failed;
* no job has more than one accepted completion;
* no 5xx other than the documented 503 (database unavailable) was served;
* while all three batches had work, claims and the leases held were shared
  within 10 points of their weights' shares (fair share).

It prints one summary line, e.g. ``chaos: 3000 jobs, 41 kills, 37 reclaims,
1 db restart, lost 0, duplicated 0, mismatched 0, 5xx 0``, and exits 0 only if
all is well. ``python -m tests.chaos --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tests.pgserver import PrivatePostgres, free_port

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
POISON = "chaos://poison/corrupt.wav"


@dataclass
class Shares:
    """Leases held per batch, sampled while every batch still has queued work."""

    weights: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    window_end: object = None  # the database's time when a batch ran dry

    def sample(self, url: str) -> None:
        if self.window_end is not None:
            return
        rows = _query(
            url,
            "SELECT b.id, b.weight, now(), "
            "count(*) FILTER (WHERE j.status = 'leased'), "
            "count(*) FILTER (WHERE j.status = 'queued') "
            "FROM batches_batch b JOIN jobs_job j ON j.batch_id = b.id GROUP BY b.id",
        )
        if any(queued == 0 for *_, queued in rows):
            self.window_end = rows[0][2]
            return
        self.samples += 1
        for batch_id, weight, _, leased, _ in rows:
            self.weights[batch_id] = weight
            self.held[batch_id] = self.held.get(batch_id, 0) + leased


@dataclass
class Tally:
    worker_kills: int = 0
    sweep_kills: int = 0
    cluster_kills: int = 0
    db_restarts: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.worker_kills + self.sweep_kills + self.cluster_kills


class Process:
    """A child in a session of its own, so a kill takes its children with it."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.popen: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=30)

    def stop(self, timeout: float = 30) -> None:
        self.signal(signal.SIGTERM)
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def _manage(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [PY, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"manage.py {' '.join(args)} failed:\n{result.stdout}{result.stderr}"
        )
    return result


def _query(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(url, connect_timeout=5) as connection:
        return connection.execute(sql).fetchall()


def _scalar(url: str, sql: str) -> int:
    return _query(url, sql)[0][0]


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally()
    pg = PrivatePostgres()
    work = pg.dir
    print(f"chaos: working in {work}", flush=True)
    processes: list[Process] = []
    stop_sweeps = threading.Event()
    try:
        pg.start()
        url = pg.create_database()
        port = free_port()
        env = {
            "PATH": os.environ["PATH"],
            "SECRET_KEY": secrets.token_urlsafe(50),
            "DATABASE_URL": url,
            "RECALL_HTTPS": "off",
            "RECALL_VAR_DIR": str(work),
            "RECALL_LEASE_SECONDS": str(args.lease),
            "RECALL_RETRY_BACKOFF_SECONDS": "0",
            "RECALL_MAX_ATTEMPTS": "3",
            "DATABASE_CONNECT_TIMEOUT": "2",
            "CONN_MAX_AGE": "60",
            "LOG_LEVEL": "WARNING",
            # The chaos engine's own sources: chaos://item/N.wav.
            "RECALL_SOURCE_SCHEMES": "chaos",
        }
        _manage(env, "migrate", "-v0")
        tokens = [
            _manage(env, "create_worker", f"chaos-{i}").stdout.strip().splitlines()[-1]
            for i in range(args.workers)
        ]
        lines = [
            f"chaos://item/{i:05d}.wav,{rng.randint(5, 600)}\n"
            for i in range(args.items - 1)
        ]
        lines.insert(rng.randrange(len(lines) + 1), f"{POISON},60\n")
        # Batch sizes in proportion to their weights: all three run dry together.
        weights = [int(w) for w in args.weights.split(",")]
        start = 0
        for n, weight in enumerate(weights):
            end = (
                len(lines)
                if n == len(weights) - 1
                else (start + len(lines) * weight // sum(weights))
            )
            manifest = work / f"manifest-{n}.csv"
            manifest.write_text("source,duration_seconds\n" + "".join(lines[start:end]))
            _manage(
                env, "create_batch", f"chaos-w{weight}", str(manifest),
                "--weight", str(weight),
            )  # fmt: skip
            start = end
        shares = Shares()

        web_env = {
            **env,
            "RECALL_BIND": f"127.0.0.1:{port}",
            "WEB_CONCURRENCY": str(args.web_processes),
            "RECALL_STARTUP_SWEEP": "quick",
            "RECALL_ACCESS_LOG": str(work / "access.log"),
        }
        web = Process(
            "gunicorn",
            [PY, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
            web_env,
            work / "gunicorn.log",
        )
        processes.append(web)
        _wait_for(lambda: _up(port), 60, "gunicorn did not start")
        cluster = Process(
            "qcluster", [PY, "manage.py", "qcluster"], env, work / "qcluster.log"
        )
        processes.append(cluster)

        worker_env = {
            "PATH": os.environ["PATH"],
            "RECALL_URL": f"http://127.0.0.1:{port}",
        }
        engine = f"{PY} tests/chaos_engine.py {{source}}"
        workers = []
        for i, token in enumerate(tokens):
            worker = Process(
                f"worker-{i}",
                [
                    PY,
                    "worker/recall_worker.py",
                    "--command",
                    engine,
                    "--poll-max",
                    "2",
                    "--retry-max",
                    "2",
                ],
                {**worker_env, "RECALL_TOKEN": token},
                work / f"worker-{i}.log",
            )
            workers.append(worker)
            processes.append(worker)

        sweeper = threading.Thread(
            target=_sweeps_killed_mid_pass,
            args=(env, rng, tally, stop_sweeps, work),
            daemon=True,
        )
        sweeper.start()

        started = time.monotonic()
        next_kill = started + rng.uniform(0.5, 1.5) * args.kill_every
        cluster_killed = db_restarted = False
        while (elapsed := time.monotonic() - started) < args.duration:
            if time.monotonic() >= next_kill:
                victim = rng.choice(workers)
                victim.kill()
                tally.worker_kills += 1
                time.sleep(rng.uniform(0, 1.5))
                victim.start()
                next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * args.kill_every
            if not cluster_killed and elapsed > args.duration / 3:
                cluster.kill()
                tally.cluster_kills += 1
                cluster.start()
                cluster_killed = True
            if not db_restarted and elapsed > args.duration / 2:
                pg.restart("immediate")  # a crash: recovery from the WAL
                tally.db_restarts += 1
                db_restarted = True
            for worker in workers:  # the poison item kills its worker: restart it
                if not worker.alive():
                    worker.start()
            with contextlib.suppress(psycopg.Error):  # the database may be down
                shares.sample(url)
            time.sleep(0.2)

        print("chaos: violence over, draining", flush=True)
        deadline = time.monotonic() + args.drain
        remaining = None
        while time.monotonic() < deadline:
            for worker in workers:
                if not worker.alive():
                    worker.start()
            remaining = _scalar(
                url,
                "SELECT count(*) FROM batches_batchitem WHERE status IN ('queued', 'transcribing')",
            )
            if remaining == 0:
                break
            time.sleep(1)
        stop_sweeps.set()
        sweeper.join(timeout=60)
        for process in reversed(processes):
            process.stop()
        _manage(env, "recall_sweep")  # what a scheduled sweep would do next
        return _verdict(args, env, url, work, tally, remaining, shares)
    finally:
        stop_sweeps.set()
        for process in processes:
            process.kill()
        if args.keep:
            print(f"chaos: kept {work}", flush=True)
        else:
            pg.destroy()


def _sweeps_killed_mid_pass(
    env, rng, tally: Tally, stop: threading.Event, work: Path
) -> None:
    """Run recall_sweep over and over; kill about half of the runs mid-pass."""
    while not stop.is_set():
        sweep = Process(
            "sweep", [PY, "manage.py", "recall_sweep"], env, work / "sweeps.log"
        )
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.3, 1.5))  # Django starts, then the pass begins
            if sweep.alive():
                sweep.kill()
                tally.sweep_kills += 1
        try:
            sweep.popen.wait(timeout=120)
        except subprocess.TimeoutExpired:
            sweep.kill()
        stop.wait(rng.uniform(0.5, 2.0))


def _verdict(
    args,
    env,
    url: str,
    work: Path,
    tally: Tally,
    remaining: int | None,
    shares: Shares,
) -> int:
    statuses = dict(_query(url, "SELECT source, status FROM batches_batchitem"))
    poison_ok = statuses.get(POISON) == "failed"
    lost = sum(
        1
        for source, status in statuses.items()
        if source != POISON and status != "done"
    )
    duplicated = _scalar(
        url,
        "SELECT count(*) FROM (SELECT job_id FROM jobs_lease WHERE end_reason = 'completed' "
        "GROUP BY job_id HAVING count(*) > 1) AS twice",
    )
    reclaims = _scalar(
        url, "SELECT count(*) FROM jobs_lease WHERE end_reason = 'expired'"
    )
    check = _manage(env, "recall_check", check=False)
    mismatched = (
        0
        if check.returncode == 0
        else max(1, len(check.stdout.strip().splitlines()) - 1)
    )
    server_errors, unavailable = _http_errors(work / "access.log")
    crashes = _count(work / "gunicorn.log", "Internal Server Error") + _count(
        work / "gunicorn.log", "Traceback"
    )
    fivexx = server_errors + crashes
    print(
        f"chaos: {len(statuses)} jobs, {tally.kills} kills ({tally.worker_kills} workers, "
        f"{tally.sweep_kills} sweeps, {tally.cluster_kills} cluster), {reclaims} reclaims, "
        f"{tally.db_restarts} db restart, lost {lost}, duplicated {duplicated}, "
        f"mismatched {mismatched}, 5xx {fivexx} (and {unavailable} documented 503s), "
        f"poison {'failed as it should' if poison_ok else 'NOT failed: ' + str(statuses.get(POISON))}",
        flush=True,
    )
    if check.returncode != 0:
        print(check.stdout, flush=True)
    fair = _fair_share(url, shares)
    ok = (
        lost == duplicated == mismatched == fivexx == 0
        and poison_ok
        and remaining == 0
        and fair
    )
    return 0 if ok else 1


# Each batch's share of the claims and of the leases held, while all had work,
# must be within this many points of its weight's share.
SHARE_TOLERANCE = 0.10


def _fair_share(url: str, shares: Shares) -> bool:
    """Print and check how the batches shared the workers while all had work."""
    if not shares.samples or shares.window_end is None:
        print("chaos: fair share NOT measured: no window with work in all batches")
        return False
    claims = dict(
        _query(
            url,
            "SELECT j.batch_id, count(*) FROM jobs_lease l "
            "JOIN jobs_job j ON j.id = l.job_id "
            f"WHERE l.claimed_at < '{shares.window_end.isoformat()}' GROUP BY 1",
        )
    )
    batches = sorted(shares.weights, key=lambda b: shares.weights[b])
    expected = [shares.weights[b] / sum(shares.weights.values()) for b in batches]
    claimed = [claims.get(b, 0) / max(sum(claims.values()), 1) for b in batches]
    held = [shares.held[b] / max(sum(shares.held.values()), 1) for b in batches]

    def pct(values: list[float]) -> str:
        return "/".join(f"{100 * v:.0f}%" for v in values)

    fair = all(
        abs(c - e) <= SHARE_TOLERANCE and abs(h - e) <= SHARE_TOLERANCE
        for c, h, e in zip(claimed, held, expected, strict=True)
    )
    weights = ":".join(str(shares.weights[b]) for b in batches)
    print(
        f"chaos: fair share {'ok' if fair else 'NOT within 10 points'}: weights "
        f"{weights} = {pct(expected)}; claims {pct(claimed)} "
        f"({sum(claims.values())} claims); leases held {pct(held)} "
        f"({shares.samples} samples)",
        flush=True,
    )
    return fair


def _http_errors(access_log: Path) -> tuple[int, int]:
    """(5xx other than 503, 503) in gunicorn's access log."""
    errors = unavailable = 0
    if access_log.exists():
        for match in re.finditer(r'" (5\d\d) ', access_log.read_text(errors="replace")):
            if match.group(1) == "503":
                unavailable += 1
            else:
                errors += 1
    return errors, unavailable


def _count(path: Path, needle: str) -> int:
    return path.read_text(errors="replace").count(needle) if path.exists() else 0


def _up(port: int) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).close()
        return True
    except OSError:
        return False


def _wait_for(check, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration", type=float, default=180, help="seconds of violence (default 180)"
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=240,
        help="longest wait for the batch to finish afterwards",
    )
    parser.add_argument(
        "--workers", type=int, default=12, help="reference workers (default 12)"
    )
    parser.add_argument(
        "--items", type=int, default=3000, help="items in all (default 3000)"
    )
    parser.add_argument(
        "--weights",
        default="1,2,3",
        help="one batch per weight, sized in proportion (default 1,2,3)",
    )
    parser.add_argument(
        "--lease", type=int, default=4, help="lease seconds (default 4)"
    )
    parser.add_argument(
        "--kill-every", type=float, default=3, help="mean seconds between worker kills"
    )
    parser.add_argument(
        "--web-processes", type=int, default=3, help="gunicorn processes (default 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: random)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory and its logs"
    )
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    print(f"chaos: seed {args.seed}", flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
