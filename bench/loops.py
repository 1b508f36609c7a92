"""The loops the benchmark runs in P processes at once, and the runner for them.

Each loop runs in a process of its own (``spawn``: a fresh interpreter with no
inherited connections), prepares (Django set-up, connections; then freezes
its heap, as a web worker does), reports ready,
waits for the common start, then works until the shared deadline or until the
queue is empty, and returns what it counted. Starting together and stopping at
one deadline makes the figures rates over the same wall-clock window.
"""

from __future__ import annotations

import gc
import http.client
import json
import multiprocessing
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

LOOPS: dict[str, Callable[..., dict]] = {}


def loop(function: Callable[..., dict]) -> Callable[..., dict]:
    LOOPS[function.__name__] = function
    return function


def run(
    kind: str,
    args: list[dict],
    *,
    duration: float,
    timeout: float | None = None,
    started: threading.Event | None = None,
) -> list[dict]:
    """Run loop ``kind`` in ``len(args)`` processes for ``duration`` seconds.

    ``started`` (for a caller running this in a thread) is set when they start.
    """
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    start, deadline = context.Event(), context.Value("d", 0.0)
    processes = [
        context.Process(
            target=_child, args=(kind, a, ready, start, deadline, results), daemon=True
        )
        for a in args
    ]
    for p in processes:
        p.start()
    try:
        for _ in processes:
            ready.get(timeout=120)
        deadline.value = time.time() + duration
        start.set()
        if started is not None:
            started.set()
        wait = duration + (timeout if timeout is not None else 120)
        out = [results.get(timeout=wait) for _ in processes]
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError(f"{kind} loop failed: {errors[0]}")
    return out


def _child(kind, args, ready, start, deadline, results) -> None:
    try:
        if kind != "raw":
            import django

            django.setup()
        prepared = LOOPS[kind](args, None)
        # Loaded and connected: out of the collector's reach, as each web
        # worker does once loaded (gunicorn.conf.py, post_worker_init). A
        # full collection of it stalled a claim by up to 450 ms on 2 busy cores.
        gc.freeze()
        ready.put(True)
        start.wait()
        results.put(LOOPS[kind](args, (prepared, deadline.value)))
    except BaseException as error:  # report it: a silent child hangs the run
        ready.put(False)
        results.put({"error": f"{type(error).__name__}: {error}"})


def _latency_report(latencies: list[float], done: int, elapsed: float) -> dict:
    return {"done": done, "elapsed": elapsed, "latencies": latencies}


# --- 1. The raw-SQL limit -------------------------------------------------------

