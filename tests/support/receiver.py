"""A real webhook receiver: an HTTP server in a thread on 127.0.0.1, answering
each request as the test scripts it and recording what arrived (the
``receiver`` fixture, in conftest.py)."""

from __future__ import annotations

import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic()

    @property
    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering
    hang: bool = False  # never answer (until the test ends)


class Receiver:
    """Answers requests in the order scripted (``answers``), then with 200."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.received: list[Received] = []
        self.answers: list[Answer] = []
        self.arrived = threading.Condition()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                with receiver.arrived:
                    receiver.received.append(
                        Received(
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                            time.monotonic(),
                        )
                    )
                    answer = receiver.answers.pop(0) if receiver.answers else Answer()
                    receiver.arrived.notify_all()
                if answer.hang:
                    receiver.release.wait(120)
                    return
                time.sleep(answer.delay)
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            def log_message(self, format: str, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"https://localhost:{self.server.server_address[1]}/hooks"
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def wait_for(self, n: int, timeout: float = 30) -> list[Received]:
        """Block until ``n`` requests have arrived (fails after ``timeout``)."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.received) >= n, timeout):
                pytest.fail(f"the receiver got {len(self.received)} of {n} requests")
        return list(self.received)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
