"""Reading a request whole in gunicorn's event loop, before it takes a thread.

gunicorn's gthread worker hands a connection to a thread as soon as it has
bytes to read, and the thread reads the request's head and body itself, as
slowly as the client sends them: 8 connections per process sending half a head
(or a body that never ends) held every thread, and ``/healthz`` went
unanswered for over a minute. Here the worker's event loop reads each request
in full, without blocking, and only a complete request takes a thread. The
thread parses nothing from the socket: it gets gunicorn's own ``Request``,
parsed by gunicorn's own code from the bytes the loop collected, with a body
that reads from memory or from a spool file.

What the loop reads, and its limits (the worker applies the timeouts):

* **The head** (request line and headers) up to ``MAX_HEAD_BYTES`` (64 KiB,
  else ``431``), then gunicorn's parser checks it with every rule and limit it
  has; a head it refuses goes to a thread at once, which answers gunicorn's
  own 400 (or 414, 417, 501...) and closes the connection.
* **The body**, framed by ``Content-Length`` or chunked (the chunk framing is
  followed to its end, trailers included, and kept as it came for gunicorn's
  reader to decode), up to the largest body a view can accept: a
  ``multipart/form-data`` body (the manifest upload) up to
  ``RECALL_MAX_MANIFEST_BYTES`` + ``RECALL_MAX_BODY_BYTES`` + 64 KiB, any other
  up to ``RECALL_MAX_BODY_BYTES``. A declared length past that is not read at
  all: the request goes to a thread with no body and ``Connection: close``, and
  the view refuses it by its declared length, as it always did (the API's 413
  ``payload_too_large``, the upload form's 413 page). A chunked body that
  grows past it is answered ``413`` by the loop.
* **Where the body waits.** In memory, up to ``MEMORY_BODY_BYTES`` (4 MiB) a
  body, while the process holds less than ``MEMORY_BODIES_BYTES`` (32 MiB) of
  bodies in all (the worker sheds load before that runs out); a larger body,
  or one past the budget, in a spool file in Recall's private run directory
  (``recall_site/rundir.py``), made with ``tempfile.TemporaryFile``: unnamed
  on Linux, gone when closed or when the process dies. So a thousand slow
  connections hold little memory each (a head of at most 64 KiB, their share
  of the budget), and a 100 MB manifest upload passes through the disk, never
  through memory, and never holds a thread while it arrives. Why spool rather
  than let a thread read large uploads from the socket: a thread reading a
  slow upload is exactly the hold this module removes, and telling an
  operator's upload from an anonymous one would need the session (the
  database) before the body: a thread again.
* ``Expect: 100-continue``: the loop answers ``100 Continue`` itself once the
  head is read and the body is wanted (not for a body it will not read), and
  the thread does not send it again.
* Pipelined requests: bytes past the end of a request are kept for the
  connection's next one, which the loop reads the same way once the first is
  answered.

Standard library and gunicorn only: no Django import at module level.
"""

from __future__ import annotations

import json
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import IO

from gunicorn.http.body import ChunkedReader, LengthReader
from gunicorn.http.message import Request
from gunicorn.http.parser import RequestParser

# A head (request line and headers) longer than this is refused with 431: it
# bounds what a slow client can make the loop hold before its body.
MAX_HEAD_BYTES = 64 * 1024
# A body up to this stays in memory while the process holds less than
# MEMORY_BODIES_BYTES of bodies in all; a larger one, or one past that budget,
# is spooled to a file.
MEMORY_BODY_BYTES = 4 * 1024 * 1024
MEMORY_BODIES_BYTES = 32 * 1024 * 1024
# Longest chunk-size line, and largest trailer section, of a chunked body.
MAX_CHUNK_LINE_BYTES = 8 * 1024
MAX_TRAILER_BYTES = 64 * 1024
# The multipart form's fields beside the manifest file (console/uploads.py).
FORM_FIELDS_BYTES = 64 * 1024
# What a thread reads of a spooled body at a time.
SPOOL_READ_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """The largest bodies the loop reads, and where it spools large ones."""

    body_bytes: int  # any request but a multipart form
    form_bytes: int  # a multipart/form-data request (the manifest upload)
    spool_dir: str
    memory: Memory  # the process's budget for bodies in memory

    @classmethod
    def from_settings(cls, spool_dir: str) -> Limits:
        from django.conf import settings

        body = settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0
        form = settings.RECALL_MAX_MANIFEST_BYTES + body + FORM_FIELDS_BYTES
        return cls(body, max(form, body), spool_dir, Memory())


