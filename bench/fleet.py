"""A fleet of idle workers polling the real server, in one process.

Each simulated worker behaves like the reference worker (worker/recall_worker.py)
between jobs: it claims; on 204 it pauses ``backoff_delay(pauses, poll_min,
poll_max)`` (the reference worker's own function, so the same jitter) and claims
again; on a job it completes it, then claims again at once and backs off from
``poll_min``, as the reference worker's loop does. Every call is a new HTTP
connection, as urllib makes them. The fleet starts in its steady state: idle
for long, so every worker pauses up to ``poll_max``, their phases spread over
one such pause.

It runs in a process of its own (asyncio, no threads), so its CPU is not the
server's; it reports each claimed job to the benchmark, which times how long a
new batch waited for its first claim.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path

WORKER_SCRIPT = Path(__file__).resolve().parent.parent / "worker" / "recall_worker.py"
# Empty polls before the run: far enough into the backoff to pause up to poll_max.
IDLE_FOR_LONG = 60


def _backoff_delay():
    spec = importlib.util.spec_from_file_location("recall_worker", WORKER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["recall_worker"] = module  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module.backoff_delay


class FleetProcess:
    """A simulated fleet in a process of its own, as the benchmark drives it:
    start, count its claims sent and its errors, hear of the jobs it claims,
    stop. ``target(*args, polls=, errors=, claims=, stop=, **shared)`` runs the
    fleet in the new process."""

    def __init__(self, target, *args, **shared):
        context = multiprocessing.get_context("spawn")
        self.polls = context.Value("q", 0)
        self.errors = context.Value("q", 0)
        self.claims = context.Queue()
        self.stop_event = context.Event()
        self.process = context.Process(
            target=target,
            args=args,
            kwargs={
                "polls": self.polls,
                "errors": self.errors,
                "claims": self.claims,
                "stop": self.stop_event,
                **shared,
            },
            daemon=True,
        )

    def start(self) -> None:
        self.process.start()

    def next_claim(self, timeout: float) -> tuple[float, int]:
        """(time.time() when the claim answered, job id) of the next claim."""
        return self.claims.get(timeout=timeout)

    def join(self) -> None:
        """Wait for the process to end (after ``stop_event``); kill a laggard."""
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


async def post(
    host: str, port: int, token: str, path: str, body: dict, *, timeout: float = 60
) -> tuple[int, bytes]:
    """One worker API call on a new connection, as urllib makes them:
    (status, body)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), timeout=timeout)
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


class Fleet(FleetProcess):
    """The polling fleet."""

    def __init__(self, host: str, port: int, tokens: list[str], *, poll_min, poll_max):
        super().__init__(_main, host, port, tokens, poll_min, poll_max)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()


def _main(host, port, tokens, poll_min, poll_max, *, polls, errors, claims, stop):
    asyncio.run(
        _fleet(host, port, tokens, poll_min, poll_max, polls, errors, claims, stop)
    )


async def _fleet(host, port, tokens, poll_min, poll_max, polls, errors, claims, stop):
    backoff_delay = _backoff_delay()

    async def worker(token: str) -> None:
        pauses = IDLE_FOR_LONG
        await asyncio.sleep(random.uniform(0, poll_max))
        while True:
            try:
                status, payload = await post(host, port, token, "/api/v1/claim", {})
            except (TimeoutError, OSError, ValueError, IndexError):
                status, payload = 0, b""
            polls.value += 1
            if status == 200:
                job = json.loads(payload)["job"]
                claims.put((time.time(), job["id"]))
                await post(
                    host,
                    port,
                    token,
                    f"/api/v1/jobs/{job['id']}/complete",
                    {"lease_token": job["lease_token"], "result": {"text": ""}},
                )
                pauses = 0
                continue  # the reference worker claims again at once
            if status != 204:
                errors.value += 1
            pauses += 1
            await asyncio.sleep(backoff_delay(pauses, base=poll_min, cap=poll_max))

    tasks = [asyncio.create_task(worker(token)) for token in tokens]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
