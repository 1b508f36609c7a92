"""``make chaos``: Recall under fire, then a check that nothing lies.

Starts a private PostgreSQL server, gunicorn with several processes, the
django-q2 cluster and many reference workers with short leases, on three
batches of different weights (sizes in proportion) with one planted poison item
(its engine kills the worker running it), and four small batches beside them.
While it runs, it SIGKILLs random workers (and restarts them), SIGKILLs sweeps
mid-pass and the django-q2 cluster, and crashes PostgreSQL once. With
``--nodes N`` (N > 1) the web tier is N gunicorn masters on separate ports (one
with its clock shifted by libfaketime), two django-q2 clusters run, the workers
are spread across the nodes, and whole nodes are SIGKILLed and restarted on top
of the rest. Then it stops
the violence, lets leases expire and sweeps run, and checks:

* ``recall_check`` passes (every invariant holds);
* every item is done, except the poison one, which failed;
* no job has more than one accepted completion;
* no 5xx other than the documented 503 (database unavailable) was served;
* while all three batches had work, claims and the time leases were held by
  working workers were shared within 10 points of their weights' shares (fair
  share);
* webhooks: a receiver (which fails some requests and stalls others past the
  timeout) verified every signature and acknowledged every event; each batch
  (the weighted ones, the small ones, one cancelled mid-run) has exactly one
  batch.finished event, and the poison item its item.failed.

It prints one summary line, e.g. ``chaos: 3000 jobs, 41 kills, 37 reclaims,
1 db restart, lost 0, duplicated 0, mismatched 0, 5xx 0 ...; webhooks: 7
batches, 7 batch.finished (duplicated 0, missing 0), ...``, and exits 0 only
if all is well. ``python -m tests.system.chaos --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import os
import random
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg

from harness.pgserver import PrivatePostgres
from harness.server import PY, ROOT, Process, Server, free_port, wait_until

POISON = "chaos://poison/corrupt.wav"
# The small batches beside the weighted ones; the last is cancelled mid-run.
SMALL_BATCHES = 4
SMALL_ITEMS = 15
CANCELLED = f"chaos-small-{SMALL_BATCHES - 1}"
# The weighted batches share the fleet at priority 0 (named chaos-w<weight>);
# the small ones run before them (priority 1) or after (the cancelled one).
WEIGHTED = "chaos-w"


@dataclass
class Shares:
    """The window in which every weighted batch still had queued work, found
    by sampling until one runs dry; the shares within it are read from the
    lease ledger afterwards (``_fair_share``)."""

    weights: dict[int, int] = field(default_factory=dict)
    samples: int = 0
    window_end: object = None  # the database's time when a batch ran dry

    def sample(self, url: str) -> None:
        if self.window_end is not None:
            return
        rows = _query(
            url,
            "SELECT b.id, b.weight, now(), "
            "count(*) FILTER (WHERE j.status = 'queued') "
            "FROM batches_batch b JOIN jobs_job j ON j.batch_id = b.id "
            f"WHERE b.name LIKE '{WEIGHTED}%' GROUP BY b.id",
        )
        if any(queued == 0 for *_, queued in rows):
            self.window_end = rows[0][2]
            return
        self.samples += 1
        for batch_id, weight, _, _ in rows:
            self.weights[batch_id] = weight


@dataclass
class Tally:
    worker_kills: int = 0
    sweep_kills: int = 0
    cluster_kills: int = 0
    node_kills: int = 0
    db_restarts: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return (
            self.worker_kills + self.sweep_kills + self.cluster_kills + self.node_kills
        )


class Receiver:
    """The webhook receiver: verifies every signature, remembers what it
    acknowledged, and misbehaves on purpose (500s, and answers later than the
    delivery timeout) so that deliveries are retried."""

    def __init__(
        self, rng: random.Random, *, fail: float, stall: float, stall_for: float
    ):
        self.secret = ""
        self.lock = threading.Lock()
        self.requests = 0
        self.bad_signatures = 0
        self.acknowledged: dict[str, str] = {}  # webhook-id -> event type
        chaos = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with chaos.lock:
                    chaos.requests += 1
                    good = chaos.verify(self.headers, body)
                    chaos.bad_signatures += not good
                    roll = rng.random()
                if roll < stall:
                    time.sleep(stall_for)  # the delivery gives up waiting first
                status = 500 if roll < stall + fail or not good else 200
                if status == 200:
                    with chaos.lock:
                        kind = json.loads(body)["type"]
                        chaos.acknowledged[self.headers["webhook-id"]] = kind
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/recall-events"

    def verify(self, headers, body: bytes) -> bool:
        """Standard Webhooks, from the specification."""
        try:
            key = base64.b64decode(self.secret.removeprefix("whsec_"))
            signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode()
            expected = base64.b64encode(
                hmac.new(key, signed + body, hashlib.sha256).digest()
            ).decode()
            return f"v1,{expected}" in headers["webhook-signature"].split(" ")
        except (KeyError, ValueError, TypeError):
            return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
    bouncer = None
    stop_sweeps = threading.Event()
    receiver = Receiver(
        random.Random(args.seed + 1),
        fail=args.webhook_fail_rate,
        stall=0.05,
        stall_for=args.webhook_timeout + 1,
    )
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
            # The kills cut off about one claim in thirty, each at random: with
            # three attempts, a job cut off on all three failed (honestly, its
            # ledger said why) about once in a hundred short runs. With four,
            # the run checks what it means to, and the poison still fails.
            "RECALL_MAX_ATTEMPTS": "4",
            "DATABASE_CONNECT_TIMEOUT": "2",
            "CONN_MAX_AGE": "60",
            "LOG_LEVEL": "WARNING",
            # The chaos engine's own sources: chaos://item/N.wav.
            "RECALL_SOURCE_SCHEMES": "chaos",
            "RECALL_WEBHOOK_ALLOW_PRIVATE": "on",  # the receiver is on loopback
            "RECALL_WEBHOOK_RETRY_SECONDS": "1,1,2,2,3,3,5,5,5,5",
            "RECALL_WEBHOOK_TIMEOUT_SECONDS": str(args.webhook_timeout),
        }
        if args.pgbouncer:  # every Recall process through it; checks direct
            from tests.support.stack import PgBouncer

            bouncer = PgBouncer("127.0.0.1", pg.port, args.pgbouncer)
            env["DATABASE_URL"] = bouncer.url("recall")
            env["DATABASE_DISABLE_SERVER_SIDE_CURSORS"] = "on"
            env["RECALL_PREPARED_STATEMENTS"] = "off"
            print(
                f"chaos: through PgBouncer (transaction pooling, pool "
                f"{args.pgbouncer}) on port {bouncer.port}",
                flush=True,
            )
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
                env, "create_batch", f"{WEIGHTED}{weight}", str(manifest),
                "--weight", str(weight),
            )  # fmt: skip
            start = end
        shares = Shares()
        for b in range(SMALL_BATCHES):
            small = work / f"small-{b}.txt"
            small.write_text(
                "".join(f"chaos://small/{b}/{i:03d}.wav\n" for i in range(SMALL_ITEMS))
            )
            # The one to be cancelled waits behind the big batch (queued when
            # the operator cancels it); the others run first.
            name = f"chaos-small-{b}"
            priority = "-1" if name == CANCELLED else "1"
            _manage(env, "create_batch", name, str(small), "--priority", priority)
        receiver.secret = (
            _manage(
                env,
                "create_webhook",
                receiver.url,
                "--events",
                "batch.finished,item.failed",
            )
            .stdout.strip()
            .splitlines()[-1]
        )

        nodes = []
        for n in range(args.nodes):
            node_port = port if n == 0 else free_port()
            suffix = "" if n == 0 else f"-{n + 1}"
            web_env = {
                **env,
                "WEB_CONCURRENCY": str(args.web_processes),
                "RECALL_STARTUP_SWEEP": "quick",
                "RECALL_ACCESS_LOG": str(work / f"access{suffix}.log"),
            }
            node = Server(
                web_env,
                work / f"gunicorn{suffix}.log",
                port=node_port,
                name=f"gunicorn{suffix}",
                # The second node's clock is off: only the database's counts.
                clock=args.node_skew if n == 1 else None,
            )
            nodes.append(node)
            processes.append(node)
        for node in nodes:
            wait_until(node.up, 60, "gunicorn did not start")
        clusters = [
            Process(
                f"qcluster{'' if c == 0 else f'-{c + 1}'}",
                [PY, "manage.py", "qcluster"],
                env,
                work / f"qcluster{'' if c == 0 else f'-{c + 1}'}.log",
            )
            for c in range(1 if args.nodes == 1 else 2)
        ]
        cluster = clusters[0]
        processes.extend(clusters)
        if args.nodes > 1:
            print(
                f"chaos: {args.nodes} web nodes on ports "
                f"{', '.join(str(n.port) for n in nodes)} (node 2's clock "
                f"{args.node_skew}), {len(clusters)} django-q2 clusters",
                flush=True,
            )

        worker_env = {"PATH": os.environ["PATH"]}
        engine = f"{PY} tests/system/chaos_engine.py {{source}}"
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
                {
                    **worker_env,
                    "RECALL_TOKEN": token,
                    # Spread across the nodes.
                    "RECALL_URL": f"http://127.0.0.1:{nodes[i % len(nodes)].port}",
                },
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
        next_node_kill = started + rng.uniform(0.5, 1.5) * args.node_kill_every
        cluster_killed = db_restarted = cancelled = False
        while (elapsed := time.monotonic() - started) < args.duration:
            if len(nodes) > 1 and time.monotonic() >= next_node_kill:
                node = rng.choice(nodes)  # a whole web node dies: master and all
                node.kill()
                tally.node_kills += 1
                time.sleep(rng.uniform(0.5, 2.0))
                node.start()
                next_node_kill = (
                    time.monotonic() + rng.uniform(0.5, 1.5) * args.node_kill_every
                )
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
            if not cancelled and elapsed > args.duration / 4:
                _cancel(env, CANCELLED)  # while its items are in flight or queued
                cancelled = True
            if not db_restarted and elapsed > args.duration / 2:
                pg.restart("immediate")  # a crash: recovery from the WAL
                tally.db_restarts += 1
                db_restarted = True
            for worker in workers:  # the poison item kills its worker: restart it
                if not worker.alive():
                    worker.start()
            for node in nodes:  # a node whose master died on its own comes back
                if not node.alive():
                    node.start()
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
            # On a slow machine the weighted batches may still all have work
            # when the violence ends: their shares are measured until one runs
            # dry, however long that takes.
            with contextlib.suppress(psycopg.Error):
                shares.sample(url)
            remaining = _scalar(
                url,
                "SELECT count(*) FROM batches_batchitem WHERE status IN ('queued', 'transcribing')",
            )
            if remaining == 0:
                break
            time.sleep(1)
        with contextlib.suppress(psycopg.Error):  # the window ends here at the latest
            shares.sample(url)
        stop_sweeps.set()
        sweeper.join(timeout=60)
        _manage(env, "recall_sweep")  # what a scheduled sweep would do next
        _wait_for_webhooks(url, receiver, args.drain)  # the cluster delivers
        for process in reversed(processes):
            process.stop()
        _manage(env, "recall_sweep")  # what a scheduled sweep would do next
        return _verdict(args, env, url, work, tally, remaining, shares, receiver)
    finally:
        receiver.close()
        stop_sweeps.set()
        for process in processes:
            process.kill()
        if bouncer is not None:
            bouncer.stop()
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


def _cancel(env, name: str) -> None:
    """An operator cancels a batch (the transition the UI's button calls)."""
    _manage(
        env,
        "shell",
        "-c",
        "from batches.models import Batch; from jobs import transitions; "
        f"transitions.cancel_batch(Batch.objects.get(name={name!r}))",
    )


def _event_ids(url: str) -> dict[str, str]:
    return dict(_query(url, "SELECT webhook_id, type FROM jobs_webhookevent"))


def _wait_for_webhooks(url: str, receiver: Receiver, timeout: float) -> None:
    """Until the receiver has acknowledged every event (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with receiver.lock:
            acknowledged = set(receiver.acknowledged)
        if set(_event_ids(url)) <= acknowledged:
            return
        time.sleep(1)


def _webhook_figures(url: str, receiver: Receiver) -> tuple[str, bool]:
    batches = _scalar(url, "SELECT count(*) FROM batches_batch")
    per_batch = _query(
        url,
        "SELECT b.id, b.finishes, count(e.id) FROM batches_batch b "
        "LEFT JOIN jobs_webhookevent e ON e.batch_id = b.id "
        "AND e.type = 'batch.finished' GROUP BY b.id, b.finishes",
    )
    duplicated = sum(1 for _, _, n in per_batch if n > 1)
    missing = sum(1 for _, _, n in per_batch if n == 0)
    events = _event_ids(url)
    finished = sum(1 for kind in events.values() if kind == "batch.finished")
    cancelled = _scalar(
        url,
        "SELECT count(*) FROM jobs_webhookevent WHERE type = 'batch.finished' "
        """AND body LIKE '%"state":"cancelled"%'""",
    )
    failed = sum(1 for kind in events.values() if kind == "item.failed")
    with receiver.lock:
        acknowledged = set(receiver.acknowledged) & set(events)
        requests, bad = receiver.requests, receiver.bad_signatures
    undelivered = len(events) - len(acknowledged)
    text = (
        f"webhooks: {batches} batches, {finished} batch.finished "
        f"(duplicated {duplicated}, missing {missing}, {cancelled} cancelled), "
        f"{failed} item.failed, "
        f"{len(acknowledged)}/{len(events)} delivered, undelivered {undelivered}, "
        f"bad signatures {bad}, {requests} requests "
        f"({requests - len(acknowledged)} failed on purpose or retried)"
    )
    ok = duplicated == missing == undelivered == bad == 0 and failed >= 1
    ok = ok and cancelled == 1
    return text, ok and finished == batches


def _verdict(
    args,
    env,
    url: str,
    work: Path,
    tally: Tally,
    remaining: int | None,
    shares: Shares,
    receiver: Receiver,
) -> int:
    statuses = dict(_query(url, "SELECT source, status FROM batches_batchitem"))
    poison_ok = statuses.get(POISON) == "failed"
    cancelled_sources = {
        source
        for (source,) in _query(
            url,
            "SELECT i.source FROM batches_batchitem i JOIN batches_batch b "
            f"ON b.id = i.batch_id WHERE b.name = '{CANCELLED}'",
        )
    }
    lost = sum(
        1
        for source, status in statuses.items()
        if source != POISON
        and status != "done"
        and not (source in cancelled_sources and status == "cancelled")
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
    server_errors = unavailable = crashes = 0
    evidence: list[str] = []  # printed when there is any: what to look at
    for access_log in sorted(work.glob("access*.log")):
        errors, documented, lines = _http_errors(access_log)
        server_errors, unavailable = server_errors + errors, unavailable + documented
        evidence += [f"{access_log.name}: {line}" for line in lines]
    for log in sorted(work.glob("gunicorn*.log")):
        reports = _crash_reports(log)
        crashes += len(reports)
        evidence += reports
    fivexx = server_errors + crashes
    webhooks, webhooks_ok = _webhook_figures(url, receiver)
    print(
        f"chaos: {len(statuses)} jobs, {tally.kills} kills ({tally.worker_kills} workers, "
        f"{tally.sweep_kills} sweeps, {tally.cluster_kills} cluster"
        f"{f', {tally.node_kills} nodes' if args.nodes > 1 else ''}), {reclaims} reclaims, "
        f"{tally.db_restarts} db restart, lost {lost}, duplicated {duplicated}, "
        f"mismatched {mismatched}, 5xx {fivexx} (and {unavailable} documented 503s), "
        f"poison {'failed as it should' if poison_ok else 'NOT failed: ' + str(statuses.get(POISON))}; "
        f"{webhooks}",
        flush=True,
    )
    if check.returncode != 0:
        print(check.stdout, flush=True)
    if lost:
        print("chaos: the lost items and their leases:", flush=True)
        for source, status in statuses.items():
            if source == POISON or status == "done":
                continue
            if source in cancelled_sources and status == "cancelled":
                continue
            print(f"  {source}: {status}", flush=True)
            for row in _query(
                url,
                "SELECT l.attempt, w.name, l.claimed_at, l.ended_at, l.end_reason, "
                "left(l.error, 200) FROM jobs_lease l "
                "JOIN jobs_job j ON j.id = l.job_id "
                "JOIN batches_batchitem i ON i.id = j.item_id "
                "JOIN jobs_worker w ON w.id = l.worker_id "
                f"WHERE i.source = '{source}' ORDER BY l.attempt",
            ):
                print("    lease", *row, flush=True)
    if fivexx:  # the first few, short enough to show in a failed test's output
        print("chaos: the 5xx and crashes:", *evidence[:6], sep="\n", flush=True)
    fair = _fair_share(url, shares)
    ok = (
        lost == duplicated == mismatched == fivexx == 0
        and poison_ok
        and remaining == 0
        and fair
        and webhooks_ok
    )
    return 0 if ok else 1


# Each batch's share of the claims and of the leases held, while all had work,
# must be within this many points of its weight's share.
SHARE_TOLERANCE = 0.10


def _fair_share(url: str, shares: Shares) -> bool:
    """Print and check how the batches shared the workers while all had work.

    The leases held are the seconds each batch's leases were held up to the
    window's end, summed from the ledger, of the leases that did not end by
    expiring (or by a forced reclaim). An expired lease is one whose worker was
    killed: no worker held it, it only waited out its lease (seconds, against
    the tenths of a second of a job here) for the reclaim. Those seconds fall
    wherever the kills land, and the poison item adds one such lease per
    attempt to its batch alone; counted, they moved a batch's share by up to 10
    points from one run to the next. They are printed beside the shares. What
    still moves the held shares by a few points is a working lease caught by
    the database's restart or its node's kill: held a few seconds instead of
    tenths, it is counted, since its worker was holding it.
    """
    if not shares.samples or shares.window_end is None:
        print("chaos: fair share NOT measured: no window with work in all batches")
        return False
    end = f"'{shares.window_end.isoformat()}'::timestamptz"
    ledger = _query(
        url,
        "SELECT j.batch_id, l.end_reason IN ('expired', 'forced'), count(*), "
        f"sum(extract(epoch FROM least(coalesce(l.ended_at, {end}), {end}) "
        "- l.claimed_at)) "
        "FROM jobs_lease l JOIN jobs_job j ON j.id = l.job_id "
        "JOIN batches_batch b ON b.id = j.batch_id "
        f"WHERE l.claimed_at < {end} AND b.name LIKE '{WEIGHTED}%' "
        "GROUP BY 1, 2",
    )
    claims: dict[int, int] = {}
    seconds: dict[int, float] = {}
    waited = 0.0  # the seconds of leases whose worker had been killed
    for batch_id, expired, count, held_for in ledger:
        claims[batch_id] = claims.get(batch_id, 0) + count
        if expired:
            waited += float(held_for)
        else:
            seconds[batch_id] = seconds.get(batch_id, 0.0) + float(held_for)
    batches = sorted(shares.weights, key=lambda b: shares.weights[b])
    expected = [shares.weights[b] / sum(shares.weights.values()) for b in batches]
    claimed = [claims.get(b, 0) / max(sum(claims.values()), 1) for b in batches]
    held = [seconds.get(b, 0.0) / (sum(seconds.values()) or 1.0) for b in batches]

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
        f"({sum(seconds.values()):.1f} lease-seconds; {waited:.1f} more waited out "
        "by killed workers' leases)",
        flush=True,
    )
    return fair


def _http_errors(access_log: Path) -> tuple[int, int, list[str]]:
    """(5xx other than 503, 503, the lines of the former) in gunicorn's access log."""
    errors, unavailable, lines = 0, 0, []
    if access_log.exists():
        for line in access_log.read_text(errors="replace").splitlines():
            match = re.search(r'" (5\d\d) ', line)
            if match is None:
                continue
            if match.group(1) == "503":
                unavailable += 1
            else:
                errors += 1
                lines.append(line)
    return errors, unavailable, lines


def _crash_reports(log: Path) -> list[str]:
    """Each "Internal Server Error" or traceback in a server log, with the 20
    lines after it."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [
        f"{log.name}: " + "\n".join(lines[at : at + 20])
        for at, line in enumerate(lines)
        if "Internal Server Error" in line or "Traceback" in line
    ]


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
        "--web-processes",
        type=int,
        default=3,
        help="gunicorn processes per node (default 3)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="web nodes: gunicorn masters on separate ports; more than 1 also "
        "skews node 2's clock, runs two django-q2 clusters and kills nodes "
        "(default 1)",
    )
    parser.add_argument(
        "--node-kill-every",
        type=float,
        default=15,
        help="mean seconds between web node kills, with --nodes > 1 (default 15)",
    )
    parser.add_argument(
        "--node-skew",
        default="+90s",
        help="node 2's clock offset, libfaketime's FAKETIME (default +90s)",
    )
    parser.add_argument(
        "--webhook-fail-rate",
        type=float,
        default=0.2,
        help="share of webhook requests the receiver answers with 500 (default 0.2)",
    )
    parser.add_argument(
        "--webhook-timeout",
        type=int,
        default=3,
        help="RECALL_WEBHOOK_TIMEOUT_SECONDS for the run (default 3)",
    )
    parser.add_argument(
        "--pgbouncer",
        type=int,
        default=0,
        metavar="POOL",
        help="run every Recall process through PgBouncer (deploy/pgbouncer/, "
        "transaction pooling) with this many server connections (default: off)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: random)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory and its logs"
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    print(f"chaos: seed {args.seed}", flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
