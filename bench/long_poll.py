"""A fleet of idle workers long-polling the real server, in one process.

Each simulated worker behaves like the reference worker (worker/recall_worker.py)
between jobs with ``--wait-seconds``: it claims with ``{"wait_seconds": W}``;
on 204 it claims again at once (the server held it); on a job it reports the
claim to the benchmark, then heartbeats the lease every ``heartbeat_interval``
(from the claim; the first one interval after it, as the reference worker does)
until the run ends. A few more workers hold a lease from the start and
heartbeat it every ``interval`` seconds throughout. The workers start
over ``spread`` seconds, as a fleet does, not in one instant. Every call is a
new HTTP connection, as urllib makes them. It runs in a process of its own
(asyncio, no threads), so its CPU is not the server's.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import time

from .fleet import FleetProcess, post


class LongPollFleet(FleetProcess):
    """The long-polling fleet, and the heartbeats' latencies at its end."""

    def __init__(
        self,
        host: str,
        port: int,
        tokens: list[str],
        leases: list[tuple[str, int, str]],
        *,
        wait: float,
        interval: float,
        spread: float,
    ):
        context = multiprocessing.get_context("spawn")
        self.beats = context.Queue()
        self.go = context.Event()  # the waiting workers start (the beaters at once)
        super().__init__(
            _main,
            *(host, port, tokens, leases, wait, interval, spread),
            beats=self.beats,
            go=self.go,
        )

    def stop(self) -> list[tuple[float, float]]:
        """Stop; every heartbeat's (time.time() when sent, latency in seconds)."""
        self.stop_event.set()
        latencies = self.beats.get(timeout=120)
        self.join()
        return latencies


def _main(host, port, tokens, leases, wait, interval, spread, **shared):
    asyncio.run(_fleet(host, port, tokens, leases, wait, interval, spread, **shared))


async def _fleet(host, port, tokens, leases, wait, interval, spread, **shared):
    polls, errors, claims = shared["polls"], shared["errors"], shared["claims"]
    beats, stop, go = shared["beats"], shared["stop"], shared["go"]
    latencies: list[tuple[float, float]] = []

    async def heartbeat(
        token: str, job_id: int, lease_token: str, every: float, *, first: float = 0
    ):
        await asyncio.sleep(first)
        while not stop.is_set():
            sent, started = time.time(), time.monotonic()
            try:
                status, _ = await post(
                    host,
                    port,
                    token,
                    f"/api/v1/jobs/{job_id}/heartbeat",
                    {"lease_token": lease_token},
                )
            except (TimeoutError, OSError, ValueError, IndexError):
                status = 0
            latencies.append((sent, time.monotonic() - started))
            if status != 200:
                errors.value += 1
            await asyncio.sleep(every)

    async def worker(token: str) -> None:
        while not go.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(random.uniform(0, spread))  # a fleet starts over time
        while not stop.is_set():
            try:
                status, payload = await post(
                    host,
                    port,
                    token,
                    "/api/v1/claim",
                    {"wait_seconds": wait},
                    timeout=wait + 30,
                )
            except (TimeoutError, OSError, ValueError, IndexError):
                status, payload = 0, b""
            polls.value += 1
            if status == 200:
                job = json.loads(payload)["job"]
                claims.put((time.time(), job["id"]))
                # As the reference worker: the first heartbeat one interval
                # after the claim, not at once.
                every = job["heartbeat_interval"]
                await heartbeat(
                    token, job["id"], job["lease_token"], every, first=every
                )
                return
            if status != 204:
                errors.value += 1
                await asyncio.sleep(1)

    tasks = [asyncio.create_task(heartbeat(*lease, interval)) for lease in leases]
    tasks += [asyncio.create_task(worker(token)) for token in tokens]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    beats.put(latencies)