RAW_CLAIM = """
    WITH pick AS (
        SELECT j.id, j.item_id, j.attempts, COALESCE(i.duration_ms, 0) AS ms,
               i.source, i.params, b.name
        FROM jobs_job j
        JOIN batches_batchitem i ON i.id = j.item_id
        JOIN batches_batch b ON b.id = j.batch_id
        WHERE j.batch_id = %(batch)s AND j.status = 'queued'
          AND j.available_at <= now() AND j.attempts < j.max_attempts
        ORDER BY j.created_at, j.id LIMIT 1
        FOR NO KEY UPDATE OF j, i SKIP LOCKED
    ), job AS (
        UPDATE jobs_job SET status = 'leased', lease_token = %(token)s,
            leased_by_id = %(worker)s, lease_expires_at = now() + interval '60 s',
            heartbeat_at = now(), attempts = pick.attempts + 1, updated_at = now()
        FROM pick WHERE jobs_job.id = pick.id
        RETURNING jobs_job.id, jobs_job.attempts
    ), item AS (
        UPDATE batches_batchitem SET status = 'transcribing', updated_at = now()
        FROM pick WHERE batches_batchitem.id = pick.item_id
    ), counter AS (
        UPDATE batches_batchcounter c SET queued = c.queued - 1,
            transcribing = c.transcribing + 1, queued_ms = c.queued_ms - pick.ms,
            transcribing_ms = c.transcribing_ms + pick.ms
        FROM pick WHERE c.batch_id = %(batch)s AND c.shard = mod(pick.item_id, 16)
    ), lease AS (
        INSERT INTO jobs_lease (job_id, worker_id, token, attempt, claimed_at,
                                heartbeat_at, expires_at, error)
        SELECT id, %(worker)s, %(token)s, attempts, now(), now(),
               now() + interval '60 s', ''
        FROM job
    )
    SELECT id, source, params, name FROM pick
"""
RAW_COMPLETE = """
    WITH target AS (
        SELECT j.id, j.item_id, j.batch_id, COALESCE(i.duration_ms, 0) AS ms,
               l.id AS lease_id
        FROM jobs_job j
        JOIN batches_batchitem i ON i.id = j.item_id
        JOIN jobs_lease l ON l.token = j.lease_token AND l.ended_at IS NULL
        WHERE j.id = %(job)s AND j.status = 'leased' AND j.lease_token = %(token)s
          AND j.leased_by_id = %(worker)s
        FOR NO KEY UPDATE OF j, i
    ), job AS (
        UPDATE jobs_job SET status = 'completed', result = %(result)s,
            lease_token = NULL, leased_by_id = NULL, lease_expires_at = NULL,
            finished_at = now(), updated_at = now()
        FROM target WHERE jobs_job.id = target.id
    ), lease AS (
        UPDATE jobs_lease SET ended_at = now(), end_reason = 'completed'
        FROM target WHERE jobs_lease.id = target.lease_id
    ), item AS (
        UPDATE batches_batchitem SET status = 'done', updated_at = now()
        FROM target WHERE batches_batchitem.id = target.item_id
    ), counter AS (
        UPDATE batches_batchcounter c SET transcribing = c.transcribing - 1,
            done = c.done + 1, transcribing_ms = c.transcribing_ms - target.ms,
            done_ms = c.done_ms + target.ms
        FROM target
        WHERE c.batch_id = target.batch_id AND c.shard = mod(target.item_id, 16)
        RETURNING c.batch_id, c.shard, target.ms
    )
    INSERT INTO batches_batchminute
        (batch_id, minute, shard, done, done_ms, failed, failed_ms)
    SELECT batch_id, date_trunc('minute', now()), shard, 1, ms, 0, 0 FROM counter
    ON CONFLICT (batch_id, minute, shard) DO UPDATE SET
        done = batches_batchminute.done + 1,
        done_ms = batches_batchminute.done_ms + excluded.done_ms
"""


def raw_step(connection, *, batch: int, worker: int) -> Callable[[], bool]:
    """Row 1's claim and its completion, the two statements each in its own
    transaction (``connection`` in autocommit): one step, False when the queue
    ran dry. Row 1's loop and ``python -m bench.hotpath raw`` both take it."""
    from psycopg.types.json import Jsonb

    result = Jsonb({"text": "ok"})

    def step() -> bool:
        p = {"batch": batch, "worker": worker, "token": secrets.token_urlsafe(24)}
        row = connection.execute(RAW_CLAIM, p, prepare=True).fetchone()
        if row is None:
            return False
        p.update(job=row[0], result=result)
        connection.execute(RAW_COMPLETE, p, prepare=True)
        return True

    return step


@loop
def raw(args: dict, started) -> dict:
    """Recall's per-job writes as hand-written SQL over psycopg: no Django, no HTTP.

    The same rows as a claim and a complete (job, item, counter shard, ledger
    row; and the throughput minute on completion), each transition one
    statement in autocommit (so its own transaction), prepared: the leanest
    way to make those writes atomically.
    """
    import psycopg

    if started is None:
        return {}
    connection = psycopg.connect(args["dsn"], autocommit=True)
    _, deadline = started
    done, began = 0, time.perf_counter()
    step = raw_step(connection, batch=args["batch"], worker=args["worker"])
    with connection:
        while time.time() < deadline and step():
            done += 1
    return {"done": done, "elapsed": time.perf_counter() - began}


# --- 2. The model layer -----------------------------------------------------------


