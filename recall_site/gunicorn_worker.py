"""gunicorn's ``gthread`` worker, made to hold its own against hostile clients:
it reads every request whole before a thread sees it, keeps room for new
connections whatever the clients do, and holds long-poll claims without a
thread.

**Reading in the event loop** (``recall_site/request_reading.py``). The stock
worker hands a connection to a thread as soon as it has bytes, and the thread
reads the head and body at the client's pace: a client sending half a request
held a thread for as long as it liked. Here the loop reads each request,
without blocking, until it is whole, and only then hands it to a thread, which
never reads the socket. A request must arrive within
``RECALL_CLIENT_TIMEOUT_SECONDS`` (10 s) of its first byte, or of the
connection's opening for the first one; a body may take longer but never stop
for that long. One that does is answered ``408`` and dropped. A kept-alive
connection may wait ``keepalive`` (5 s) for its next request. Connections the
server closes after answering linger in the loop (up to 2 s, draining what the
client still sends, as gunicorn's ``close_graceful`` does) instead of
blocking it: a client that never closed its side made the stock worker's loop
sleep 2 s per connection.

**Threads.** A complete request waits for a thread in one of two queues:
lease calls and health (``/api/v1/jobs/...``, ``/api/v1/heartbeat``,
``/healthz``, ``/readyz``, ``/metrics``) go first, and one thread of each
process is kept for them: other requests (claims, pages, exports, uploads)
take a thread only while another stays free. So a heartbeat never waits
behind a claim storm or behind seven exports. A process listens for new
connections while such a thread is free, so that the kernel hands connections
to a process that can serve them at once; a process with none free takes,
every 20 ms, the connections that waited in the kernel's backlog through one
look (every process is busy, then, and a connection held here can be put
behind a heartbeat; one in the backlog cannot). A request that waited 5 s for
a thread is answered 503 (its client retries, most likely on another process).

**Load shedding.** A flood of requests with bodies (one token's claims of a
megabyte each, say) must not take the process's CPU and memory from its
heartbeats. So bodies wait in memory within a budget per process (32 MB;
past it, in a spool file), and a process is overloaded when 4 bodies per
thread are on their way (that did not come in one read, for less than a
second: slow ones do not count), when the budget is spent, or when 64
requests per thread wait for a thread and the oldest for half a second. Then
a new request other than a lease call or a health check is answered 503 as
soon as its head is read, its body never read. In one round of the loop,
everything but the reading of bodies comes first, and the loop gives the GIL
up at every socket call, so threads hand it back after 1 ms, not Python's 5.

**Room for new connections.** Parked claims, idle kept-alive connections and
requests still arriving all count against gunicorn's ``worker_connections``
(1,000), and a process at that count stopped accepting: 1,000 parked claims
from one token took it offline. Here a process keeps a tenth of them
(``worker_connections // 10``, at least twice the threads) free for new
connections whatever the clients hold: when a new connection would eat into
that headroom, it closes, in this order, the oldest idle kept-alive
connection (its client reconnects at no cost), of the requests arriving for
over a second the one that sent the fewest bytes a second (a slow client, or
a hostile one: a large upload keeps sending), then the oldest parked claim
(answered ``204`` at once, as if its wait were over: its worker simply claims
again). Requests being served, waiting for a thread or arriving
for less than a second are never closed: they end soon, and new connections
use the headroom meanwhile. Whatever the number of tokens an attacker holds,
heartbeats and pages always find a connection.

**Long-poll claims** (``{"wait_seconds": N}``, ``api/waiter.py``): the claim
view tries once on a thread; if nothing is claimable it parks the request,
and this worker keeps the connection in its event loop (no thread, no
database connection) with the 204 the view answered and the claim's parsed
parameters (``api.waiter.ClaimRequest``: a few numbers, never the body).
While any claim is parked, a probe asks the database how many jobs claims
could take, once per ``RECALL_LONG_POLL_PROBE_SECONDS`` for the whole server:
the processes share the answer through a locked file in Recall's private run
directory (``recall_site/rundir.py``), which each reads when it turns old; the
first to get the lock asks again, and one that finds work nudges the others (a
datagram to each one's socket beside the file) to read it at once. Then one
thread per process claims for that many of its parked claims, oldest first,
one after another (``api.worker_views.claims_for_waiting``: the view's authentication
and claim, without the HTTP and middleware work again), and answers each 200
as soon as it has its job; when a claim finds nothing, the rest wait on. A
claim whose wait is over gets its kept 204; one whose client hung up is
dropped. A stopping worker answers all of them at once. Nothing is sent per
transition (no ``NOTIFY``): the probe is the only cost, and only while someone
waits.

Everything here except ``handle``, ``_serve``, ``_run_again``,
``_answer_held``, ``_claim_for`` and ``_probe`` (run on the pool's threads)
runs on the worker's main thread (the accept and completion callbacks of
gunicorn's event loop), so the counts, queues and the parked set need no lock.
TLS and HTTP/2 in gunicorn itself are not supported (terminate TLS in a
proxy): the loop reads plain HTTP/1.x.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import heapq
import io
import itertools
import json
import math
import os
import re
import selectors
import shutil
import socket
import struct
import sys
import time
from collections import deque
from datetime import datetime
from functools import partial

from gunicorn import glogging, util
from gunicorn.http import wsgi
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn
from gunicorn.workers.gthread import ThreadWorker as StockThreadWorker

from api.waiter import KEEP_WAITING, WAITER_KEY, Waiter
from recall_site import rundir
from recall_site.request_reading import (
    Limits,
    OneRequest,
    Reading,
    Refusal,
    busy,
    timed_out,
)

PROBE_FILE_PREFIX = "long-poll-"
METRICS_DIR_PREFIX = "metrics-"

# Requests that keep leases alive, end them or report health: they go first, and one
# thread of each process is kept for them.
URGENT_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/api/v1/heartbeat", "/api/v1/complete"}
)
URGENT_PREFIX = "/api/v1/jobs/"
# A request still arriving after this long may be closed (after idle
# connections, the slowest first) when a process needs room for connections.
SLOW_SECONDS = 1.0
# A process is overloaded (a new request other than lease calls and health is
# answered 503 as soon as its head is read, its body never read) when
# BODIES_PER_THREAD per thread have a body on its way that did not come in one
# read, when its budget for bodies in memory is spent, or when
# WAITING_PER_THREAD per thread wait for a thread and the oldest of them has
# waited SHED_AFTER_SECONDS. A burst of small requests that the threads clear
# is not shed; a flood of bodies is, cheaply.
BODIES_PER_THREAD = 4
WAITING_PER_THREAD = 64
SHED_AFTER_SECONDS = 0.5
# One that waited this long for a thread is answered 503 (its client retries,
# likely on another process): no request waits behind long ones for long.
QUEUE_SECONDS = 5.0
# A process with no thread free looks at the listening socket's backlog this
# often, and takes the connections that waited there through one look: no
# process with a free thread took them (all are busy), and a connection held
# here can be put behind a heartbeat, one in the kernel's backlog cannot.
BACKLOG_LOOK_SECONDS = 0.02
# How often timeouts are looked at (their precision).
REAP_SECONDS = 0.25
# How long a closed connection may linger, draining what its client sends,
# and how much it may drain (gunicorn's close_graceful does the same, blocking).
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024
# The loop reads into one buffer of this size: a large body in few reads (each
# read gives the GIL up, and getting it back from busy threads can take a
# switch interval), no allocation per read.
RECV_BYTES = 1024 * 1024
# How long a thread keeps the GIL while another wants it (Python's default is
# 5 ms): the event loop gives it up at every socket call, and with the threads
# busy parsing it waited that long each time, hundreds of times a second.
SWITCH_INTERVAL = 0.001
HEAD_BYTES = 64 * 1024
# A response's first part up to this size goes out with its head, in one send.
JOIN_BYTES = 64 * 1024
# The most a probe answer holds (its time, its count, the requirements of up
# to PROBE_BATCHES batches and the expired leases' of at most 16 labels each).
ANSWER_BYTES = 1024 * 1024


def probe_file(master_pid: int, directory: str | None = None) -> str:
    """The file where one server's processes share their probe's answer."""
    return os.path.join(directory or rundir.path(), f"{PROBE_FILE_PREFIX}{master_pid}")


def read_answer(shared) -> tuple[float, int, list | None]:
    """The probe answer in the open file ``shared``: (``time.monotonic()`` when
    it was asked, how many claims may find work, the requirements of the
    batches that work is in); (0, 0, None) if there is none. None for the
    requirements: not known (any waiting claim may find work)."""
    last = os.pread(shared.fileno(), ANSWER_BYTES, 0).split(maxsplit=2)
    if len(last) < 2:
        return 0.0, 0, None
    requires = None
    if len(last) == 3:
        with contextlib.suppress(ValueError):
            requires = json.loads(last[2])
    return float(last[0]), int(last[1]), requires


def nudge_socket(master_pid: int, pid: int | str, directory: str | None = None) -> str:
    """The datagram socket where a process of the server hears that another's
    probe found work."""
    return f"{probe_file(master_pid, directory)}-{pid}.sock"


def metrics_dir(master_pid: int, directory: str | None = None) -> str:
    """A server's own request-metrics directory (unless PROMETHEUS_MULTIPROC_DIR
    names another)."""
    return os.path.join(directory or rundir.path(), f"{METRICS_DIR_PREFIX}{master_pid}")


def remove_leftovers(directory: str | None = None) -> list[str]:
    """Remove the probe files, nudge sockets and metrics directories of servers
    whose master is no longer running (a master killed outright never ran
    ``on_exit``); return their paths. A master that still runs keeps its own."""
    removed = []
    directory = directory or rundir.path()
    for path in glob.glob(os.path.join(glob.escape(directory), "*")):
        name = os.path.basename(path)
        named = re.fullmatch(
            rf"(?:{PROBE_FILE_PREFIX}(\d+)(?:-\d+\.sock)?|{METRICS_DIR_PREFIX}(\d+))",
            name,
        )
        if named is None or _running(int(named[1] or named[2])):
            continue
        with contextlib.suppress(FileNotFoundError):
            if named[2] is not None:
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def free_large_allocations(threshold: int = 256 * 1024) -> bool:
    """Make glibc's malloc serve allocations of ``threshold`` bytes or more
    with their own memory maps, given back to the system when freed.

    A request with a large body passes through a few copies of it on its
    thread (Django reads it, JSON decodes it). glibc raises its threshold for
    such maps as it sees large blocks freed, and then serves them from each
    thread's heap, which it keeps: 20 claims of 5 MB left a process 95 MB
    larger for good after they were answered or parked. A fixed threshold
    keeps the process's size to what it holds. False where the C library is
    not glibc (nothing is changed)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    m_mmap_threshold = -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, threshold))


