"""recallctl never sends its API token to another origin: a redirect to another
scheme, host or port is refused with one readable line (exit status 4), a
redirect within the origin is followed, and a plain http:// URL to another
machine gets one warning. Real local HTTP servers on different ports: one that
redirects, one that captures whatever reaches it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.worker import ROOT

RECALLCTL = ROOT / "worker" / "recallctl.py"
TOKEN = "rct_" + "R3d1rectT0ken" * 3

BATCH = {
    "id": 7,
    "name": "calls",
    "state": "finished",
    "total": 2,
    "counts": {"queued": 0, "transcribing": 0, "done": 2, "failed": 0, "cancelled": 0},
    "percent_done": 100,
    "throughput_per_minute": 0,
    "eta_seconds": None,
    "weight": 1,
    "max_in_flight": None,
    "in_flight": 0,
}


@dataclass
class Server:
    """A real HTTP server in a thread: answers every request with
    ``answer(handler)`` and keeps what arrived (method, path, headers)."""

    host: str = "127.0.0.1"
    answer: object = None
    seen: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.seen.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "authorization": self.headers.get("Authorization"),
                        "host": self.headers.get("Host"),
                    }
                )
                status, headers, body = server.answer(self)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_HEAD = _any

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer((self.host, 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def json_answer(handler) -> tuple[int, dict, bytes]:
    body = {"batch": BATCH, "changed": True} if handler.command == "POST" else BATCH
    return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    """(redirecting, capturing): the capturing one answers like Recall."""
    capturing = Server(answer=json_answer)
    redirecting = Server()
    yield redirecting, capturing
    redirecting.close()
    capturing.close()


def recallctl(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(RECALL_URL=url, RECALL_API_TOKEN=TOKEN)
    return subprocess.run(
        [sys.executable, str(RECALLCTL), "--http-timeout=10", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def redirect_to(location: str, code: int):
    def answer(handler) -> tuple[int, dict, bytes]:
        return code, {"Location": location}, b""

    return answer


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("command", [("status", "7"), ("pause", "7")])
def test_a_redirect_to_another_port_gets_no_token(servers, code, command):
    redirecting, capturing = servers
    target = f"{capturing.url}/api/v1/batches/7"
    redirecting.answer = redirect_to(target, code)

    done = recallctl(redirecting.url, *command)

    assert capturing.seen == []  # nothing, and so no token, went there
    assert [(r["path"], r["authorization"]) for r in redirecting.seen] == [
        (f"/api/v1/batches/7{'/pause' if command[0] == 'pause' else ''}",
         f"Bearer {TOKEN}"),
    ]  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip() == (
        f"recallctl: error: the server redirected ({code}) to {target}, which is "
        f"not http://127.0.0.1:{redirecting.port}; recallctl never sends its API "
        f"token to another scheme, host or port. If that is Recall's address, set "
        f"RECALL_URL to it"
    )
    assert TOKEN not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "location",
    [
        "http://localhost:{port}/api/v1/batches/7",  # another host, same port
        "https://127.0.0.1:{port}/api/v1/batches/7",  # another scheme
        "//localhost:{port}/api/v1/batches/7",  # scheme-relative
    ],
)
def test_a_redirect_to_another_host_or_scheme_gets_no_token(servers, location):
    redirecting, _ = servers
    redirecting.answer = redirect_to(location.format(port=redirecting.port), 302)

    done = recallctl(redirecting.url, "status", "7")

    assert done.returncode == 4
    assert "recallctl never sends its API token" in done.stderr
    assert len(redirecting.seen) == 1  # the redirect was not followed
    assert redirecting.seen[0]["host"] == f"127.0.0.1:{redirecting.port}"


def test_wait_stops_at_a_cross_origin_redirect_instead_of_waiting(servers):
    redirecting, capturing = servers
    redirecting.answer = redirect_to(f"{capturing.url}/api/v1/batches/7", 302)

    done = recallctl(redirecting.url, "wait", "7", "--interval=0.1", "--timeout=30")

    assert done.returncode == 4
    assert "recallctl never sends its API token" in done.stderr
    assert capturing.seen == []


def test_a_redirect_within_the_origin_is_followed_with_the_token(servers):
    redirecting, _ = servers

    def answer(handler) -> tuple[int, dict, bytes]:
        if handler.path.startswith("/moved/"):
            return json_answer(handler)
        return 302, {"Location": f"/moved{handler.path}"}, b""

    redirecting.answer = answer

    done = recallctl(redirecting.url, "status", "7")

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("batch 7 'calls': finished, 2/2 done")
    assert [(r["path"], r["authorization"]) for r in redirecting.seen] == [
        ("/api/v1/batches/7", f"Bearer {TOKEN}"),
        ("/moved/api/v1/batches/7", f"Bearer {TOKEN}"),
    ]
    assert "warning" not in done.stderr  # loopback: no plain-http warning


def _outside_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_plain_http_to_another_machine_is_warned_about_once():
    address = _outside_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    server = Server(host=address, answer=json_answer)
    try:
        done = recallctl(server.url, "wait", "7", "--interval=0.1")
        quiet = recallctl(f"http://127.0.0.1:{server.port}", "status", "7")
    finally:
        server.close()

    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"recallctl: warning: RECALL_URL is plain http:// to {address!r}, which is "
        f"not this machine: the API token and everything it fetches cross the "
        f"network unencrypted; use https://"
    ]
    assert quiet.returncode == 4  # nothing listens on loopback at that port
    assert "warning" not in quiet.stderr