@loop
def model(args: dict, started) -> dict:
    """``transitions.claim_next`` then ``transitions.complete``, as the API calls
    them (with the database's clock, read inside each statement).

    With ``latency``: also the time of every claim (and with ``stamps``, when
    each began, wall clock). With ``bucket``: completions per ``bucket``
    seconds (sustained load). With ``stop_file``: stop once that file exists.
    With ``results``: complete with each of them in turn (transcripts, row 22)
    instead of ``{"text": "ok"}``.
    """
    from jobs import transitions
    from jobs.models import Job, Worker

    worker = Worker.objects.get(pk=args["worker"])
    if started is None:
        Job.objects.filter(pk=0).exists()  # open the connection before the start
        return {}
    _, deadline = started
    latencies, buckets, stamps = [], [], []
    done, began, cpu = 0, time.perf_counter(), time.process_time()
    bucket, stop_file = args.get("bucket"), args.get("stop_file")
    while time.time() < deadline:
        if stop_file and os.path.exists(stop_file):
            break
        t0 = time.perf_counter()
        if args.get("stamps"):
            stamps.append(time.time())
        job = transitions.claim_next(worker)
        if args.get("latency"):
            latencies.append(time.perf_counter() - t0)

        if job is None:
            break
        results = args.get("results") or [{"text": "ok"}]
        result = results[done % len(results)]
        transitions.complete(job, job.lease_token, worker=worker, result=result)
        done += 1
        if bucket:
            index = int((time.perf_counter() - began) // bucket)
            buckets.extend([0] * (index + 1 - len(buckets)))
            buckets[index] += 1
    report = _latency_report(latencies, done, time.perf_counter() - began)
    report["buckets"] = buckets
    report["cpu"] = time.process_time() - cpu
    report["stamps"] = stamps
    return report


# --- 3. The HTTP API ---------------------------------------------------------------


class _Worker:
    """One worker's keep-alive connection to the running server."""

    def __init__(self, host: str, port: int, token: str):
        self.host, self.port = host, port
        self.headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        }
        self.connection = http.client.HTTPConnection(host, port, timeout=60)

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        """(status, body) of a POST, reconnecting up to twice if the server
        closed the connection."""
        for _ in range(3):
            try:
                self.connection.request("POST", path, json.dumps(body), self.headers)
                response = self.connection.getresponse()
                data = response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.connection.close()
                return response.status, data
            except (http.client.HTTPException, ConnectionError):
                self.connection.close()
                self.connection = http.client.HTTPConnection(
                    self.host, self.port, timeout=60
                )
        raise RuntimeError(f"POST {path} failed three times")

    def close(self) -> None:
        self.connection.close()


@loop
def http_api(args: dict, started) -> dict:
    """claim + complete against the running server, as a worker does."""
    if started is None:
        return {}
    _, deadline = started
    client = _Worker(args["host"], args["port"], args["token"])
    post = client.post
    done, errors, began = 0, 0, time.perf_counter()
    while time.time() < deadline:
        status, data = post("/api/v1/claim", {})
        if status == 204:
            break
        if status != 200:
            errors += 1
            continue
        job = json.loads(data)["job"]
        status, _ = post(
            f"/api/v1/jobs/{job['id']}/complete",
            {"lease_token": job["lease_token"], "result": {"text": "ok"}},
        )
        if status == 200:
            done += 1
        else:
            errors += 1
    client.close()
    return {"done": done, "errors": errors, "elapsed": time.perf_counter() - began}


