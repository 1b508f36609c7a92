"""Long-poll claims against a real server: one claim on a connection of its
own, a claim waiting on a thread, and a waiting claim woken by a new batch."""

from __future__ import annotations

import http.client
import json
import threading
import time

from django.utils import timezone

from jobs.models import Worker
from tests.support.factories import jobs_of, make_batch, make_worker


def post(port: int, worker: Worker, path: str, body: dict, timeout: float = 90):
    """(status, JSON or None, seconds taken) of one request on a new connection."""
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    client.request(
        "POST",
        f"/api/v1/{path}",
        json.dumps(body),
        {"Authorization": f"Bearer {worker.token}"},
    )
    response = client.getresponse()
    raw = response.read()
    took = time.monotonic() - started
    client.close()
    return response.status, (json.loads(raw) if raw else None), took


class Waiting(threading.Thread):
    """A claim with ``wait`` seconds in flight on its own thread."""

    def __init__(self, port: int, worker: Worker, wait: float):
        super().__init__()
        self.port, self.worker, self.wait = port, worker, wait
        self.result: tuple | None = None
        self.start()

    def run(self) -> None:
        self.result = post(self.port, self.worker, "claim", {"wait_seconds": self.wait})

    def answer(self) -> tuple:
        self.join(timeout=self.wait + 30)
        assert self.result is not None
        return self.result


def parked(*workers: Worker) -> None:
    """Return once the workers' claims have been tried once (and found nothing):
    a first request marks its worker seen, and the view parks it right after."""
    deadline = time.monotonic() + 10
    pks = [worker.pk for worker in workers]
    while Worker.objects.filter(pk__in=pks, last_seen__isnull=False).count() < len(pks):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)


def woken_by_a_new_batch(port: int) -> float:
    """A claim waits; a batch comes: the claim gets its job within 2 s (the
    probe runs every 0.25 s). The seconds the claim took in all."""
    worker = make_worker()
    waiting = Waiting(port, worker, 30)
    parked(worker)

    batch = make_batch(1, now=timezone.now())
    created = time.monotonic()
    status, body, took = waiting.answer()

    assert status == 200
    assert body["job"]["id"] == jobs_of(batch)[0].pk
    assert time.monotonic() - created < 2
    return took
