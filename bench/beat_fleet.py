"""A fleet of busy workers heartbeating their leases against the real server,
in one process.

Each simulated worker holds several leases (a box with several GPUs) and
renews them every ``interval`` seconds, its phase spread over one interval,
as a fleet does: either once per lease (``POST /api/v1/jobs/<id>/heartbeat``,
one after another) or once for all of them (``POST /api/v1/heartbeat`` with
``{"leases": [...]}``, issue 26). Every call is a new HTTP connection, as
urllib makes them. It runs in a process of its own (asyncio, no threads), so
its CPU is not the server's.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import time

from .fleet import FleetProcess, post


class HeartbeatFleet(FleetProcess):
    """The heartbeating fleet: ``polls`` counts its calls, ``renewed`` the
    leases they renewed, ``errors`` every call or lease that was not renewed."""

    def __init__(
        self,
        host: str,
        port: int,
        workers: list[tuple[str, list[tuple[int, str]]]],
        *,
        batched: bool,
        interval: float,
    ):
        context = multiprocessing.get_context("spawn")
        self.renewed = context.Value("q", 0)
        self.report = context.Queue()
        super().__init__(
            _main,
            *(host, port, workers, batched, interval),
            renewed=self.renewed,
            report=self.report,
        )

    def stop(self) -> list[float]:
        """Stop; every call's latency in seconds."""
        self.stop_event.set()
        latencies = self.report.get(timeout=120)
        self.join()
        return latencies


def _main(host, port, workers, batched, interval, **shared):
    asyncio.run(_fleet(host, port, workers, batched, interval, **shared))


async def _fleet(host, port, workers, batched, interval, **shared):
    polls, errors, renewed = shared["polls"], shared["errors"], shared["renewed"]
    stop, report = shared["stop"], shared["report"]
    latencies: list[float] = []

    async def call(token: str, path: str, body: dict) -> tuple[int, bytes]:
        started = time.monotonic()
        try:
            status, payload = await post(host, port, token, path, body)
        except (TimeoutError, OSError, ValueError, IndexError):
            status, payload = 0, b""
        latencies.append(time.monotonic() - started)
        polls.value += 1
        return status, payload

    async def once_per_lease(token: str, leases: list[tuple[int, str]]) -> None:
        for job_id, lease_token in leases:
            status, _ = await call(
                token,
                f"/api/v1/jobs/{job_id}/heartbeat",
                {"lease_token": lease_token},
            )
            if status == 200:
                renewed.value += 1
            else:
                errors.value += 1

    async def once_per_worker(token: str, leases: list[tuple[int, str]]) -> None:
        body = {"leases": [{"job_id": j, "lease_token": t} for j, t in leases]}
        status, payload = await call(token, "/api/v1/heartbeat", body)
        if status != 200:
            errors.value += len(leases)
            return
        answers = json.loads(payload)["leases"]
        ok = sum(1 for answer in answers if "lease_expires_at" in answer)
        renewed.value += ok
        errors.value += len(leases) - ok

    beat = once_per_worker if batched else once_per_lease

    async def worker(token: str, leases: list[tuple[int, str]]) -> None:
        await asyncio.sleep(random.uniform(0, interval))  # phases spread out
        while not stop.is_set():
            started = time.monotonic()
            await beat(token, leases)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    tasks = [asyncio.create_task(worker(token, leases)) for token, leases in workers]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    report.put(latencies)