@loop
def http_api_jobs(args: dict, started) -> dict:
    """claim up to ``max_jobs`` jobs in one call, then complete them all in one
    batched completion (``POST /api/v1/complete``), against the running server:
    a worker with that many free slots whose jobs end together (issue 26)."""
    if started is None:
        return {}
    _, deadline = started
    client = _Worker(args["host"], args["port"], args["token"])
    claim = {"max_jobs": args["max_jobs"]}
    ok = {"text": "ok"}
    done, errors, claims, began = 0, 0, 0, time.perf_counter()
    while time.time() < deadline:
        status, data = client.post("/api/v1/claim", claim)
        claims += 1
        if status == 204:
            break
        if status != 200:
            errors += 1
            continue
        results = [
            {"job_id": job["id"], "lease_token": job["lease_token"], "result": ok}
            for job in json.loads(data)["jobs"]
        ]
        status, data = client.post("/api/v1/complete", {"results": results})
        if status != 200:
            errors += len(results)
            continue
        answers = json.loads(data)["results"]
        completed = sum(answer.get("status") == "completed" for answer in answers)
        done += completed
        errors += len(results) - completed
    client.close()
    return {
        "done": done,
        "errors": errors,
        "claims": claims,
        "elapsed": time.perf_counter() - began,
    }


# --- 5. Idle claims -----------------------------------------------------------------


@loop
def idle_claim(args: dict, started) -> dict:
    """Claims on an empty queue through Django's full request handling (in this
    process, so the time is the server's: no network, no client)."""
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {args['token']}"}
    if started is None:
        client.post("/api/v1/claim", content_type="application/json", **headers)
        return {}
    _, deadline = started
    latencies, statuses = [], {}
    began, cpu = time.perf_counter(), time.process_time()
    while time.time() < deadline and len(latencies) < args.get("limit", 10**9):
        t0 = time.perf_counter()
        response = client.post(
            "/api/v1/claim", content_type="application/json", **headers
        )
        latencies.append(time.perf_counter() - t0)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    report = _latency_report(latencies, len(latencies), time.perf_counter() - began)
    report["statuses"] = statuses
    report["cpu"] = time.process_time() - cpu
    return report


@loop
def routed_claims(args: dict, started) -> dict:
    """Claims with labels through Django's full request handling (in this
    process: the time is the server's), each job that one gets completed at
    once. ``args["workers"]`` is (token, labels) pairs, taken in turn: each
    claim is the next worker's, with its labels. Reports every claim's time
    by its answer's status and the CPU time this process spent on them (the
    app's share of the server time: on a shared machine the wall time also
    holds the waits for a core), each worker's answers by status (by token:
    the runner returns the processes' reports in the order they end), and the
    jobs completed."""
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")
    workers = [
        ({"HTTP_AUTHORIZATION": f"Bearer {token}"}, {"labels": labels})
        for token, labels in args["workers"]
    ]
    if started is None:  # connect and warm up, without claiming
        from jobs.models import Worker

        Worker.objects.filter(pk=0).exists()
        client.get("/healthz")
        return {}
    _, deadline = started
    latencies: dict[int, list[float]] = {}
    cpu: dict[int, float] = {}
    answers: list[dict[int, int]] = [{} for _ in workers]  # by turn
    done, claims, began = 0, 0, time.perf_counter()
    while time.time() < deadline:
        turn = claims % len(workers)
        headers, body = workers[turn]
        claims += 1
        t0, c0 = time.perf_counter(), time.process_time()
        response = client.post("/api/v1/claim", body, "application/json", **headers)
        status = response.status_code
        latencies.setdefault(status, []).append(time.perf_counter() - t0)
        cpu[status] = cpu.get(status, 0.0) + time.process_time() - c0
        answers[turn][status] = answers[turn].get(status, 0) + 1
        if status != 200:
            continue
        job = response.json()["job"]
        response = client.post(
            f"/api/v1/jobs/{job['id']}/complete",
            {"lease_token": job["lease_token"], "result": {"text": "ok"}},
            "application/json",
            **headers,
        )
        if response.status_code != 200:
            raise RuntimeError(f"complete answered {response.status_code}")
        done += 1
    return {
        "done": done,
        "elapsed": time.perf_counter() - began,
        "by_status": latencies,
        "cpu_by_status": cpu,
        "answers": {
            token: answered
            for (token, _), answered in zip(args["workers"], answers, strict=True)
        },
    }


