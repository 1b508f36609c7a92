"""gunicorn's ``gthread`` worker, taking a connection only when it can serve it,
and holding long-poll claims without a thread.

The stock worker accepts connections up to ``worker_connections`` (1,000) and
queues their requests behind its threads. A process whose threads all stream
exports would still accept a worker's heartbeat and make it wait for an export
to end, while another process had threads to spare. This one stops listening
while all its threads are busy: the kernel then hands new connections to a
process that can answer at once, and they wait in the listen backlog only when
every thread of every process is busy.

Long-poll claims (``{"wait_seconds": N}``, ``jobs/waiter.py``): the claim view
tries once on a thread; if nothing is claimable it parks the request, and this
worker keeps the connection in its event loop (no thread, no database
connection) with the 204 the view answered. While any claim is parked, a probe
asks the database how many jobs claims could take, once per
``RECALL_LONG_POLL_PROBE_SECONDS`` for the whole server: the processes share
the answer through a locked file, which each reads when it turns old; the
first to get the lock asks again, and one that finds work nudges the others
(a datagram to each one's socket beside the file) to read it at once. Then
one thread per process claims for that many of its parked claims, oldest
first, one after another
(``jobs.api.claims_for_waiting``: the view's authentication and claim, without
the HTTP and middleware work again), and answers each 200 as soon as it has its
job; when a claim finds nothing, the rest wait on. A claim whose wait is over
gets its kept 204; one whose client hung up is dropped. A stopping worker
answers all of them at once. Nothing is sent per transition (no ``NOTIFY``):
the probe is the only cost, and only while someone waits.

Everything here except ``_serve``, ``_run_again``, ``_answer_held``,
``_claim_for`` and ``_probe`` (run on the pool's threads) runs on the worker's
main thread (the accept and completion callbacks of gunicorn's event loop), so
the counts and the parked set need no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import io
import math
import os
import re
import selectors
import socket
import sys
import tempfile
import time
from concurrent.futures import Future
from datetime import datetime
from functools import partial

from gunicorn import glogging, util
from gunicorn.http import wsgi
from gunicorn.workers.gthread import ThreadWorker as StockThreadWorker

from jobs.waiter import WAITER_KEY, Waiter

PROBE_FILE_PREFIX = "recall-long-poll-"


def probe_file(master_pid: int) -> str:
    """The file where one server's processes share their probe's answer."""
    return os.path.join(tempfile.gettempdir(), f"{PROBE_FILE_PREFIX}{master_pid}")


def read_answer(shared) -> tuple[float, int]:
    """The probe answer in the open file ``shared``: (``time.monotonic()`` when
    it was asked, how many claims may find work); (0, 0) if there is none."""
    last = os.pread(shared.fileno(), 64, 0).split()
    if len(last) != 2:
        return 0.0, 0
    return float(last[0]), int(last[1])


def nudge_socket(master_pid: int, pid: int | str) -> str:
    """The datagram socket where a process of the server hears that another's
    probe found work."""
    return f"{probe_file(master_pid)}-{pid}.sock"


def remove_leftovers() -> list[str]:
    """Remove the probe files and nudge sockets of servers whose master is no
    longer running (a master killed outright never ran ``on_exit``); return
    their paths. A master that still runs, or runs as another user, keeps its
    own."""
    removed = []
    prefix = os.path.join(tempfile.gettempdir(), PROBE_FILE_PREFIX)
    for path in glob.glob(glob.escape(prefix) + "*"):
        named = re.fullmatch(r"(\d+)(-\d+\.sock)?", path[len(prefix) :])
        if named is None or _running(int(named[1])):
            continue
        with contextlib.suppress(FileNotFoundError):
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


class Held:
    """A parked request: what is needed to run it again or answer it."""

    def __init__(self, req, resp, environ, chunks: list[bytes], started) -> None:
        self.req, self.resp, self.environ = req, resp, environ
        self.chunks, self.started = chunks, started


class ThreadWorker(StockThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0  # requests submitted to the thread pool and not finished
        self.parked: dict = {}  # connection -> Waiter, oldest first
        self.probing = False
        self.next_probe = 0.0  # this process asks the database no sooner
        self.next_look = 0.0  # when to read the server's shared answer again
        self.answer_seen = 0.0  # the time of the last shared answer acted on
        self.answer = (0.0, 0)  # the last shared answer read (time, found)
        self.wake_budget = 0  # claims the last probe said could find work
        self.claiming = False  # a thread is claiming for woken parked claims
        self.failure_logged = {"probe": -math.inf, "claim": -math.inf}
        self.shared = None  # the server's probe answer file, opened on first use

    # --- Listening only with a free thread ------------------------------------

    def enqueue_req(self, conn):
        self.busy += 1
        super().enqueue_req(conn)
        self._listen()

    def finish_request(self, conn, fs):
        self.busy -= 1
        result = None if fs.cancelled() or fs.exception() else fs.result()
        if isinstance(result, Waiter):
            self._park(conn, result)
        else:
            super().finish_request(conn, fs)  # may submit the connection's next request
        self._wake()
        self._listen()

    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled and self.busy < self.cfg.threads)

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
        stamp, found = self.answer
        quiet = found == 0 and time.monotonic() - stamp < self._probe_interval()
        return self._serve(req, conn, Waiter(quiet=quiet))

    def _keepalive_after(self, conn, keepalive):
        if isinstance(keepalive, Waiter):
            return keepalive  # parked: the request is not answered yet
        return super()._keepalive_after(conn, keepalive)

    def _serve(self, req, conn, waiter: Waiter):
        """gunicorn's ``handle_request`` with a waiter in the environ: the view
        may park the request, and then nothing is sent and the waiter is
        returned. A parked request runs here again with its kept body."""
        environ: dict = {}
        resp = None
        again = waiter.held is not None
        try:
            if not again:
                self.cfg.pre_request(self, req)
            started = waiter.held.started if again else datetime.now()
            resp, environ = wsgi.create(
                req, conn.sock, conn.client, conn.server, self.cfg
            )
            environ["wsgi.multithread"] = True
            environ[WAITER_KEY] = waiter
            if again:
                environ["wsgi.input"] = io.BytesIO(waiter.body)
            else:
                self.nr += 1
                if self.nr >= self.max_requests:
                    if self.alive:
                        self.log.info("Autorestarting worker after current request.")
                        self.alive = False
                    resp.force_close()
            if (
                not self.alive
                or not self.cfg.keepalive
                or len(self.keepalived_conns) >= self.max_keepalived
            ):
                resp.force_close()

            waiter.parked = False
            respiter = self.wsgi(environ, resp.start_response)
            try:
                if waiter.parked:
                    waiter.held = Held(req, resp, environ, list(respiter), started)
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
            return self._keepalive_after(conn, not held.resp.should_close())

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
        try:
            gone = conn.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError):
            gone = True
        if gone:
            self._unpark(conn).done()
            self.nr_conns -= 1
            conn.close()
            return
        # A pipelined request: it is read after this claim is answered.
        self.poller.unregister(conn.sock)

    def run(self):
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
        if self.parked:
            now = time.monotonic()
            soonest = min(w.deadline or now for w in self.parked.values())
            soonest = min(soonest, self.next_look)
            timeout = min(timeout, max(soonest - now, 0.0))
        super().wait_for_and_dispatch_events(timeout)
        if self.parked:
            self._tend_parked()

    def _tend_parked(self):
        """Answer the claims whose wait is over (all of them when stopping), and
        look at the server's probe answer when it is time."""
        now = time.monotonic()
        over = [
            conn
            for conn, waiter in self.parked.items()
            if not self.alive or (waiter.deadline or now) <= now
        ]
        for conn in over:
            waiter = self._unpark(conn)
            self._submit(conn, self._answer_held, conn, waiter)
        if self.parked and now >= self.next_look:
            self._look()

    def _look(self):
        """Act on the server's newest probe answer, once; start a probe (on a
        thread) when the answer is older than the probe interval, or look
        again when it will be."""
        stamp, found = self.answer = self._shared_answer()
        if stamp > self.answer_seen:
            self.answer_seen = stamp
            self.wake_budget = found
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
        self._listen()

    def _wake(self):
        """Claim for parked claims, oldest first, as many as the last probe
        found work for: on one thread, one claim after another
        (``jobs.api.claims_for_waiting``), each answered as soon as it has its
        job. One thread, not one per claim, so that a batch for hundreds of
        waiting workers leaves the other threads free for heartbeats."""
        if self.claiming or self.wake_budget <= 0 or not self.parked:
            return
        woken = [
            (conn, self._unpark(conn)) for conn in list(self.parked)[: self.wake_budget]
        ]
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

        from jobs.api import claims_for_waiting

        outcomes: dict = {}
        close_old_connections()
        try:
            answers = claims_for_waiting(
                waiter.held.environ.get("HTTP_AUTHORIZATION", "") for _, waiter in woken
            )
            # The answers stop early when nothing is left to claim.
            for (conn, waiter), body in zip(woken, answers, strict=False):
                if body is None:
                    outcomes[conn] = None
                    continue
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
        resp = wsgi.Response(held.req, conn.sock, self.cfg)
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
        answered: Future = Future()
        answered.set_result(keepalive)
        super().finish_request(conn, answered)

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
        self._listen()

    def _shared_answer(self) -> tuple[float, int]:
        """The server's last probe answer: (``time.monotonic()`` when it was
        asked, how many claims may find work); (0, 0) if there is none or a
        probe is writing it."""
        if self.shared is None:
            self.shared = open(probe_file(self.ppid), "a+b")  # noqa: SIM115
        try:
            fcntl.flock(self.shared, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0.0, 0
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
            stamp, _ = read_answer(shared)
            if time.monotonic() - stamp < self._probe_interval():
                return
            asked = time.monotonic()
            found = self._ask_database()
            if found is not None:
                shared.seek(0)
                shared.truncate()
                shared.write(f"{asked} {found}".encode())
        if found:  # the file is closed (written, unlocked): the others read it
            self._nudge_others()

    def _ask_database(self) -> int | None:
        from django.db import close_old_connections

        from jobs.longpoll import claimable_jobs

        close_old_connections()
        try:
            return claimable_jobs(self.worker_connections)
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
