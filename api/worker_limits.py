"""Per-worker limits the whole server keeps together: a request rate, and how
many claims a worker may have waiting.

One worker token must not be able to take the server for itself. The worker
API refuses a worker's request beyond ``RECALL_WORKER_RATE_PER_SECOND`` (a
token bucket holding up to ``RECALL_WORKER_RATE_BURST`` requests: 429
``rate_limited``), and lets at most ``RECALL_MAX_WAITING_CLAIMS_PER_WORKER``
of its claims wait (``api/waiter.py``: one more answers at once, as a claim
without ``wait_seconds``). Counted per process, either limit would be as many
times larger as the server has processes, so the counts live in a small table
of shared memory: an anonymous ``MAP_SHARED`` mapping which gunicorn's master
creates before it forks its workers (``prepare``, from ``gunicorn.conf.py``),
so that every process of the server reads and writes the same table. A process
that was not forked from a prepared master (``runserver``, Django's test
client, a shell) makes a table of its own on first use: its limits are its
own, which is all there is to share.

The table: fixed-size slots of 64-bit integers (no allocation, no database
write, no file on disk), looked up by worker id in a short window of slots;
every read-modify-write holds a lock: a thread lock within the process, and a
POSIX record lock (``lockf``) on the mapping's file between processes, which
the kernel releases when its holder dies, so a process killed at any moment
never leaves the others locked out. A few microseconds per request.

Waiting claims are counted per (worker, process). A process that dies holding
waiting claims (killed, or stopped past its graceful timeout) leaves entries no
one will release: gunicorn's master forgets them when it reaps the process
(``forget_process``, from ``child_exit``), a process forgets those of an
earlier process with its own pid when it first uses the table, and a worker
at its limit has the entries of processes no longer running dropped before
it is refused. No count outlives its process, and no worker is locked out.

A full window fails safe for each limit: a request is let through (the rate
is a guard against floods, not an accounting), a claim answers at once
instead of waiting. No Django imports: gunicorn's master loads this.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterator

# Rate buckets: (worker id + 1, tokens in millionths, last refill in µs).
RATE_SLOTS = 8192
# Waiting claims: (worker id + 1, pid, claims waiting).
WAITING_SLOTS = 4096
FIELDS = 3
# Slots looked at for one worker, from the one its id hashes to.
WINDOW = 16
MICRO = 1_000_000


def _micros() -> int:
    """CLOCK_MONOTONIC, which every process of the machine shares, in µs."""
    return time.monotonic_ns() // 1000


class Table:
    """The shared slots, with their lock (see the module docstring)."""

    def __init__(self) -> None:
        slots = RATE_SLOTS + WAITING_SLOTS
        size = slots * FIELDS * 8
        self.fd = self._anonymous_file(size)
        self.memory = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        self.cells = memoryview(self.memory).cast("q")
        self.waiting_base = RATE_SLOTS * FIELDS
        self.thread_lock = threading.Lock()
        self.pid = os.getpid()
        # A lock held by a thread of the parent at fork stays held in the
        # child: give the child a fresh one.
        os.register_at_fork(after_in_child=self._after_fork)

    @staticmethod
    def _anonymous_file(size: int) -> int:
        """A file in memory with no name anyone else can open: its pages are
        the table, and its descriptor carries the cross-process lock."""
        try:
            fd = os.memfd_create("recall-worker-limits", os.MFD_CLOEXEC)
        except (AttributeError, OSError):  # no memfd: an unlinked temporary file
            fd = os.dup(tempfile.TemporaryFile().fileno())  # noqa: SIM115
        os.ftruncate(fd, size)
        return fd

    def _after_fork(self) -> None:
        self.thread_lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[memoryview]:
        with self.thread_lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                pid = os.getpid()
                if pid != self.pid:
                    # First use in a forked process: entries left under this
                    # pid belong to a process that had it before and died.
                    self.pid = pid
                    self._forget(pid)
                yield self.cells
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    # --- Request rate -----------------------------------------------------------

    def take(self, worker: int, rate: float, burst: int, now: int) -> float:
        """Take one request from ``worker``'s bucket: 0.0, or the seconds until
        one is left (refused)."""
        full = burst * MICRO
        key = worker + 1
        with self.locked() as cells:
            slot = self._rate_slot(cells, key, rate, full, now)
            if slot is None:
                return 0.0  # the window is full of live buckets: let it through
            tokens = min(full, cells[slot + 1] + int((now - cells[slot + 2]) * rate))
            cells[slot + 2] = now
            if tokens >= MICRO:
                cells[slot + 1] = tokens - MICRO
                return 0.0
            cells[slot + 1] = tokens
            return (MICRO - tokens) / rate / MICRO

    def _rate_slot(
        self, cells: memoryview, key: int, rate: float, full: int, now: int
    ) -> int | None:
        """The offset of ``key``'s bucket, made (full) in a free slot of its
        window if it has none: a slot never used, or a bucket that has filled
        up again (which is the same as no bucket)."""
        free = None
        for n in range(WINDOW):
            slot = ((key + n) % RATE_SLOTS) * FIELDS
            if cells[slot] == key:
                return slot
            if free is None and (
                cells[slot] == 0
                or cells[slot + 1] + (now - cells[slot + 2]) * rate >= full
            ):
                free = slot
        if free is not None:
            cells[free], cells[free + 1], cells[free + 2] = key, full, now
        return free

    # --- Waiting claims ---------------------------------------------------------

    def hold_waiting(self, worker: int, limit: int) -> bool:
        """Count one more waiting claim of ``worker`` in this process, if it
        has fewer than ``limit`` waiting on the whole server."""
        key = worker + 1
        with self.locked() as cells:
            entries = self._waiting_entries(cells, key)
            if sum(cells[slot + 2] for slot in entries) >= limit:
                for slot in entries:
                    if not _running(cells[slot + 1]):
                        self._clear(cells, slot)
                entries = self._waiting_entries(cells, key)
                if sum(cells[slot + 2] for slot in entries) >= limit:
                    return False
            own = next((s for s in entries if cells[s + 1] == self.pid), None)
            if own is None:
                own = self._free_waiting_slot(cells, key)
                if own is None:
                    return False  # the window is full: this claim does not wait
                cells[own], cells[own + 1], cells[own + 2] = key, self.pid, 0
            cells[own + 2] += 1
            return True

    def release_waiting(self, worker: int) -> None:
        """One waiting claim of ``worker`` in this process waits no more."""
        key = worker + 1
        with self.locked() as cells:
            for slot in self._waiting_entries(cells, key):
                if cells[slot + 1] == self.pid:
                    cells[slot + 2] -= 1
                    if cells[slot + 2] <= 0:
                        self._clear(cells, slot)
                    return

    def waiting(self, worker: int) -> int:
        """``worker``'s claims waiting on the whole server."""
        with self.locked() as cells:
            return sum(cells[s + 2] for s in self._waiting_entries(cells, worker + 1))

    def forget_process(self, pid: int) -> None:
        with self.locked():
            self._forget(pid)

    def _forget(self, pid: int) -> None:
        cells = self.cells
        for n in range(WAITING_SLOTS):
            slot = self.waiting_base + n * FIELDS
            if cells[slot] and cells[slot + 1] == pid:
                self._clear(cells, slot)

    def _window(self, key: int) -> Iterator[int]:
        for n in range(WINDOW):
            yield self.waiting_base + ((key + n) % WAITING_SLOTS) * FIELDS

    def _waiting_entries(self, cells: memoryview, key: int) -> list[int]:
        return [slot for slot in self._window(key) if cells[slot] == key]

    def _free_waiting_slot(self, cells: memoryview, key: int) -> int | None:
        return next((slot for slot in self._window(key) if cells[slot] == 0), None)

    def clear(self) -> None:
        with self.locked():
            self.memory[:] = bytes(len(self.memory))

    @staticmethod
    def _clear(cells: memoryview, slot: int) -> None:
        cells[slot], cells[slot + 1], cells[slot + 2] = 0, 0, 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