@loop
def heartbeats(args: dict, started) -> dict:
    """``transitions.heartbeat`` round the leases ``args["leases"]`` (job id,
    token) of worker ``args["worker"]``, as fast as it goes: a heartbeat's
    cost at the model layer, with every latency."""
    from jobs import transitions
    from jobs.models import Worker

    worker = Worker.objects.get(pk=args["worker"])
    leases = args["leases"]
    if started is None:
        transitions.heartbeat(*leases[0], worker=worker)  # connect, prepare
        return {}
    _, deadline = started
    latencies: list[float] = []
    began, cpu = time.perf_counter(), time.process_time()
    while time.time() < deadline:
        job, token = leases[len(latencies) % len(leases)]
        t0 = time.perf_counter()
        transitions.heartbeat(job, token, worker=worker)
        latencies.append(time.perf_counter() - t0)
    report = _latency_report(latencies, len(latencies), time.perf_counter() - began)
    report["cpu"] = time.process_time() - cpu  # this process's, while it ran
    return report


def utcnow() -> datetime:
    return datetime.now(UTC)


# --- 11. Exports while workers heartbeat ---------------------------------------------


@loop
def heartbeaters(args: dict, started) -> dict:
    """``len(tokens)`` workers, one thread each: claim a job over HTTP, then
    heartbeat it every ``interval`` seconds until the deadline or ``done``.

    Reports every heartbeat's latency (a timeout counts as its full time), the
    statuses, and per worker the longest time between two accepted heartbeats
    (past the lease length, the lease could have expired)."""
    if started is None:
        return {}
    _, deadline = started
    done, interval, timeout = args["done"], args["interval"], args["timeout"]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    gaps: list[float] = []
    lock = threading.Lock()

    def worker(token: str) -> None:
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        }

        def post(path: str, body: dict) -> tuple[int | str, bytes, float]:
            connection = http.client.HTTPConnection(
                args["host"], args["port"], timeout=timeout
            )
            t0 = time.perf_counter()
            try:
                connection.request("POST", path, json.dumps(body), headers)
                response = connection.getresponse()
                return response.status, response.read(), time.perf_counter() - t0
            except (OSError, http.client.HTTPException) as error:
                return type(error).__name__, b"", time.perf_counter() - t0
            finally:
                connection.close()

        status, data, _ = post("/api/v1/claim", {})
        if status != 200:
            with lock:
                statuses[f"claim {status}"] = statuses.get(f"claim {status}", 0) + 1
            return
        job = json.loads(data)["job"]
        last_ok, longest = time.monotonic(), 0.0
        while time.time() < deadline and not done.is_set():
            status, _, took = post(
                f"/api/v1/jobs/{job['id']}/heartbeat",
                {"lease_token": job["lease_token"]},
            )
            now = time.monotonic()
            if status == 200:
                longest, last_ok = max(longest, now - last_ok), now
            with lock:
                latencies.append(took)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            done.wait(max(0.0, interval - took))
        with lock:
            gaps.append(max(longest, time.monotonic() - last_ok))

    threads = [threading.Thread(target=worker, args=(t,)) for t in args["tokens"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"latencies": latencies, "statuses": statuses, "gaps": gaps}


@loop
def export_clients(args: dict, started) -> dict:
    """``exports`` operators downloading the same CSV export at once, each to
    the end; then ``done`` is set. Reports each one's time, size and status."""
    if started is None:
        return {}
    results: list[dict] = []
    lock = threading.Lock()

    def download() -> None:
        connection = http.client.HTTPConnection(args["host"], args["port"], timeout=600)
        t0 = time.perf_counter()
        size, status = 0, "?"
        try:
            connection.request(
                "GET",
                f"/batches/{args['batch']}/export.csv",
                headers={"Cookie": f"sessionid={args['session']}"},
            )
            response = connection.getresponse()
            status = response.status
            while chunk := response.read(1 << 16):
                size += len(chunk)
        except (OSError, http.client.HTTPException) as error:
            status = type(error).__name__
        finally:
            connection.close()
        with lock:
            results.append(
                {"status": status, "bytes": size, "seconds": time.perf_counter() - t0}
            )

    threads = [threading.Thread(target=download) for _ in range(args["exports"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    args["done"].set()
    return {"exports": results}