class Refusal(Exception):
    """The loop answers this request itself (and closes the connection)."""

    def __init__(self, status: int, reason: str, code: str, detail: str):
        super().__init__(detail)
        self.status, self.reason, self.code, self.detail = status, reason, code, detail

    def response(self) -> bytes:
        return answer(self.status, self.reason, self.code, self.detail)


def answer(status: int, reason: str, code: str, detail: str) -> bytes:
    """A whole HTTP response with Recall's error shape, closing the connection."""
    body = json.dumps({"error": code, "detail": detail}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def timed_out() -> bytes:
    return answer(
        408,
        "Request Timeout",
        "request_timeout",
        "The request did not arrive in time.",
    )


BUSY_PAGE = (
    b"<!doctype html><title>Busy</title><h1>The server is busy</h1>"
    b"<p>Try again in a moment.</p>\n"
)


def busy(path: str = "/api/") -> bytes:
    """The 503 of an overloaded process: the API's ``unavailable`` (workers
    retry it with backoff, after ``Retry-After``), or a short page for a
    person's browser."""
    if path.startswith("/api/"):
        response = answer(
            503,
            "Service Unavailable",
            "unavailable",
            "The server is busy: try again in a moment.",
        )
    else:
        response = (
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
            b"Content-Type: text/html; charset=utf-8\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(BUSY_PAGE)
            + BUSY_PAGE
        )
    return response.replace(
        b"Connection: close\r\n", b"Connection: close\r\nRetry-After: 1\r\n", 1
    )


class Memory:
    """The bytes of bodies one process holds in memory, against its budget
    (used by the event loop's thread only)."""

    def __init__(self, budget: int = MEMORY_BODIES_BYTES) -> None:
        self.budget, self.held = budget, 0

    def take(self, size: int) -> bool:
        if self.held + size > self.budget:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size

    @property
    def spent(self) -> bool:
        """Whether the next body must wait on disk (a flood of them: shed)."""
        return self.held >= self.budget - 64 * 1024


class Source:
    """The bytes of one request, for gunicorn's ``IterUnreader``: the head,
    then the body from memory or from its spool file, then nothing (never the
    socket: the next request on the connection is read by the loop). The
    thread reads it; the loop closes it once the request is answered."""

    def __init__(self, head: bytes) -> None:
        self.pieces: deque[bytes] = deque([head])
        self.spool: IO[bytes] | None = None
        self.memory: Memory | None = None
        self.held = 0  # bytes of the budget its body holds

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> bytes:
        if self.pieces:
            return self.pieces.popleft()
        if self.spool is not None:
            data = self.spool.read(SPOOL_READ_BYTES)
            if data:
                return data
        raise StopIteration

    def close(self) -> None:
        """Let go of the body (its memory, its spool file)."""
        self.pieces.clear()
        if self.spool is not None:
            self.spool.close()
            self.spool = None
        if self.memory is not None:
            self.memory.give(self.held)
            self.memory, self.held = None, 0


class Body:
    """A body as it arrives: in memory up to ``MEMORY_BODY_BYTES`` while the
    process's budget allows, else in an unnamed file in the spool directory."""

    def __init__(self, spool_dir: str, memory: Memory) -> None:
        self.spool_dir, self.budget = spool_dir, memory
        self.memory = bytearray()
        self.file: IO[bytes] | None = None

    def write(self, data: bytes | memoryview) -> None:
        if not data:
            return
        if self.file is None:
            size = len(data)
            if len(self.memory) + size <= MEMORY_BODY_BYTES and self.budget.take(size):
                self.memory += data
                return
            self.file = tempfile.TemporaryFile(dir=self.spool_dir)  # noqa: SIM115
            self.file.write(self.memory)
            self.budget.give(len(self.memory))
            self.memory = bytearray()
        self.file.write(data)

    def hand_to(self, source: Source) -> None:
        """Give the body to the request's source (its file, or its memory and
        the budget it holds)."""
        if self.file is None:
            if self.memory:
                # As it is (gunicorn's readers copy what they take anyway).
                source.pieces.append(self.memory)  # type: ignore[arg-type]
                source.memory, source.held = self.budget, len(self.memory)
        else:
            self.file.flush()
            self.file.seek(0)
            source.spool = self.file
            self.file = None
        self.memory = bytearray()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.budget.give(len(self.memory))
        self.memory = bytearray()


class Chunks:
    """Follows a chunked body's framing to its end, without decoding it:
    gunicorn's reader decodes it on the thread, from the same bytes. Counts
    the decoded size, to refuse a body past the limit while it arrives."""

    SIZE, DATA, DATA_END, TRAILERS = range(4)

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.state = self.SIZE
        self.line = bytearray()  # a chunk-size line, or the trailer section
        self.left = 0  # bytes of the current chunk still to come (then its CRLF)
        self.size = 0  # decoded bytes so far

    def feed(self, data: bytes) -> int | None:
        """How many bytes of ``data`` end the body, or None if it goes on."""
        at = 0
        while at < len(data):
            if self.state == self.DATA:
                take = min(self.left, len(data) - at)
                self.left -= take
                at += take
                if self.left == 0:
                    self.state, self.left = self.DATA_END, 2
                continue
            if self.state == self.DATA_END:
                take = min(self.left, len(data) - at)
                expected = b"\r\n"[2 - self.left : 2 - self.left + take]
                if data[at : at + take] != expected:
                    raise _bad_chunks("a chunk does not end with CRLF")
                self.left -= take
                at += take
                if self.left == 0:
                    self.state = self.SIZE
                continue
            # SIZE or TRAILERS: lines, kept until they end.
            end = data.find(b"\n", at)
            stop = len(data) if end < 0 else end + 1
            self.line += data[at:stop]
            at = stop
            if self.state == self.SIZE:
                if len(self.line) > MAX_CHUNK_LINE_BYTES:
                    raise _bad_chunks("a chunk-size line is too long")
                if end >= 0:
                    self._size_line()
            else:
                if len(self.line) > MAX_TRAILER_BYTES:
                    raise _bad_chunks("the trailer section is too long")
                if self.line == b"\r\n" or self.line.endswith(b"\r\n\r\n"):
                    return at
        return None

    def _size_line(self) -> None:
        line = bytes(self.line)
        self.line = bytearray()
        if not line.endswith(b"\r\n"):
            raise _bad_chunks("a chunk-size line does not end with CRLF")
        digits = line[:-2].split(b";", 1)[0].rstrip(b" \t")
        try:
            if not digits or digits.strip(b"0123456789abcdefABCDEF"):
                raise ValueError
            size = int(digits, 16)
        except ValueError:
            raise _bad_chunks("a chunk size is not hexadecimal") from None
        self.size += size
        if self.size > self.limit:
            raise too_large(self.limit)
        if size == 0:
            self.state = self.TRAILERS
        else:
            self.state, self.left = self.DATA, size


def _bad_chunks(detail: str) -> Refusal:
    return Refusal(400, "Bad Request", "bad_request", f"Bad chunked body: {detail}.")


def too_large(limit: int) -> Refusal:
    return Refusal(
        413,
        "Content Too Large",
        "payload_too_large",
        f"The body is larger than {limit} bytes.",
    )


class OneRequest(RequestParser):
    """gunicorn's parser for one request the loop read in full: ``next()``
    gives the request parsed already (or raises what parsing it raised, for
    gunicorn's handler to answer), then stops."""

    def __init__(self, cfg, source: Source, client, number: int) -> None:
        super().__init__(cfg, source, client)
        self.source = source
        self.req_count = number
        self.error: Exception | None = None
        self.given = False
        try:
            self.mesg = Request(cfg, self.unreader, client, number)
        except Exception as error:  # gunicorn's own parse errors, answered later
            self.mesg, self.error = None, error

    def __next__(self):
        if self.given:
            raise StopIteration()
        self.given = True
        if self.error is not None:
            raise self.error
        return self.mesg

    next = __next__


class Reading:
    """One request arriving on a connection, fed by the event loop.

    ``feed`` takes what the socket gave; once it says the request is whole,
    ``parser`` holds it for the thread, and ``leftover`` the bytes after it
    (the next request, pipelined). It raises ``Refusal`` for what the loop
    answers itself.
    """

    HEAD, BODY, CHUNKED, DONE = range(4)

    def __init__(self, cfg, client, limits: Limits, number: int) -> None:
        self.cfg, self.client, self.limits, self.number = cfg, client, limits, number
        self.phase = self.HEAD
        self.head = bytearray()
        self.searched = 0  # the head's end is looked for from here on
        self.parser: OneRequest | None = None
        self.body: Body | None = None
        self.left = 0  # bytes of a Content-Length body still to come
        self.chunks: Chunks | None = None
        self.leftover = b""
        self.send_continue = False  # the loop owes the client "100 Continue"
        self.young = False  # counted by the worker among young bodies
        self.received = 0  # bytes of this request so far

    @property
    def started(self) -> bool:
        """Whether any byte of this request has come."""
        return self.received > 0

    @property
    def in_body(self) -> bool:
        return self.phase in (self.BODY, self.CHUNKED)

    def feed(self, data: bytes | memoryview) -> bool:
        """Take ``data`` (a view of the loop's buffer: what is kept is
        copied); True once the request is whole (or its head is one gunicorn
        refuses: the thread answers that)."""
        self.received += len(data)
        if self.phase == self.HEAD:
            return self._feed_head(data)
        return self._feed_body(data)

    def _feed_head(self, data: bytes | memoryview) -> bool:
        self.head += data
        end = self.head.find(b"\r\n\r\n", max(0, self.searched - 3))
        if end < 0 or end + 4 > MAX_HEAD_BYTES:
            if len(self.head) > MAX_HEAD_BYTES:
                raise Refusal(
                    431,
                    "Request Header Fields Too Large",
                    "headers_too_large",
                    f"The request's head is larger than {MAX_HEAD_BYTES} bytes.",
                )
            if self._bare_lf():
                # gunicorn refuses a line ending in LF alone: let it say so now
                # rather than wait for a CRLF CRLF that will not come.
                self._parse(bytes(self.head))
                return True
            self.searched = len(self.head)
            return False
        head, rest = bytes(self.head[: end + 4]), bytes(self.head[end + 4 :])
        self.head = bytearray()
        self._parse(head)
        if self.parser is None or self.parser.error is not None:
            return True
        return self._start_body(self.parser.mesg, rest)

    def _bare_lf(self) -> bool:
        """Whether the bytes not yet looked at hold an LF without its CR."""
        at = self.head.find(b"\n", self.searched)
        while at >= 0:
            if at == 0 or self.head[at - 1] != 0x0D:
                return True
            at = self.head.find(b"\n", at + 1)
        return False

    def _parse(self, head: bytes) -> None:
        self.parser = OneRequest(self.cfg, Source(head), self.client, self.number)
        self.phase = self.DONE

    def _start_body(self, req: Request, rest: bytes | memoryview) -> bool:
        content_type = next(
            (value for name, value in req.headers if name == "CONTENT-TYPE"), ""
        )
        multipart = content_type.lower().startswith("multipart/form-data")
        limit = self.limits.form_bytes if multipart else self.limits.body_bytes
        reader = req.body.reader
        if isinstance(reader, ChunkedReader):
            self.phase, self.chunks = self.CHUNKED, Chunks(limit)
        elif isinstance(reader, LengthReader) and reader.length > 0:
            if reader.length > limit:
                # Not read at all: the view refuses it by its declared length,
                # and the connection closes (its body is never drained).
                req.force_close()
                req._expected_100_continue = False
                self.phase = self.DONE
                return True
            self.phase, self.left = self.BODY, reader.length
        else:
            self.phase, self.leftover = self.DONE, bytes(rest)
            return True
        self.body = Body(self.limits.spool_dir, self.limits.memory)
        if req._expected_100_continue:
            self.send_continue = not rest
            req._expected_100_continue = False  # not again from the thread
        return self._feed_body(rest)

    def _feed_body(self, data: bytes | memoryview) -> bool:
        assert self.body is not None
        if self.phase == self.BODY:
            take = data[: self.left]
            self.body.write(take)
            self.left -= len(take)
            if self.left:
                return False
            rest = data[len(take) :]
        else:
            assert self.chunks is not None
            data = bytes(data)
            end = self.chunks.feed(data)
            if end is None:
                self.body.write(data)
                return False
            self.body.write(data[:end])
            rest = data[end:]
        self.leftover = bytes(rest)
        assert self.parser is not None
        self.body.hand_to(self.parser.source)
        self.body = None
        self.phase = self.DONE
        return True

    def close(self) -> None:
        """Let go of what was read (a request dropped before it was whole)."""
        if self.body is not None:
            self.body.close()
        if self.parser is not None:
            self.parser.source.close()
