"""The reference worker's long-poll claims (``--wait-seconds``), as a real
subprocess against a small fake server: it asks to wait (25 s unless told),
claims again at once after a held 204, falls back to its poll backoff when the
server answers at once (an older server), and a signal stops it while the
server holds its claim. No database: these also run in the SQLite pass."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.worker import WORKER_SCRIPT

TOKEN = "wtok-" + "L0ngP0ll" * 5
CURRENT: Claims


class Claims:
    """What this test's fake server holds claims for and has seen: each
    claim's (arrival, body, answered). A fresh one per test (a stopped
    worker's last claim may still be answered after its test)."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, dict, float]] = []
        self.arrivals: list[float] = []
        self.hold = lambda body: 0.0


class Handler(BaseHTTPRequestHandler):
    """Answers every claim 204, after holding it ``hold(body)`` seconds."""

    def do_POST(self):
        record = self.server.record  # type: ignore[attr-defined]
        arrived = time.monotonic()
        record.arrivals.append(arrived)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw or b"{}")
        time.sleep(record.hold(body))
        self.send_response(204)
        self.end_headers()
        record.seen.append((arrived, body, time.monotonic()))

    def log_message(self, *args):
        pass


@pytest.fixture
def fake(tmp_path):
    global CURRENT
    CURRENT = Claims()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.record = CURRENT  # type: ignore[attr-defined]
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    started: list[subprocess.Popen] = []

    def start(*options: str) -> subprocess.Popen:
        env = {"PATH": os.environ["PATH"], "RECALL_TOKEN": TOKEN}
        proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), "--simulate",
             f"--url=http://127.0.0.1:{server.server_port}", *options],
            env=env, stdout=open(tmp_path / "worker.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    server.shutdown()


def claims(count: int, timeout: float = 30) -> list[tuple[float, dict, float]]:
    deadline = time.monotonic() + timeout
    while len(CURRENT.seen) < count:
        assert time.monotonic() < deadline, CURRENT.seen
        time.sleep(0.02)
    return CURRENT.seen[:count]


def gaps(seen) -> list[float]:
    """Seconds from each answer to the next claim's arrival."""
    return [nxt[0] - cur[2] for cur, nxt in itertools.pairwise(seen)]


def test_by_default_a_claim_asks_the_server_to_wait_25_seconds(fake):
    fake()

    (_, body, _), *_ = claims(1)

    assert body == {"wait_seconds": 25.0, "max_jobs": 1}


def test_after_a_held_204_the_worker_claims_again_at_once(fake):
    """The server holds each claim for its whole wait (1 s); the poll backoff
    would pause at least 5 s between claims, the long-poll none."""
    CURRENT.hold = lambda body: body.get("wait_seconds", 0)
    fake("--wait-seconds=1", "--poll-min=10", "--poll-max=20")

    seen = claims(4)

    assert [body for _, body, _ in seen] == [{"wait_seconds": 1.0, "max_jobs": 1}] * 4
    assert all(answered - arrived >= 1 for arrived, _, answered in seen)
    assert max(gaps(seen)) < 0.5


def test_a_server_that_answers_at_once_is_polled_with_backoff(fake):
    """An older server ignores wait_seconds and answers 204 at once: the worker
    pauses between claims as before (equal jitter: at least half of 0.4 s,
    then of 0.8 s, up to --poll-max)."""
    CURRENT.hold = lambda body: 0.0
    fake("--poll-min=0.4", "--poll-max=0.8")

    seen = claims(4)

    assert [body for _, body, _ in seen] == [{"wait_seconds": 25.0, "max_jobs": 1}] * 4
    assert min(gaps(seen)) >= 0.19
    assert max(gaps(seen)) <= 1.5


def test_wait_seconds_0_asks_for_no_wait(fake):
    CURRENT.hold = lambda body: 0.0
    fake("--wait-seconds=0", "--poll-min=0.1", "--poll-max=0.2")

    seen = claims(2)

    assert [body for _, body, _ in seen] == [{"max_jobs": 1}] * 2


def test_a_signal_stops_a_worker_whose_claim_the_server_holds(fake):
    CURRENT.hold = lambda body: 30.0
    proc = fake()
    deadline = time.monotonic() + 20
    while not CURRENT.arrivals:  # the server holds the worker's first claim
        assert time.monotonic() < deadline
        time.sleep(0.02)

    os.killpg(proc.pid, signal.SIGTERM)
    stopped = time.monotonic()

    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - stopped < 3
    assert CURRENT.seen == []  # it did not wait for the answer


@pytest.mark.parametrize("value", ["61", "-1", "x"])
def test_a_bad_wait_seconds_is_refused_at_start_up(value):
    result = subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), "--simulate", "--url=http://x",
         f"--token={TOKEN}", f"--wait-seconds={value}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip

    assert result.returncode == 2
    assert "--wait-seconds" in result.stderr
