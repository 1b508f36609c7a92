"""The reference worker as the tests run it: its script, a fake engine, the
worker as a subprocess with its log, a TCP proxy that can take the server
away, and waiting on conditions instead of sleeping."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.utils import timezone

from batches.models import Batch
from engine.manifests import create_batch
from harness.server import ROOT

WORKER_SCRIPT = ROOT / "worker" / "recall_worker.py"
FAKE_ENGINE = ROOT / "tests" / "worker" / "fake_engine.py"


FAKE_ENGINE_COMMAND = f"{sys.executable} {FAKE_ENGINE} {{params[mode]}} {{source}}"


def load_worker_module():
    """The worker file as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("recall_worker", WORKER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("recall_worker", module)
    spec.loader.exec_module(module)
    return module


def wait_for(
    condition: Callable[[], object],
    *,
    timeout: float = 20,
    what: str,
    workers: tuple[WorkerProcess, ...] = (),
    every: Callable[[], object] | None = None,
):
    """Poll ``condition`` until it returns something truthy; fail after
    ``timeout`` seconds with the workers' logs. ``every`` runs on each poll."""
    deadline = time.monotonic() + timeout
    while True:
        if every is not None:
            every()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.log_path.name}\n{w.log()}" for w in workers)
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{logs}")
        time.sleep(0.05)


class WorkerProcess:
    """A running ``recall_worker.py`` (in a session of its own) and its log."""

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.proc, self.log_path = proc, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def exit_code(self, timeout: float = 15) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within {timeout}s\n{self.log()}")

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Teardown: a graceful stop, then no mercy."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.send(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def engine_records(directory: Path) -> list[dict]:
    """What hanging fake engines recorded: their pid, their child's, the job."""
    records = []
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(ValueError):  # still being written: next poll
            records.append(json.loads(path.read_text()))
    return records


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its reaper counts)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def batch_with_modes(
    modes: list[str], *, durations: list[float] | None = None
) -> Batch:
    """A batch whose items carry a ``mode`` param for the fake engine."""
    durations = durations or [2.0] * len(modes)
    lines = ["source,duration_seconds,mode\n"] + [
        f"/audio/item-{i}.wav,{d},{mode}\n"
        for i, (mode, d) in enumerate(zip(modes, durations, strict=True))
    ]
    return create_batch("fake", lambda: iter(lines), now=timezone.now())


class TcpProxy:
    """A TCP proxy between the worker and the live server that a test can stop
    (the port refuses connections), start again on the same port, or switch to
    dropping every response after the server has handled the request."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self.drop_responses = False
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,))
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        """The server goes away: the port is closed and open connections cut."""
        listener, self._listener = self._listener, None
        if self._thread is not None:
            self._thread.join()
        if listener is not None:
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._connections.update((client, upstream))
            drop = self.drop_responses
            for src, dst, discard in (
                (client, upstream, False),
                (upstream, client, drop),
            ):
                threading.Thread(
                    target=self._pump, args=(src, dst, discard), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, discard: bool) -> None:
        try:
            while data := src.recv(65536):
                if not discard:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            # One side is done: end both, like a server closing the connection.
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                with self._lock:
                    self._connections.discard(sock)
