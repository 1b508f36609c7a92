"""A private PostgreSQL server, for runs that stop and restart the database or
want one of their own.

The outage test and the chaos run need to take PostgreSQL down and bring it
back, and the benchmark wants a stock server with room for its clients; doing
that to the shared server would break every other connection. This starts a
throwaway cluster (initdb in a temporary directory, its own port) from the
installed PostgreSQL binaries. As root, the server runs as the ``postgres``
user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .server import free_port

__all__ = ["PrivatePostgres", "available", "free_port"]


def _bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not candidates:
        raise FileNotFoundError(f"PostgreSQL's {name} is not installed")
    return candidates[-1]


def available() -> bool:
    try:
        _bin("initdb")
        _bin("pg_ctl")
    except FileNotFoundError:
        return False
    return True


class PrivatePostgres:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="recall-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.dir, "postgres")
        self._run(
            _bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "root",
            "-E", "UTF8", "--no-sync",
        )  # fmt: skip

    def _run(self, *args: str) -> None:
        command = (
            ["runuser", "-u", "postgres", "--", *args] if self.as_root else list(args)
        )
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def url(self, database: str = "recall") -> str:
        return f"postgres://root@127.0.0.1:{self.port}/{database}"

    def start(self, settings: dict[str, str] | None = None) -> None:
        """Start the server: fsync off and 200 connections unless ``settings``
        (PostgreSQL parameters) say otherwise."""
        settings = {"fsync": "off", "max_connections": "200", **(settings or {})}
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 " + (
            " ".join(f"-c {name}={value}" for name, value in settings.items())
        )
        self._run(
            _bin("pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.dir / "server.log"), "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``immediate`` is a crash (recovery on the next start)."""
        self._run(
            _bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"
        )

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()

    def create_database(self, name: str = "recall") -> str:
        deadline = time.monotonic() + 30
        while True:
            result = subprocess.run(
                [
                    _bin("createdb"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-U",
                    "root",
                    name,
                ],
                capture_output=True,
                text=True,
            )
            if result.returncode == 0:
                return self.url(name)
            if time.monotonic() > deadline:
                raise RuntimeError(result.stderr)
            time.sleep(0.2)

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
