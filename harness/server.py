"""Starting a real Recall server: gunicorn with ``gunicorn.conf.py``, on
PostgreSQL or SQLite (whatever ``DATABASE_URL`` the caller gives), optionally
with its clock shifted by libfaketime; and the other children a run starts (the
django-q2 cluster, reference workers), each in a session of its own so that a
kill takes its children with it.

Every launcher of the server goes through ``Server``: the tests' fixtures
(``tests/support/server.py``), the chaos run, the benchmark and the demo. The
caller gives the whole environment (what reaches the server is exactly what it
says); ``Server`` adds only the bind address and, when asked, the clock.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
GUNICORN = (PY, "-m", "gunicorn", "-c", "gunicorn.conf.py")


class ServerError(RuntimeError):
    """The server exited, or did not answer, while it was starting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def libfaketime() -> str | None:
    """The path of Debian's libfaketime, or None if it is not installed."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def skewed_clock(offset: str) -> dict[str, str]:
    """The environment that runs a process with its clock ``offset`` (e.g.
    ``+120s``; libfaketime, which fakes the monotonic clock too, or
    ``time.sleep`` fails on Python 3.11)."""
    library = libfaketime()
    if library is None:
        raise RuntimeError("libfaketime is missing (Debian package faketime)")
    return {"LD_PRELOAD": library, "FAKETIME": offset}


def healthy(port: int, path: str = "/healthz", timeout: float = 2.0) -> bool:
    """True if the server on ``port`` answers ``path`` with 200."""
    try:
        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            probe.request("GET", path)
            return probe.getresponse().status == 200
        finally:
            probe.close()
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, message: str) -> None:
    """Poll ``check`` every 0.2 s; RuntimeError(``message``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.2)


class Process:
    """A child in a session of its own (so a kill takes its children with it),
    its output appended to ``log``. ``start()`` again after it ended restarts it
    with the same command and environment."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        *,
        start: bool = True,
    ) -> None:
        self.name, self.argv, self.env, self.log = name, list(argv), dict(env), log
        self.popen: subprocess.Popen | None = None
        self.terminated = False
        if start:
            self.start()

    def start(self) -> None:
        self.terminated = False
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int, *, group: bool = True) -> None:
        """``signum`` to the whole session (``group``) or to the child alone."""
        if self.alive():
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(self.popen.pid, signum)
                else:
                    self.popen.send_signal(signum)

    def terminate(self) -> None:
        """Exactly one SIGTERM to the child alone (not its session) while it
        runs: a second one means "exit now" to a reference worker and can hang
        django-q2."""
        if not self.terminated:
            self.terminated = True
            self.signal(signal.SIGTERM, group=False)

    def wait(self, timeout: float | None = None) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole session and reap the child."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the session; SIGKILL it if it is not gone in ``timeout``."""
        self.signal(signal.SIGTERM)
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


class Server(Process):
    """gunicorn with ``gunicorn.conf.py`` (``args`` on top) serving Recall on
    ``127.0.0.1:port`` (a free one unless given; or at ``bind``, host:port),
    with exactly ``env`` (its ``RECALL_BIND`` set to that address) and, if
    ``clock`` is given (``+120s``), its clock shifted by libfaketime. Starts
    at once unless ``start=False``; ``wait_until_up`` waits for it to serve."""

    def __init__(
        self,
        env: Mapping[str, str],
        log: Path,
        *,
        port: int | None = None,
        bind: str | None = None,
        args: Sequence[str] = (),
        clock: str | None = None,
        name: str = "gunicorn",
        start: bool = True,
    ) -> None:
        if bind is None:
            self.port = port or free_port()
            bind = f"127.0.0.1:{self.port}"
        else:
            self.port = int(bind.rpartition(":")[2])
        self.bind = bind
        env = {**env, "RECALL_BIND": bind}
        if clock is not None:
            env.pop("FAKETIME_DONT_FAKE_MONOTONIC", None)
            env.update(skewed_clock(clock))
        super().__init__(name, [*GUNICORN, *args], env, log, start=start)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def booted(self) -> int:
        """How many processes the master has booted so far (its log says)."""
        return self.text().count("Booting worker")

    def up(self, path: str = "/healthz") -> bool:
        return healthy(self.port, path)

    def wait_until_up(
        self,
        timeout: float = 60,
        *,
        booted: int = 0,
        path: str = "/healthz",
        interval: float = 0.1,
    ) -> None:
        """Until ``path`` answers 200 (and ``booted`` processes have started);
        ServerError with the log's tail if the master exits or ``timeout``
        passes first (the server is stopped then)."""
        deadline = time.monotonic() + timeout
        while self.booted() < booted or not self.up(path):
            if not self.alive():
                raise ServerError(f"{self.name} exited at start-up:\n{self.tail(40)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"{self.name} did not answer within {timeout:g}s:\n{self.tail(40)}"
                )
            time.sleep(interval)
