"""Two real gunicorn nodes of three processes each, on the test database: every
process of every node reports the same database figures, each node's request
metrics add up over its processes (and survive a worker's death), the metrics
directory starts empty, and with LOG_FORMAT=json every line is a JSON object."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection

from harness.server import Server, free_port
from jobs import transitions
from tests.support.factories import make_batch
from tests.support.metrics import CLAIMS, count_in_a_process, samples

TOKEN = "gunicorn-metrics-token-7c1e9a44b2d0f3"
DATABASE_FAMILIES = (
    "recall_jobs",
    "recall_batches",
    "recall_oldest_queued_seconds",
    "recall_workers",
    "recall_last_sweep_age_seconds",
)

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class Node:
    """One gunicorn master with its processes, its metrics directory and its
    stdout (JSON lines)."""

    def __init__(self, name: str, tmp: Path):
        self.metrics_dir = tmp / f"metrics-{name}"
        self.log_path = tmp / f"{name}.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server: Server | None = None

    def start(self) -> None:
        db = connection.settings_dict
        env = {
            "PATH": os.environ["PATH"],
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/"
            f"{db['NAME']}",
            "SECRET_KEY": "gunicorn-test-secret-" + "x" * 50,
            "RECALL_HTTPS": "off",
            "WEB_CONCURRENCY": "3",
            # One request per process at a time (sync workers), so requests
            # held open land on distinct processes; threads do not change how
            # the processes' metrics add up, which is what this tests.
            "RECALL_WEB_THREADS": "1",
            "RECALL_STARTUP_SWEEP": "off",
            "RECALL_METRICS_TOKEN": TOKEN,
            "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
            "LOG_FORMAT": "json",
        }
        self.server = Server(env, self.log_path, port=self.port)
        self.wait_for(lambda: self.booted() >= 3, "three booted processes")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]

    def booted(self) -> int:
        return sum(1 for line in self.lines() if "Booting worker" in line["message"])

    def wait_for(self, condition, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.server.alive(), self.log_path.read_text()
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def request(self, path: str, *, token: str, body: dict | None = None):
        request = urllib.request.Request(
            self.base + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
            },
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def scrape(self) -> dict[tuple, float]:
        status, body = self.request("/metrics", token=TOKEN)
        assert status == 200, body
        return samples(body)

    def pids(self, path: str) -> set[int]:
        """Processes that answered ``path``, from the JSON access log."""
        return {
            line["pid"]
            for line in self.lines()
            if line["logger"] == "gunicorn.access" and f" {path} " in line["message"]
        }


@pytest.fixture
def nodes(tmp_path):
    started = [Node("a", tmp_path), Node("b", tmp_path)]
    # A previous server's leftovers: the start must not count them.
    started[0].metrics_dir.mkdir()
    count_in_a_process(started[0].metrics_dir, 1000, 0)
    try:
        for node in started:
            node.start()
        yield started
    finally:
        for node in started:
            node.stop()


def work(node: Node, token: str) -> Counter:
    """Claim and complete until the queue is empty; count the answers."""
    answers: Counter = Counter()
    while True:
        status, body = node.request("/api/v1/claim", token=token, body={})
        answers["claim", status] += 1
        if status != 200:
            return answers
        job = json.loads(body)["job"]
        status, _ = node.request(
            f"/api/v1/jobs/{job['id']}/complete",
            token=token,
            body={"lease_token": job["lease_token"], "result": {"text": "ok"}},
        )
        answers["complete", status] += 1


def accept_queue(port: int) -> int:
    """Connections waiting to be accepted on a listening port (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def pinned(node: Node, requests: list[tuple[str, str, dict | None]]) -> list[int]:
    """Each request on a connection of its own, held half-sent until every
    connection was accepted: a sync process serves one connection at a time,
    so each request is answered by a different process. Returns the statuses."""
    held = []
    for path, token, body in requests:
        data = b"" if body is None else json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", node.port), timeout=30)
        method = "GET" if body is None else "POST"
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        rest = (
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode() + data
        held.append((sock, rest))
    node.wait_for(lambda: accept_queue(node.port) == 0, "every connection accepted")
    for sock, rest in held:
        sock.sendall(rest)
    statuses = []
    for sock, _ in held:
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.read()
        statuses.append(response.status)
        sock.close()
    return statuses


def request_counts(scrape: dict[tuple, float]) -> Counter:
    return Counter(
        {
            (key[1][1], int(key[2][1])): int(value)
            for key, value in scrape.items()
            if key[0] == "recall_api_requests_total"
        }
    )


def database_figures(scrape: dict[tuple, float]) -> tuple:
    return tuple(sorted((k, v) for k, v in scrape.items() if k[0] in DATABASE_FAMILIES))


def test_every_process_and_node_reports_the_same(nodes):
    a, b = nodes
    make_batch(24, name="spread")
    tokens = [transitions.create_worker(f"gpu-{i}")[1] for i in range(6)]

    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda i: work((a, b)[i % 2], tokens[i]), range(len(tokens)))
        )
    sent = {node: Counter() for node in ("a", "b")}
    for i, counted in enumerate(answers):
        sent["ab"[i % 2]].update(counted)
    assert sent["a"]["claim", 200] + sent["b"]["claim", 200] == 24
    assert sent["a"]["claim", 204] == sent["b"]["claim", 204] == 3

    # Every process of each node counts a claim, and answers a scrape.
    for node in (a, b):
        claims = [("/api/v1/claim", tokens[0], {})] * 3
        assert pinned(node, claims) == [204, 204, 204]
        sent["a" if node is a else "b"]["claim", 204] += 3
        assert pinned(node, [("/metrics", TOKEN, None)] * 3) == [200, 200, 200]
        # (each process logs its access line just after answering)
        node.wait_for(lambda n=node: len(n.pids("/api/v1/claim")) == 3, "3 claimers")
        node.wait_for(lambda n=node: len(n.pids("/metrics")) == 3, "3 scraped")
        assert len(list(node.metrics_dir.glob("counter_*.db"))) == 3

    with ThreadPoolExecutor(6) as pool:
        scrapes = list(
            pool.map(lambda i: ((a, b)[i % 2], (a, b)[i % 2].scrape()), range(60))
        )

    expected = database_figures(scrapes[0][1])
    for node, scrape in scrapes:
        assert database_figures(scrape) == expected
        assert request_counts(scrape) == sent["a" if node is a else "b"]
    figures = dict(expected)
    assert figures[("recall_jobs", ("status", "completed"))] == 24
    assert figures[("recall_batches", ("state", "finished"))] == 1
    assert figures[("recall_workers", ("state", "idle"))] == 6
    assert figures[("recall_oldest_queued_seconds",)] == 0
    # The leftovers of a previous server (1,000 claims) were wiped at start.
    assert a.scrape()[CLAIMS] == sent["a"]["claim", 204]


