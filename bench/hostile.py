"""Hostile clients against the real server, in a process of their own (row 18).

One valid worker token keeps ``claims`` waiting claims open, each with a body
of ``claim_bytes`` (a JSON object padded to that size, ``wait_seconds`` 60):
when one is answered (the server answers the oldest early when it needs room),
it opens another at once, as a hostile client would. Beside it, ``slow``
anonymous connections send half a request and then a byte now and then: half
of them a head that never ends, half a head and part of a 1 MB body; when the
server drops one, it connects again. All of it asyncio, no threads, so its CPU
is not the server's; it counts what it did and what it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import random
import time

from .fleet import FleetProcess

# A slow connection sends one more byte this often (well under the server's
# client timeout for a body, so only its total time for a head drops those).
TRICKLE_SECONDS = 2.0
SLOW_BODY_BYTES = 1024 * 1024


class HostileClients(FleetProcess):
    """The attackers; ``stop()`` returns what they counted."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        claims: int,
        claim_bytes: int,
        slow: int,
    ):
        context = multiprocessing.get_context("spawn")
        self.report = context.Queue()
        super().__init__(
            _main, host, port, token, claims, claim_bytes, slow, report=self.report
        )  # (``claims`` in _main is the fleet's queue: the count is ``waiting``)

    def stop(self) -> dict:
        self.stop_event.set()
        counted = self.report.get(timeout=120)
        self.join()
        return counted


def _main(host, port, token, waiting, claim_bytes, slow, **shared):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = waiting + slow + 1024
    if soft < want:  # one descriptor per connection
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    asyncio.run(_attack(host, port, token, waiting, claim_bytes, slow, **shared))


async def _attack(host, port, token, waiting, claim_bytes, slow, **shared):
    stop, report = shared["stop"], shared["report"]
    counted = {
        "claims sent": 0,
        "claims answered": {},
        "claim errors": 0,
        "slow connections": 0,
        "slow answered": {},
        "slow dropped": 0,
        "slow errors": 0,
    }
    padding = max(0, claim_bytes - 40)
    body = json.dumps({"wait_seconds": 60, "pad": "x" * padding}).encode()
    claim = (
        f"POST /api/v1/claim HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body

    async def answer(reader) -> str:
        head = await reader.readuntil(b"\r\n")
        with contextlib.suppress(Exception):
            await reader.read()  # the rest, until the server closes
        return head.split(b" ", 2)[1].decode()

    async def waiting_claim() -> None:
        while not stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), 10
                )
                writer.write(claim)
                await writer.drain()
                counted["claims sent"] += 1
                status = await answer(reader)
                answered = counted["claims answered"]
                answered[status] = answered.get(status, 0) + 1
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                counted["claim errors"] += 1
                await asyncio.sleep(0.5)
            finally:
                if writer is not None:
                    writer.close()

    async def slow_client(n: int) -> None:
        await asyncio.sleep(random.uniform(0, 1))
        while not stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), 10
                )
                counted["slow connections"] += 1
                if n % 2:
                    writer.write(
                        f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
                    )
                else:
                    writer.write(
                        (
                            f"POST /api/v1/claim HTTP/1.1\r\nHost: {host}\r\n"
                            "Content-Type: application/json\r\n"
                            f"Content-Length: {SLOW_BODY_BYTES}\r\n\r\n"
                        ).encode()
                        + b"[" * 10_000
                    )
                await writer.drain()
                trickle = asyncio.ensure_future(reader.read(1))
                while not stop.is_set():
                    done, _ = await asyncio.wait({trickle}, timeout=TRICKLE_SECONDS)
                    if done:  # the server answered (408) or closed it
                        first = trickle.result()
                        if first:
                            rest = await reader.read()
                            status = (first + rest).split(b" ", 2)[1].decode()
                            got = counted["slow answered"]
                            got[status] = got.get(status, 0) + 1
                        counted["slow dropped"] += 1
                        break
                    writer.write(b"a" if n % 2 else b"[")
                    await writer.drain()
                trickle.cancel()
            except (OSError, TimeoutError, IndexError, ValueError):
                counted["slow errors"] += 1
                await asyncio.sleep(0.5)
            finally:
                if writer is not None:
                    writer.close()

    tasks = [asyncio.create_task(slow_client(n)) for n in range(slow)]
    for _ in range(waiting):  # opened over about a second, not in one instant
        tasks.append(asyncio.create_task(waiting_claim()))
        await asyncio.sleep(1 / max(waiting, 1))
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    report.put(counted)


class HealthProbe:
    """``GET /healthz`` every ``interval`` seconds on a thread, each on a new
    connection with a 5 s timeout: every answer's time (a failure counts
    its full time, and is counted)."""

    def __init__(self, host: str, port: int, interval: float = 0.5):
        import threading

        self.host, self.port, self.interval = host, port, interval
        self.latencies: list[float] = []
        self.failures = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        import http.client

        while not self.done.is_set():
            connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
            t0 = time.perf_counter()
            try:
                connection.request("GET", "/healthz")
                response = connection.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
            finally:
                connection.close()
            self.latencies.append(time.perf_counter() - t0)
            self.failures += not ok
            self.done.wait(self.interval)


class MemorySampler:
    """The resident memory of a process tree (gunicorn's master and workers),
    sampled every ``interval`` seconds on a thread: the first sample and the
    largest."""

    def __init__(self, root: int, interval: float = 0.5):
        import threading

        self.root, self.interval = root, interval
        self.first = self.peak = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.first = self.peak = tree_rss_mb(self.root)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, tree_rss_mb(self.root))


def tree_rss_mb(root: int) -> float:
    """Resident memory of ``root`` and its children, in MB (Linux /proc)."""
    pids = [root]
    with contextlib.suppress(OSError), open(f"/proc/{root}/task/{root}/children") as f:
        pids += [int(pid) for pid in f.read().split()]
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024
