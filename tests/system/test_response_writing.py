"""The web worker's response (recall_site/gunicorn_worker.py, ``Response``): a
head and the first part of its body leave in one send, and what arrives is
byte for byte what gunicorn's own response sends, whatever the response."""

from __future__ import annotations

import re
import socket

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi

from recall_site.gunicorn_worker import JOIN_BYTES, Response
from recall_site.request_reading import Limits, Memory, Reading

CLIENT = ("127.0.0.1", 40000)
SERVER = ("127.0.0.1", 8000)


class Counted:
    """A real socket that counts the sends made on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sends = sock, 0

    def sendall(self, data) -> None:
        self.sends += 1
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _request(tmp_path, method: str, *, version: str = "1.1"):
    limits = Limits(1_000_000, 0, str(tmp_path), Memory(1024 * 1024))
    reading = Reading(Config(), CLIENT, limits, 1)
    head = f"{method} /api/v1/claim HTTP/{version}\r\nHost: x\r\n\r\n".encode()
    assert reading.feed(head)
    return next(reading.parser)


def _answer(tmp_path, response_class, method, status, headers, parts, version):
    """What a client receives of one answer, and how many sends made it."""
    ours, theirs = socket.socketpair()
    counted = Counted(ours)
    req = _request(tmp_path, method, version=version)
    resp, _ = wsgi.create(req, counted, CLIENT, SERVER, Config(), response_class)
    resp.start_response(status, headers)
    for part in parts:
        resp.write(part)
    resp.close()
    ours.close()
    received = b""
    while chunk := theirs.recv(1 << 20):
        received += chunk
    theirs.close()
    # The Date header is the second's: the two answers may straddle one.
    return re.sub(rb"Date: [^\r]*\r\n", b"", received), counted.sends


JSON = [("Content-Type", "application/json")]


@pytest.mark.parametrize(
    ("method", "status", "headers", "parts", "version", "sends"),
    [
        # A worker API answer: one send where gunicorn makes two.
        ("POST", "200 OK", [*JSON, ("Content-Length", "17")], [b'{"job": {"id": 1}'], "1.1", (1, 2)),
        # No body (a 204, a HEAD): the head alone, as before.
        ("POST", "204 No Content", [], [b""], "1.1", (1, 1)),
        ("HEAD", "200 OK", [*JSON, ("Content-Length", "2")], [b"{}"], "1.1", (1, 1)),
        # Without a length: chunked; each part a chunk, and the last one.
        ("GET", "200 OK", JSON, [b"[1,", b"2]"], "1.1", (3, 4)),
        # HTTP/1.0 without a length: the body until the connection closes.
        ("GET", "200 OK", JSON, [b"[1,", b"2]"], "1.0", (2, 3)),
        # A first part larger than JOIN_BYTES goes after its head, as before.
        ("GET", "200 OK", [("Content-Length", str(JOIN_BYTES + 1))], [b"x" * (JOIN_BYTES + 1)], "1.1", (2, 2)),
        # A length shorter than what the application writes: cut at the length.
        ("POST", "200 OK", [("Content-Length", "3")], [b"abcdef", b"gh"], "1.1", (1, 2)),
    ],
)  # fmt: skip
def test_the_head_leaves_with_the_first_part_and_the_bytes_are_gunicorns(
    tmp_path, method, status, headers, parts, version, sends
):
    """``sends``: how many sends this response makes, and gunicorn's."""
    ours, our_sends = _answer(
        tmp_path, Response, method, status, headers, parts, version
    )
    stock, stock_sends = _answer(
        tmp_path, wsgi.Response, method, status, headers, parts, version
    )

    assert ours == stock
    assert ours.startswith(f"HTTP/{version} {status}\r\n".encode())
    assert (our_sends, stock_sends) == sends