_table: Table | None = None
_made = threading.Lock()


def prepare() -> Table:
    """The table, made now if there is none: gunicorn's master calls this
    before it forks its workers, so that they share it."""
    global _table
    with _made:
        if _table is None:
            _table = Table()
        return _table


def take_request(worker: int, *, rate: float, burst: int) -> float:
    """0.0 if ``worker`` may make a request now (counted), else the seconds
    until it may. A ``rate`` of 0 (or less) is no limit."""
    if rate <= 0:
        return 0.0
    return (_table or prepare()).take(worker, rate, max(1, burst), _micros())


def hold_waiting(worker: int, limit: int) -> bool:
    """True, and counted until ``release_waiting``, if one more claim of
    ``worker`` may wait; False if it has ``limit`` claims waiting already."""
    if limit <= 0:
        return False
    return (_table or prepare()).hold_waiting(worker, limit)


def release_waiting(worker: int) -> None:
    (_table or prepare()).release_waiting(worker)


def waiting(worker: int) -> int:
    return (_table or prepare()).waiting(worker)


def forget_process(pid: int) -> None:
    """Drop the waiting claims counted for process ``pid`` (it has exited)."""
    if _table is not None:
        _table.forget_process(pid)


def clear() -> None:
    """Forget every count (tests: each starts with none)."""
    if _table is not None:
        _table.clear()
