"""Raw-socket clients for the adversarial tests: what a hostile (or merely slow)
client sends, byte for byte, and timed answers from the real server."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import weakref
from collections.abc import Iterator

from tests.support.server import start_server

HOST = "127.0.0.1"


@contextlib.contextmanager
def serving(
    tmp_path, processes: int, threads: int, *args: str, env: dict | None = None
) -> Iterator[tuple[int, object]]:
    """The real server (gunicorn.conf.py, ``args`` and ``env`` on top): (port,
    log path); stopped after, its log free of tracebacks."""
    process, port, log = start_server(tmp_path, processes, threads, *args, env=env)
    try:
        yield port, log
    finally:
        process.terminate()
        process.wait(timeout=60)
    text = log.read_text()
    assert "Traceback" not in text, text[-5000:]


def connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=30)
    return sock


def request_bytes(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    token: str | None = None,
    headers: dict | None = None,
    close: bool = True,
) -> bytes:
    """A whole HTTP/1.1 request."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
        lines.append("Content-Type: application/json")
    if close:
        lines.append("Connection: close")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# Bytes read past a response (the next one's, pipelined), by socket.
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int, dict, bytes]:
    """One response from ``sock``: (status, headers in lower case, body). What
    comes after it is kept for the next call."""
    sock.settimeout(timeout)
    data = raw = _pending.pop(sock, b"")

    def more() -> None:
        nonlocal data, raw
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            _pending[sock] = raw  # all of it, for a later call
            raise
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data, raw = data + chunk, raw + chunk

    while b"\r\n\r\n" not in data:
        more()
    head, _, data = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            while b"\r\n" not in data:
                more()
            size, _, data = data.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            while len(data) < n + 2:
                more()
            body, data = body + data[:n], data[n + 2 :]
            if n == 0:
                break
    else:
        length = int(headers.get("content-length", "0"))
        while len(data) < length:
            more()
        body, data = data[:length], data[length:]
    if data:
        _pending[sock] = data
    return status, headers, body


def call(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    token: str | None = None,
    timeout: float = 30,
) -> tuple[int, bytes, float]:
    """One request on a new connection: (status, body, seconds it took)."""
    started = time.monotonic()
    with connect(port) as sock:
        sock.sendall(request_bytes(method, path, body, token=token))
        status, _, payload = read_response(sock, timeout)
    return status, payload, time.monotonic() - started


def healthz(port: int, timeout: float = 10) -> float:
    """Seconds ``/healthz`` took to answer 200 (a timeout fails the test)."""
    status, body, took = call(port, "GET", "/healthz", timeout=timeout)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    return took


def claim_bytes(token: str, wait: float, body_extra: dict | None = None) -> bytes:
    body = json.dumps({"wait_seconds": wait, **(body_extra or {})}).encode()
    return request_bytes("POST", "/api/v1/claim", body, token=token, close=False)


def closed_by_server(sock: socket.socket, timeout: float = 0.5) -> bool:
    """Whether the server closed ``sock`` (without sending anything on it)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