def test_a_dead_workers_requests_still_count(nodes):
    a, _ = nodes
    _, token = transitions.create_worker("gpu")
    with ThreadPoolExecutor(3) as pool:
        list(
            pool.map(
                lambda _: a.request("/api/v1/claim", token=token, body={}), range(30)
            )
        )
    assert a.scrape()[CLAIMS] == 30
    served = a.pids("/api/v1/claim")
    victim = next(p for p in served if (a.metrics_dir / f"counter_{p}.db").exists())

    os.kill(victim, signal.SIGKILL)
    a.wait_for(lambda: a.booted() >= 4, "a replacement process")
    a.wait_for(
        lambda: not (a.metrics_dir / f"counter_{victim}.db").exists(),
        "the dead process's files to be folded in",
    )

    assert a.scrape()[CLAIMS] == 30
    assert (a.metrics_dir / "counter_archive.db").exists()
    assert a.request("/api/v1/claim", token=token, body={})[0] == 204
    assert a.scrape()[CLAIMS] == 31


def test_every_line_is_json(nodes):
    a, _ = nodes
    assert a.request("/api/v1/claim", token="bad-token-0000", body={})[0] == 401
    # (the process logs its access line just after answering)
    a.wait_for(lambda: a.pids("/api/v1/claim"), "the access line")

    lines = a.lines()  # json.loads of every line: it raises on any other line

    assert all(
        set(line) == {"time", "level", "logger", "message", "pid"} for line in lines
    )
    loggers = Counter(line["logger"] for line in lines)
    assert loggers["gunicorn.error"] >= 5  # starting, listening, booting x 3
    claims = [line for line in lines if "/api/v1/claim" in line["message"]]
    assert [(line["logger"], line["level"]) for line in claims] == [
        ("django.request", "WARNING"),  # Django's own line for a 4xx
        ("gunicorn.access", "INFO"),
    ]
    assert '"POST /api/v1/claim HTTP/1.1" 401 ' in claims[1]["message"]