def accept_queue(listener) -> int | None:
    """How many connections wait in ``listener``'s accept queue (Linux's
    TCP_INFO on a listening socket), or None where that is unknown."""
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        return struct.unpack_from("I", info, 24)[0]  # tcpi_unacked
    except (OSError, AttributeError, struct.error):
        return None


class _Gathered:
    """Stands in for a response's socket while its head and first part are
    written: keeps what gunicorn sends, to send it in one piece."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.parts.append(data)


class Response(wsgi.Response):
    """gunicorn's response, with its head sent in the same piece as the first
    part of its body (up to ``JOIN_BYTES`` of it).

    gunicorn sends the head in a write of its own, and on its sockets
    (``TCP_NODELAY``) that is a packet of its own: a worker API answer, a head
    and a few hundred bytes of JSON, took two system calls here (each giving
    the GIL up and taking it back) and went to its client in two packets. The
    bytes on the wire are the same."""

    def write(self, arg):
        if self.headers_sent or not isinstance(arg, bytes) or len(arg) > JOIN_BYTES:
            super().write(arg)
            return
        sock, gathered = self.sock, _Gathered()
        self.sock = gathered
        try:
            super().write(arg)
        finally:
            self.sock = sock
        sock.sendall(b"".join(gathered.parts))


def urgent(path: str) -> bool:
    """Whether a request for ``path`` goes ahead of the others."""
    return path in URGENT_PATHS or path.startswith(URGENT_PREFIX)


class Connection(TConn):
    """A client connection, with what the event loop knows of it."""

    def __init__(self, cfg, sock, client, server) -> None:
        super().__init__(cfg, sock, client, server)
        self.reading: Reading | None = None  # the request arriving now
        self.requests = 0  # requests read on it so far
        self.deadline = math.inf  # of its current wait (idle, arriving, lingering)
        self.since = 0.0  # when its current request started to arrive
        self.queued = 0.0  # when it started to wait for a thread
        # Closed by this process: an event of the same round may still name it.
        self.closed = False
        self.urgent = False  # its current request goes ahead of the others
        self.leftover = b""  # bytes after its current request (pipelined)
        self.drained = 0  # bytes drained while it lingers


class Held:
    """A parked request: what is needed to run it again or answer it. Nothing
    of its body: the request's source is closed when it parks, and the
    environ keeps its plain values only (the headers, for the access log and
    the token)."""

    def __init__(self, req, resp, environ, chunks: list[bytes], started) -> None:
        self.req, self.resp, self.chunks, self.started = req, resp, chunks, started
        self.environ = {k: v for k, v in environ.items() if isinstance(v, str)}


class ThreadWorker(StockThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0  # work submitted to the thread pool and not finished
        self.parked: dict = {}  # connection -> Waiter, oldest first
        self.deadlines: list = []  # heap of (deadline, n, connection, waiter)
        self.sequence = itertools.count()
        self.probing = False
        self.next_probe = 0.0  # this process asks the database no sooner
        self.next_look = 0.0  # when to read the server's shared answer again
        self.answer_seen = 0.0  # the time of the last shared answer acted on
        # The last shared answer read (time, found, requirements).
        self.answer: tuple[float, int, list | None] = (0.0, 0, None)
        self.wake_budget = 0  # claims the last probe said could find work
        # The requirements of the batches that work is in (None: unknown): only
        # parked claims whose labels serve one of them are woken.
        self.wake_requires: list | None = None
        self.claiming = False  # a thread is claiming for woken parked claims
        self.failure_logged = {"probe": -math.inf, "claim": -math.inf}
        self.shared = None  # the server's probe answer file, opened on first use
        # The read stage: connections by what they wait for, oldest first.
        self.idle: dict = {}  # kept alive, waiting for their next request
        self.arriving: dict = {}  # a request on its way
        self.lingering: dict = {}  # closed by us, draining what their client sends
        self.ready: deque = deque()  # whole requests waiting for a thread
        self.ready_urgent: deque = deque()  # the same, going first
        self.young_bodies = 0  # bodies on their way for less than SLOW_SECONDS
        self.young: deque = deque()  # (when its head came, Reading), oldest first
        self.threads = self.cfg.threads
        self.most_bodies = BODIES_PER_THREAD * self.threads
        self.most_waiting = WAITING_PER_THREAD * self.threads
        self.next_reap = 0.0
        self.next_backlog_look = 0.0
        self.stopped_listening = False
        self.backlog_seen: dict = {}  # listener -> connections in it at the last look
        self.limits: Limits | None = None
        self.client_timeout = 10.0
        self.headroom = max(2 * self.cfg.threads, self.worker_connections // 10)
        self.inbox = bytearray(RECV_BYTES)
        self.reserved = 1 if self.cfg.threads > 1 else 0  # threads kept for urgent

    @classmethod
    def check_config(cls, cfg, log):
        super().check_config(cfg, log)
        if cfg.is_ssl or "h2" in cfg.http_protocols:
            raise RuntimeError(
                "recall_site.gunicorn_worker reads plain HTTP/1.x only: terminate "
                "TLS (and HTTP/2) in a reverse proxy in front of gunicorn."
            )

    # --- Reading requests in the event loop ---------------------------------------

    def accept(self, listener):
        """Take the connections waiting in the backlog (while this process may
        listen), and start reading their first request."""
        self._accept_from(listener, 64, listening=True)

    def _accept_from(self, listener, most: int, *, listening: bool) -> None:
        for _ in range(most):
            if self.nr_conns >= self.worker_connections:
                break
            if listening and not self._may_listen():
                break
            try:
                sock, client = listener.accept()
            except OSError as error:
                if error.errno not in (
                    errno.EAGAIN,
                    errno.ECONNABORTED,
                    errno.EWOULDBLOCK,
                    errno.EMFILE,
                    errno.ENFILE,
                ):
                    raise
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    self.log.warning("accept: %s (file descriptors)", error)
                break
            self.nr_conns += 1
            conn = Connection(self.cfg, sock, client, listener.getsockname())
            self._read(conn, b"")
            self._make_room()
        self._update()

    def _drain_backlog(self) -> None:
        """Not listening (no thread free): take what waited in the kernel's
        backlog through one look, nobody with a free thread having taken it."""
        now = time.monotonic()
        if self._accepting or not self.alive or now < self.next_backlog_look:
            return
        self.next_backlog_look = now + BACKLOG_LOOK_SECONDS
        for listener in self.sockets:
            waiting = accept_queue(listener)
            if waiting is None:
                continue  # unknown (not TCP on Linux): only a free thread listens
            before, self.backlog_seen[listener] = (
                self.backlog_seen.get(listener, 0),
                waiting,
            )
            if waiting and before:
                self._accept_from(listener, min(waiting, before), listening=False)

    def _read(self, conn: Connection, buffered: bytes) -> None:
        """Read ``conn``'s next request in the loop; ``buffered``: what came
        with the one before (pipelined)."""
        assert self.limits is not None
        conn.requests += 1
        conn.reading = Reading(self.cfg, conn.client, self.limits, conn.requests)
        now = time.monotonic()
        if conn.requests > 1 and not buffered:
            conn.deadline = now + self.cfg.keepalive
            if not self.alive:
                conn.deadline = min(conn.deadline, now + STOP_KEEPALIVE_LINGER)
            self.idle[conn] = None
        else:
            self._arriving(conn, now)
        conn.sock.setblocking(False)
        self.poller.register(
            conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn)
        )
        if buffered:
            self._received(conn, buffered)

    def _arriving(self, conn: Connection, now: float) -> None:
        """``conn``'s request starts to arrive: it has the client timeout."""
        conn.since, conn.deadline = now, now + self.client_timeout
        conn.urgent = False
        self.arriving[conn] = None

    def _on_readable(self, conn: Connection, sock) -> None:
        if conn.closed:
            return
        # A head is read 64 KiB at a time: a request shed as soon as its head
        # is read leaves the rest of its body unread.
        size = RECV_BYTES if conn.reading and conn.reading.in_body else HEAD_BYTES
        try:
            got = conn.sock.recv_into(self.inbox, size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        data = memoryview(self.inbox)[:got]
        if not got:  # the client hung up (or reset): nothing to answer
            self._close(conn, linger=False)
            self._update()
            return
        if conn in self.idle:
            del self.idle[conn]
            self._arriving(conn, time.monotonic())
        self._received(conn, data)

    def _received(self, conn: Connection, data: bytes) -> None:
        reading = conn.reading
        assert reading is not None
        had_head = reading.parser is not None
        try:
            whole = reading.feed(data)
        except Refusal as refusal:
            self._refuse(conn, refusal.response())
            self._update()
            return
        if not had_head and reading.parser is not None:
            req = reading.parser.mesg
            conn.urgent = req is not None and urgent(req.path)
            if not conn.urgent and self._overloaded():
                # Shed before reading its body (closed at once: whatever of it
                # is on its way costs nothing more).
                self._refuse(conn, busy(req.path if req else "/"), linger=False)
                self._update()
                return
            if not conn.urgent and reading.in_body:
                reading.young = True  # a body on its way, counted as waiting
                self.young_bodies += 1
                self.young.append((time.monotonic(), reading))
        if reading.send_continue:
            reading.send_continue = False
            with contextlib.suppress(OSError):
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if whole:
            self._whole(conn)
        elif reading.in_body:
            # A body may take long, but never stop for the client timeout.
            conn.deadline = time.monotonic() + self.client_timeout

    def _whole(self, conn: Connection) -> None:
        """``conn``'s request is read: queue it for a thread."""
        reading = conn.reading
        assert reading is not None and reading.parser is not None
        self._forget(conn)
        self._grown(reading)
        conn.parser = reading.parser
        conn.leftover = reading.leftover
        conn.reading = None
        conn.data_ready = True  # gunicorn's handler must not wait for data
        if not conn.urgent and self._overloaded():
            self._refuse(conn, busy(self._path(conn)))
            return
        conn.queued = time.monotonic()
        (self.ready_urgent if conn.urgent else self.ready).append(conn)
        self._update()

    @staticmethod
    def _path(conn: Connection) -> str:
        """The path of ``conn``'s request read in full (for the 503's kind)."""
        req = conn.parser.mesg if isinstance(conn.parser, OneRequest) else None
        return req.path if req is not None else "/"

    def _overloaded(self) -> bool:
        """Too many bodies on their way since less than ``SLOW_SECONDS`` (a slow
        body, hostile or not, does not count: a few slow clients would shed
        everyone's requests), the memory for bodies spent, or too many
        requests waiting for a thread, for too long. Load shedding: a request
        shed costs its client a retry, and the server nothing more. Lease
        calls and health checks are never shed."""
        now = time.monotonic()
        while self.young and self.young[0][0] < now - SLOW_SECONDS:
            self._grown(self.young.popleft()[1])  # slow now, or whole already
        assert self.limits is not None
        if self.young_bodies >= self.most_bodies or self.limits.memory.spent:
            return True
        return (
            len(self.ready) >= self.most_waiting
            and self.ready[0].queued < now - SHED_AFTER_SECONDS
        )

    def _grown(self, reading: Reading) -> None:
        """``reading``'s body is no longer a young one (whole, dropped, slow)."""
        if reading.young:
            reading.young = False
            self.young_bodies -= 1

    def _refuse(self, conn: Connection, response: bytes, *, linger=True) -> None:
        """Answer what the loop refuses itself (a timeout, a head or chunked
        body too large, an overload) and close."""
        with contextlib.suppress(OSError):
            conn.sock.send(response)
        self._close(conn, linger=linger)

    def _forget(self, conn: Connection) -> None:
        """Stop watching ``conn`` in the read stage (it is queued, served,
        parked or closed)."""
        self.idle.pop(conn, None)
        self.arriving.pop(conn, None)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)

    def _close(self, conn: Connection, *, linger: bool = True) -> None:
        """Close ``conn``. ``linger``: after an answer, half-close it and drain
        what the client still sends for up to ``LINGER_SECONDS`` (RFC 9112
        9.6: closing with unread data would reset the connection and could
        lose the answer), in the loop, never blocking it."""
        self._forget(conn)
        conn.closed = True
        if conn.reading is not None:
            self._grown(conn.reading)
            conn.reading.close()
            conn.reading = None
        self._release(conn)
        self.nr_conns -= 1
        if linger:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
                conn.sock.setblocking(False)
                self.poller.register(
                    conn.sock, selectors.EVENT_READ, partial(self._on_lingering, conn)
                )
            except (OSError, ValueError):
                conn.close()
                return
            conn.deadline, conn.drained = time.monotonic() + LINGER_SECONDS, 0
            self.lingering[conn] = None
            while len(self.lingering) > self.headroom:  # never more than that
                self._end_linger(next(iter(self.lingering)))
        else:
            conn.close()

    def _on_lingering(self, conn: Connection, sock) -> None:
        if conn not in self.lingering:
            return  # its time was up in the same round
        try:
            got = conn.sock.recv_into(self.inbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        conn.drained += got
        if not got or conn.drained >= LINGER_BYTES:
            self._end_linger(conn)

    def _end_linger(self, conn: Connection) -> None:
        self.lingering.pop(conn, None)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)
        conn.close()

    def _release(self, conn: Connection) -> None:
        """Let go of the body of ``conn``'s last request (memory, spool file)."""
        if isinstance(conn.parser, OneRequest):
            conn.parser.source.close()

    def _reap(self, force: bool = False) -> None:
        """Drop what waited too long: idle connections past ``keepalive``,
        requests past the client timeout (answered 408 if any byte came),
        lingering closes past their time; everything when ``force``."""
        now = time.monotonic()
        if not force and now < self.next_reap:
            return
        self.next_reap = now + REAP_SECONDS
        for conn in list(self.idle):
            if not self.alive:
                conn.deadline = min(conn.deadline, now + STOP_KEEPALIVE_LINGER)
            if force or conn.deadline <= now:
                self._close(conn, linger=False)
        for conn in list(self.arriving):
            reading = conn.reading
            if not self.alive and not (reading is not None and reading.started):
                # Stopping: a connection that sent nothing gets what idle ones get.
                conn.deadline = min(conn.deadline, now + STOP_KEEPALIVE_LINGER)
            if force or conn.deadline <= now:
                if reading is not None and reading.started and not force:
                    self._refuse(conn, timed_out())
                else:
                    self._close(conn, linger=False)
        for conn in list(self.lingering):
            if force or conn.deadline <= now:
                self._end_linger(conn)
        while self.ready and (force or self.ready[0].queued < now - QUEUE_SECONDS):
            waited = self.ready.popleft()  # served elsewhere, or later
            self._refuse(waited, busy(self._path(waited)))
        self._update()

    def murder_keepalived(self, force=False):
        # gunicorn's loop calls this after every wait: the read stage's timeouts.
        self._reap(force)

    def murder_pending(self):
        pass  # no connection waits for a thread before its request is read

    # --- Room for new connections ------------------------------------------------

    def _make_room(self) -> None:
        """Keep ``headroom`` connections free for new ones: close or answer,
        oldest first, idle connections, slow requests, then parked claims (see
        the module's docstring). Requests that are being served, waiting for a
        thread or arriving since less than ``SLOW_SECONDS`` are left alone:
        they end soon (or turn slow), and new ones use the headroom meanwhile."""
        limit = self.worker_connections - self.headroom
        while self.nr_conns > limit:
            slowest = None if self.idle else self._slowest()
            if self.idle:
                self._close(next(iter(self.idle)), linger=False)
            elif slowest is not None and not self._unread(slowest):
                self._close(slowest, linger=False)
            elif self.parked:  # (a slowest with bytes unread is this loop's delay)
                self._answer_early(next(iter(self.parked)))
            else:
                return

    def _slowest(self) -> Connection | None:
        """Of the requests arriving for over ``SLOW_SECONDS``, the one that sent
        the fewest bytes per second (a slow upload's bytes keep coming; a
        hostile trickle's do not)."""
        now = time.monotonic()
        slowest, rate = None, math.inf
        for conn in self.arriving:
            if conn.since > now - SLOW_SECONDS:
                break  # the rest came later still
            received = conn.reading.received if conn.reading is not None else 0
            if received / (now - conn.since) < rate:
                slowest, rate = conn, received / (now - conn.since)
        return slowest

    @staticmethod
    def _unread(conn: Connection) -> bool:
        """Whether the client sent bytes this loop has not read yet."""
        try:
            return bool(conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:
            return False

    def _answer_early(self, conn: Connection) -> None:
        """Answer a parked claim now with its kept 204 (as if its wait were
        over), on the loop (a few hundred bytes to a socket that took the whole
        request), and close its connection."""
        waiter = self._unpark(conn)
        waiter.done()  # answered: no longer one of its worker's waiting claims
        held = waiter.held
        held.resp.force_close()
        try:
            conn.sock.setblocking(False)
            self._send_kept(waiter)
        except OSError:
            pass  # its client is gone, or not reading: closed all the same
        self._close(conn)

    def _send_kept(self, waiter: Waiter) -> None:
        """Send a parked claim the 204 its view answered (and count it)."""
        held = waiter.held
        try:
            for chunk in held.chunks:
                held.resp.write(chunk)
            held.resp.close()
            if waiter.on_answer is not None:
                waiter.on_answer()
        finally:
            self.log.access(
                held.resp, held.req, held.environ, datetime.now() - held.started
            )

    # --- Threads and listening ----------------------------------------------------

    def _update(self) -> None:
        """Give waiting requests the free threads, then listen or not."""
        threads = self.threads
        while self.busy < threads:
            if self.ready_urgent:
                conn = self.ready_urgent.popleft()
            elif self.ready and self.busy < threads - self.reserved:
                conn = self.ready.popleft()
            else:
                break
            self.enqueue_req(conn)
        self._listen()

    def enqueue_req(self, conn):
        self.busy += 1
        super().enqueue_req(conn)

    def finish_request(self, conn, fs):
        self.busy -= 1
        result = None if fs.cancelled() or fs.exception() else fs.result()
        if isinstance(result, Waiter):
            self._park(conn, result)
        else:
            self._after(conn, bool(result))
        self._wake()
        self._update()

    def _after(self, conn: Connection, keepalive: bool) -> None:
        """``conn``'s request was answered: read its next one, or close it."""
        self._release(conn)
        leftover, conn.leftover = conn.leftover, b""
        if keepalive and (self.alive or leftover):
            self._read(conn, leftover)
        else:
            self._close(conn)

    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled and self._may_listen())
        if not enabled and not self.alive and not self.stopped_listening:
            self._stop_listening()

    def _stop_listening(self) -> None:
        """Stopping: serve what already waits in the kernel's backlog, then
        close this process's copy of the listening sockets at once, not after
        the graceful timeout. Once every process of the server has (the
        master closes its own first), a new connection is refused instead of
        queued, and a proxy passes it to another node; one left queued would
        be reset when the socket closed, after the proxy had sent its request
        (nginx answers 502 and does not send a POST again). A graceful reload
        keeps the socket open in the master and the new processes."""
        self.stopped_listening = True
        for listener in self.sockets:
            listener.setblocking(False)
            self._accept_from(listener, self.worker_connections, listening=False)
            listener.close()

    def _may_listen(self) -> bool:
        """A thread other than the one kept for lease calls is free."""
        return self.busy < self.threads - self.reserved

    def _listen(self):
        if self.alive:
            self.set_accept_enabled(self.nr_conns < self.worker_connections)

    def _submit(self, conn, work, *args):
        """Run ``work(*args)`` on a thread; its result finishes ``conn``'s request."""
        self.busy += 1
        fs = self.tpool.submit(work, *args)
        fs.add_done_callback(
            lambda fut: self.method_queue.defer(self.finish_request, conn, fut)
        )
        self._listen()

    # --- Serving a request (on a thread) ----------------------------------------

    def handle_request(self, req, conn):
        stamp, found, _ = self.answer
        quiet = found == 0 and time.monotonic() - stamp < self._probe_interval()
        return self._serve(req, conn, Waiter(quiet=quiet))

    def _keepalive_after(self, conn, keepalive):
        if isinstance(keepalive, Waiter):
            return keepalive  # parked: the request is not answered yet
        return super()._keepalive_after(conn, keepalive)

    def _serve(self, req, conn, waiter: Waiter):
        """gunicorn's ``handle_request`` with a waiter in the environ: the view
        may park the request, and then nothing is sent and the waiter is
        returned. A parked request runs here again on its kept parameters
        (``ClaimRequest.body()``: the body it had, less what the claim ignores)."""
        environ: dict = {}
        resp = None
        again = waiter.held is not None
        try:
            if not again:
                self.cfg.pre_request(self, req)
            started = waiter.held.started if again else datetime.now()
            resp, environ = wsgi.create(
                req, conn.sock, conn.client, conn.server, self.cfg, Response
            )
            environ["wsgi.multithread"] = True
            environ[WAITER_KEY] = waiter
            if again:
                body = waiter.claim.body() if waiter.claim is not None else b""
                environ["wsgi.input"] = io.BytesIO(body)
                environ["CONTENT_LENGTH"] = str(len(body))
                environ["CONTENT_TYPE"] = "application/json"
            else:
                self.nr += 1
                if self.nr >= self.max_requests:
                    if self.alive:
                        self.log.info("Autorestarting worker after current request.")
                        self.alive = False
                    resp.force_close()
            if not self.alive or not self.cfg.keepalive:
                resp.force_close()

            waiter.parked = False
            respiter = self.wsgi(environ, resp.start_response)
            try:
                if waiter.parked:
                    waiter.held = Held(req, resp, environ, list(respiter), started)
                    self._release(conn)  # nothing of the body stays
                    return waiter
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                if not waiter.parked:
                    self.log.access(resp, req, environ, datetime.now() - started)
                if hasattr(respiter, "close"):
                    respiter.close()
            if resp.should_close():
                self.log.debug("Closing connection.")
                return False
        except OSError:
            waiter.parked = False  # the connection is closed: it waits no more
            util.reraise(*sys.exc_info())
        except (Exception, SystemExit):
            waiter.parked = False
            if resp and resp.headers_sent:
                self.log.exception("Error handling request")
                util.close_graceful(conn.sock)
                raise StopIteration() from None
            raise
        finally:
            if not waiter.parked:
                waiter.done()  # answered: no longer one of its worker's waiting
                try:
                    self.cfg.post_request(self, req, environ, resp)
                except Exception:
                    self.log.exception("Exception in post_request hook")
        return True

    def _run_again(self, conn, waiter: Waiter):
        """A woken claim the view must answer itself (its worker was refused):
        run the request again."""
        waiter.parked = False
        try:
            return self._guarded(
                conn,
                waiter.held.req,
                lambda: self._keepalive_after(
                    conn, self._serve(waiter.held.req, conn, waiter)
                ),
            )
        finally:
            if not waiter.parked:  # answered, or its connection failed first
                waiter.done()

    def _answer_held(self, conn, waiter: Waiter):
        """A parked claim whose wait is over: send the 204 its view answered."""
        waiter.done()

        def send():
            self._send_kept(waiter)
            return self._keepalive_after(conn, not waiter.held.resp.should_close())

        return self._guarded(conn, waiter.held.req, send)

    def _guarded(self, conn, req, work):
        """``work()`` with the error handling of gunicorn's ``handle``."""
        try:
            conn.sock.setblocking(True)
            return work()
        except StopIteration as e:
            self.log.debug("Closing connection. %s", e)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("Socket error processing request.")
        except Exception as e:
            self.handle_error(req, conn.sock, conn.client, e)
        return False

    # --- Parked claims (on the main thread) -------------------------------------

    def _park(self, conn, waiter: Waiter, *, first: bool = False):
        """Hold ``conn``'s claim; ``first``: ahead of the others (its turn to be
        woken was not over)."""
        if not self.alive:
            self._submit(conn, self._answer_held, conn, waiter)
            return
        conn.sock.setblocking(False)
        if first:
            self.parked = {conn: waiter, **self.parked}
        else:
            self.parked[conn] = waiter
        deadline = -math.inf if waiter.deadline is None else waiter.deadline
        heapq.heappush(self.deadlines, (deadline, next(self.sequence), conn, waiter))
        self.poller.register(
            conn.sock, selectors.EVENT_READ, partial(self._on_parked_readable, conn)
        )

    def _unpark(self, conn) -> Waiter:
        waiter = self.parked.pop(conn)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)  # unless the client sent more
        return waiter

    def _on_parked_readable(self, conn, sock):
        """The client of a parked claim hung up (or sent more, which waits)."""
        if conn not in self.parked:
            return  # answered early in the same round
        try:
            gone = conn.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError):
            gone = True
        if gone:
            self._unpark(conn).done()
            self._close(conn, linger=False)
            self._update()
            return
        # A pipelined request: it is read after this claim is answered.
        self.poller.unregister(conn.sock)

    def run(self):
        from django.conf import settings  # the application is loaded by now

        sys.setswitchinterval(SWITCH_INTERVAL)
        self.limits = Limits.from_settings(rundir.path())
        self.client_timeout = settings.RECALL_CLIENT_TIMEOUT_SECONDS
        nudges = self._listen_for_nudges()
        try:
            super().run()
        finally:
            if nudges is not None:
                nudges.close()
                with contextlib.suppress(OSError):
                    os.remove(nudge_socket(self.ppid, self.pid))

    def _listen_for_nudges(self) -> socket.socket | None:
        """This process's nudge socket, or None if it cannot have one (a
        temporary directory whose path is too long for a socket, say): then
        it learns of another's probe when the answer turns old, up to one
        probe interval later."""
        path = nudge_socket(self.ppid, self.pid)
        nudges = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # a socket left by an earlier process of this pid
            nudges.bind(path)
        except OSError as error:
            nudges.close()
            self.log.warning("long-poll: no nudge socket at %s (%r)", path, error)
            return None
        nudges.setblocking(False)
        self.poller.register(nudges, selectors.EVENT_READ, self._on_nudge)
        return nudges

    def _on_nudge(self, sock):
        """Another process's probe found work: read its answer now."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                sock.recv(16)
        if self.parked:
            self._look()

    def _nudge_others(self) -> None:
        """Tell the server's other processes that the shared answer found work
        (on the probing thread). A socket no process listens on any more (one
        killed) is removed."""
        own = nudge_socket(self.ppid, self.pid)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.setblocking(False)
        with sender:
            for path in glob.glob(glob.escape(probe_file(self.ppid)) + "-*.sock"):
                if path == own:
                    continue
                try:
                    sender.sendto(b"!", path)
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                except (BlockingIOError, OSError):
                    pass  # its queue is full: it has been nudged already

    def wait_for_and_dispatch_events(self, timeout):
        now = time.monotonic()
        if self.parked:
            soonest = self._soonest_deadline(now)
            soonest = min(soonest, self.next_look)
            timeout = min(timeout, max(soonest - now, 0.0))
        if self.idle or self.arriving or self.lingering or self.ready:
            timeout = min(timeout, max(self.next_reap - now, 0.0))
        if not self._accepting and self.alive:
            timeout = min(timeout, max(self.next_backlog_look - now, 0.0))
        self._dispatch_events(timeout)
        self._drain_backlog()
        if self.parked:
            self._tend_parked()

    def _dispatch_events(self, timeout: float) -> None:
        """gunicorn's select-and-dispatch, with bodies last: in one round,
        what is not the bulk of a body (new connections, heads, the threads'
        results) is handled before the bodies' reads, so that a heartbeat that
        came with many bodies is read first."""
        try:
            events = self.poller.select(timeout)
        except OSError as error:
            if error.errno != errno.EINTR:
                raise
            return
        bodies = []
        for key, _ in events:
            callback = key.data
            if isinstance(callback, partial) and callback.func == self._on_readable:
                reading = callback.args[0].reading
                if reading is not None and reading.in_body:
                    bodies.append((callback, key.fileobj))
                    continue
            callback(key.fileobj)
        for callback, fileobj in bodies:
            callback(fileobj)

    def _soonest_deadline(self, now: float) -> float:
        """The soonest end of a parked claim's wait (the heap's stale entries,
        claims answered or parked again since, are dropped on the way)."""
        while self.deadlines:
            deadline, _, conn, waiter = self.deadlines[0]
            if self.parked.get(conn) is waiter:
                return deadline
            heapq.heappop(self.deadlines)
        return math.inf

    def _tend_parked(self):
        """Answer the claims whose wait is over (all of them when stopping), and
        look at the server's probe answer when it is time."""
        now = time.monotonic()
        if not self.alive:
            over = list(self.parked)
        else:
            over = []
            while self._soonest_deadline(now) <= now:
                _, _, conn, _ = heapq.heappop(self.deadlines)
                if conn not in over:  # parked again with the same waiter
                    over.append(conn)
        for conn in over:
            waiter = self._unpark(conn)
            self._submit(conn, self._answer_held, conn, waiter)
        if self.parked and now >= self.next_look:
            self._look()

    def _look(self):
        """Act on the server's newest probe answer, once; start a probe (on a
        thread) when the answer is older than the probe interval, or look
        again when it will be."""
        stamp, found, requires = self.answer = self._shared_answer()
        if stamp > self.answer_seen:
            self.answer_seen = stamp
            self.wake_budget = found
            self.wake_requires = requires
            self._wake()
        now = time.monotonic()
        interval = self._probe_interval()
        if self.probing:
            self.next_look = math.inf  # _probed looks again
            return
        if now - stamp >= interval and now >= self.next_probe:
            self.next_look = math.inf
            self.probing = True
            self.busy += 1
            fs = self.tpool.submit(self._probe)
            fs.add_done_callback(lambda fut: self.method_queue.defer(self._probed, fut))
        else:
            self.next_look = max(stamp + interval, self.next_probe, now + 0.01)

    def _probed(self, fs):
        self.busy -= 1
        self.probing = False
        self.next_probe = time.monotonic() + self._probe_interval()
        if self.parked:
            self._look()
        self._update()

    def _wake(self):
        """Claim for parked claims, oldest first, as many as the last probe
        found work for, among those whose labels serve a batch that work is in
        (``ClaimRequest.serves``): on one thread, one claim after another
        (``api.worker_views.claims_for_waiting``), each answered as soon as it has its
        job. One thread, not one per claim, so that a batch for hundreds of
        waiting workers leaves the other threads free for heartbeats."""
        if self.claiming or self.wake_budget <= 0 or not self.parked:
            return
        # Only claims whose labels serve a batch the work is in: the others
        # could take none of it, and would stand in the way of those that can.
        requires = self.wake_requires
        servable = (
            list(self.parked)
            if requires is None or {} in requires
            else [
                conn
                for conn, waiter in self.parked.items()
                if waiter.claim is None or waiter.claim.serves(requires)
            ]
        )
        woken = [(conn, self._unpark(conn)) for conn in servable[: self.wake_budget]]
        if not woken:
            return
        self.claiming = True
        self.busy += 1
        fs = self.tpool.submit(self._claim_for, woken)
        fs.add_done_callback(
            lambda fut: self.method_queue.defer(self._claimed, woken, fut)
        )

    def _claim_for(self, woken: list) -> dict:
        """On a thread: claim for the ``woken`` parked claims and answer each
        that gets a job, handing its connection back to the main thread at
        once (a client reading to the end must not wait for the others). What
        became of each: True (answered), ``None`` (the full view answers it),
        or nothing (not reached: nothing was left to claim, it waits on)."""
        from django.db import close_old_connections

        from api.worker_views import claims_for_waiting

        outcomes: dict = {}
        close_old_connections()
        try:
            answers = claims_for_waiting(
                (waiter.held.environ.get("HTTP_AUTHORIZATION", ""), waiter.claim)
                for _, waiter in woken
            )
            for (conn, waiter), body in zip(woken, answers, strict=False):
                if body is None:
                    outcomes[conn] = None
                    continue
                if body == KEEP_WAITING:
                    continue  # nothing it can take: it waits on
                waiter.done()  # it has its job: answered, whatever the socket says
                keepalive = self._guarded(
                    conn,
                    waiter.held.req,
                    partial(self._answer_claimed, conn, waiter, body),
                )
                self.method_queue.defer(self._answered, conn, keepalive)
                outcomes[conn] = True
        except Exception as error:
            # A lost database: the claims not answered wait on, and the next
            # probe tries again.
            self._log_failure("claim", error)
        finally:
            close_old_connections()
        return outcomes

    def _answer_claimed(self, conn, waiter: Waiter, body: bytes) -> bool:
        """Send a woken claim its job: a 200 with the JSON ``body`` and the
        headers the view's kept 204 had (the middleware's), on a thread."""
        held = waiter.held
        resp = Response(held.req, conn.sock, self.cfg)
        if held.resp.must_close:
            resp.force_close()
        kept = [
            (name, value)
            for name, value in held.resp.headers
            if name.lower() not in ("content-type", "content-length")
        ]
        resp.start_response(
            "200 OK",
            [
                *kept,
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        try:
            resp.write(body)
            resp.close()
        finally:
            self.log.access(resp, held.req, held.environ, datetime.now() - held.started)
        return self._keepalive_after(conn, not resp.should_close())

    def _answered(self, conn, keepalive: bool):
        """A woken claim was answered: keep its connection alive or close it,
        as gunicorn does after any request."""
        self._after(conn, keepalive)
        self._update()

    def _claimed(self, woken: list, fs):
        """Back on the main thread once the claiming thread is done: hand the
        claims the view must answer to a thread, and park again (first in
        line) the ones not reached."""
        self.busy -= 1
        self.claiming = False
        outcomes = {} if fs.cancelled() or fs.exception() else fs.result()
        for conn, waiter in reversed(woken):
            if conn not in outcomes:
                self._park(conn, waiter, first=True)
            elif outcomes[conn] is None:
                self._submit(conn, self._run_again, conn, waiter)
        if len(outcomes) < len(woken):
            self.wake_budget = 0  # nothing left to claim: others were faster
        else:
            self.wake_budget -= len(woken)
        self._wake()
        self._update()

    def _shared_answer(self) -> tuple[float, int, list | None]:
        """The server's last probe answer: (``time.monotonic()`` when it was
        asked, how many claims may find work, the requirements of the batches
        it is in); (0, 0, None) if there is none or a probe is writing it."""
        if self.shared is None:
            self.shared = open(probe_file(self.ppid), "a+b")  # noqa: SIM115
        try:
            fcntl.flock(self.shared, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0.0, 0, None
        try:
            return read_answer(self.shared)
        finally:
            fcntl.flock(self.shared, fcntl.LOCK_UN)

    def _probe(self) -> None:
        """Ask the database how many parked claims may find work, for the whole
        server (on a thread, with its database connection): under the shared
        file's lock, unless another process just did."""
        with open(probe_file(self.ppid), "a+b") as shared:
            fcntl.flock(shared, fcntl.LOCK_EX)  # released when the file closes
            stamp, _, _ = read_answer(shared)
            if time.monotonic() - stamp < self._probe_interval():
                return
            asked = time.monotonic()
            answer = self._ask_database()
            found = 0
            if answer is not None:
                found, requires = answer
                shared.seek(0)
                shared.truncate()
                shared.write(f"{asked} {found} {json.dumps(requires)}".encode())
        if found:  # the file is closed (written, unlocked): the others read it
            self._nudge_others()

    def _ask_database(self) -> tuple[int, list] | None:
        from django.db import close_old_connections

        from engine.longpoll import claimable_work

        close_old_connections()
        try:
            return claimable_work(self.worker_connections)
        except Exception as error:
            # The waiting claims get their 204 when their wait is over.
            self._log_failure("probe", error)
            return None
        finally:
            close_old_connections()

    def _log_failure(self, what: str, error: Exception) -> None:
        """The database may be down for a while: one line a minute for each."""
        if time.monotonic() - self.failure_logged[what] >= 60:
            self.failure_logged[what] = time.monotonic()
            self.log.warning("long-poll %s failed (%r); trying again", what, error)

    def _probe_interval(self) -> float:
        from django.conf import settings

        return settings.RECALL_LONG_POLL_PROBE_SECONDS


# --- The access log -------------------------------------------------------------

# What gunicorn's own atoms read from the environ (glogging.Logger.atoms).
ATOM_ENVIRON = (
    "REMOTE_ADDR", "REQUEST_METHOD", "RAW_URI", "SERVER_PROTOCOL", "PATH_INFO",
    "QUERY_STRING", "HTTP_REFERER", "HTTP_USER_AGENT", "HTTP_AUTHORIZATION",
)  # fmt: skip


class _Unheaded:
    """A response as the access log's atoms see it, without its headers."""

    headers = ()

    def __init__(self, resp) -> None:
        self.status, self.sent = resp.status, getattr(resp, "sent", None)


class AccessLogger(glogging.Logger):
    """gunicorn's logger, the same lines, for less work per request.

    For each access line gunicorn gathers every atom a format could name, one
    per request header (``{name}i``), response header (``{name}o``) and environ
    variable (``{name}e``) among them, some 70, and copies them all once more,
    escaping quotes: about 110,000 instructions a request, 4.5% of a worker
    API request's in a web worker. A format that names none of those
    (gunicorn's default, Recall's) is given the fixed atoms alone; any other
    gets them all.
    """

    def atoms(self, resp, req, environ, request_time):
        if "{" in self.cfg.access_log_format:
            return super().atoms(resp, req, environ, request_time)
        fixed = {key: environ[key] for key in ATOM_ENVIRON if key in environ}
        return super().atoms(_Unheaded(resp), (), fixed, request_time)
