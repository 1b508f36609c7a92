"""The production pieces the system tests run Recall behind: PgBouncer and nginx
with the files in deploy/, gunicorn as gunicorn.conf.py starts it, reference
workers, and small helpers (wait for a condition with a deadline, one HTTP call).

The Debian tools (pgbouncer, nginx, openssl, systemd-analyze) are looked up with
``need()``: missing, the test is skipped, unless RECALL_REQUIRE_SYSTEM=1 (CI,
whose .ci/run installs them), which makes a missing tool a failure.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import connection

from harness.server import PY, ROOT, Process, Server, free_port, healthy

DEPLOY = ROOT / "deploy"


def need(tool: str) -> str:
    """The path of a Debian tool (also in /usr/sbin, off a user's PATH)."""
    found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
    if found:
        return found
    message = f"needs {tool} (.ci/run installs it with apt-get)"
    if os.environ.get("RECALL_REQUIRE_SYSTEM") == "1":
        pytest.fail(f"RECALL_REQUIRE_SYSTEM=1 but {message}")
    pytest.skip(message)


def wait_for(check: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``check`` until it returns something true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def db_settings() -> dict[str, str]:
    """Where pytest-django's test database is: host, port, user, name."""
    s = connection.settings_dict
    return {
        "host": s["HOST"] or "127.0.0.1",
        "port": str(s["PORT"] or 5432),
        "user": s["USER"] or "root",
        "name": s["NAME"],
    }


def direct_url(database: str | None = None) -> str:
    db = db_settings()
    return f"postgres://{db['user']}@{db['host']}:{db['port']}/{database or db['name']}"


def ini_with(
    text: str, section: str, values: dict[str, str], *, only: bool = False
) -> str:
    """``text`` (an ini file) with ``values`` set in ``section``: a key already
    there is replaced where it stands, others appended; ``only``: the section's
    other keys are dropped."""
    lines = text.splitlines()
    start = lines.index(f"[{section}]") + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines)
    )
    if only:
        kept = [line for line in lines[start:end] if not re.match(r"\s*[^;\s]", line)]
        lines[start:end] = kept
        end = start + len(kept)
    todo = dict(values)
    for i in range(start, end):
        match = re.match(r"\s*([\w.*-]+)\s*=", lines[i])
        if match and match.group(1) in todo:
            key = match.group(1)
            lines[i] = f"{key} = {todo.pop(key)}"
    added = [f"{key} = {value}" for key, value in todo.items()]
    return "\n".join(lines[:end] + added + lines[end:]) + "\n"


class PgBouncer:
    """deploy/pgbouncer/pgbouncer.ini in front of a PostgreSQL server, with the
    test's port, files and pool size; trust auth (as the test server has)."""

    def __init__(
        self, host: str, port: int | str, pool_size: int, user: str = "root"
    ) -> None:
        self.binary = need("pgbouncer")
        # Not under pytest's tmp_path (mode 700): PgBouncer runs as postgres.
        self.dir = Path(tempfile.mkdtemp(prefix="recall-pgbouncer-"))
        self.user = user
        self.port = free_port()
        self.kept_log = ""
        (self.dir / "userlist.txt").write_text(f'"{user}" ""\n')
        text = (DEPLOY / "pgbouncer" / "pgbouncer.ini").read_text()
        text = ini_with(text, "databases", {"*": f"host={host} port={port}"}, only=True)
        text = ini_with(
            text,
            "pgbouncer",
            {
                "listen_port": str(self.port),
                "unix_socket_dir": "",
                "logfile": str(self.dir / "pgbouncer.log"),
                "pidfile": "",
                "auth_type": "trust",
                "auth_file": str(self.dir / "userlist.txt"),
                "default_pool_size": str(pool_size),
                "reserve_pool_size": "0",
                "log_connections": "1",
                "log_disconnections": "1",
            },
        )
        self.config = self.dir / "pgbouncer.ini"
        self.config.write_text(text)
        argv = [self.binary, str(self.config)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            shutil.chown(self.dir, "postgres")
            for path in self.dir.iterdir():
                shutil.chown(path, "postgres")
            argv += ["-u", "postgres"]
        self.process = Process(
            "pgbouncer", argv, {"PATH": os.environ["PATH"]}, self.dir / "stdout.log"
        )
        wait_for(self._listening, 20, "PgBouncer to listen")

    def _listening(self) -> bool:
        assert self.process.alive(), self.log()
        try:
            with http.client.socket.create_connection(("127.0.0.1", self.port), 1):
                return True
        except OSError:
            return False

    def url(self, database: str) -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        if not self.dir.exists():
            return self.kept_log
        path = self.dir / "pgbouncer.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        self.process.stop()
        self.kept_log = self.log()
        shutil.rmtree(self.dir, ignore_errors=True)


def server_env(tmp: Path, database_url: str, **extra: str) -> dict[str, str]:
    """The environment a web node or a cluster runs with."""
    return {
        "PATH": os.environ["PATH"],
        "SECRET_KEY": os.environ["SECRET_KEY"],
        "DATABASE_URL": database_url,
        "RECALL_HTTPS": "off",
        "RECALL_VAR_DIR": str(tmp),
        "RECALL_STARTUP_SWEEP": "quick",
        "LOG_LEVEL": "WARNING",
        **extra,
    }


class Gunicorn(Server):
    """gunicorn -c gunicorn.conf.py (through the harness) on a port of its own,
    started and healthy."""

    def __init__(
        self, tmp: Path, env: dict[str, str], processes: int = 2, threads: int = 4
    ):
        self.processes = processes
        port = free_port()
        self.access_log = tmp / f"access-{port}.log"
        super().__init__(
            {
                **env,
                "WEB_CONCURRENCY": str(processes),
                "RECALL_WEB_THREADS": str(threads),
                "RECALL_ACCESS_LOG": str(self.access_log),
            },
            tmp / f"gunicorn-{port}.log",
            port=port,
            name=f"gunicorn-{port}",
        )
        self.wait_healthy()

    def start(self) -> None:
        self.booted_before = self.booted()
        super().start()

    def wait_healthy(self, timeout: float = 60) -> None:
        def up() -> bool:
            assert self.alive(), self.log.read_text()
            booted = self.booted() - self.booted_before
            return booted >= self.processes and healthy(self.port)

        wait_for(up, timeout, f"{self.name} to serve")

    def reload(self) -> None:
        """gunicorn's graceful reload (SIGHUP): new processes, old ones finish;
        returns once the new ones serve and the old ones are gone."""
        assert self.popen is not None
        self.booted = self.log.read_text().count("Booting worker")
        exited = self.log.read_text().count("Worker exiting")
        os.kill(self.popen.pid, signal.SIGHUP)
        self.wait_healthy()
        wait_for(
            lambda: (
                self.log.read_text().count("Worker exiting") >= exited + self.processes
            ),
            60,
            f"{self.name}'s old processes to finish",
        )


def cluster(tmp: Path, env: dict[str, str], name: str = "qcluster") -> Process:
    return Process(name, [PY, "manage.py", "qcluster"], env, tmp / f"{name}.log")


def reference_worker(
    tmp: Path, name: str, token: str, url: str, *args: str, ca: Path | None = None
) -> Process:
    """worker/recall_worker.py with the chaos run's engine (chaos://item/N.wav)."""
    env = {"PATH": os.environ["PATH"], "RECALL_TOKEN": token, "RECALL_URL": url}
    if ca is not None:
        env["SSL_CERT_FILE"] = str(ca)
    argv = [
        PY, "worker/recall_worker.py", "--command",
        f"{PY} tests/system/chaos_engine.py {{source}}", *args,
    ]  # fmt: skip
    return Process(name, argv, env, tmp / f"{name}.log")


def call(
    port: int,
    method: str,
    path: str,
    body: object = None,
    *,
    token: str = "",
    timeout: float = 60,
    https: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[int, object, dict[str, str]]:
    """One request on a new connection: (status, JSON or text, headers)."""
    if https:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        client: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=timeout, context=context
        )
    else:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    try:
        client.request(method, path, data, sent)
        response = client.getresponse()
        raw = response.read()
    finally:
        client.close()
    kind = response.getheader("Content-Type", "")
    value: object = raw.decode(errors="replace")
    if raw and kind.startswith("application/json"):
        value = json.loads(raw)
    return response.status, value, {k.lower(): v for k, v in response.getheaders()}


class Nginx:
    """Debian's nginx with deploy/nginx/recall.conf: the test's ports, a
    certificate made for it, ``upstreams`` as the web nodes and
    ``metrics_from`` as the one address allowed /metrics."""

    def __init__(self, upstreams: list[int], metrics_from: str = "127.0.0.1"):
        binary, openssl = need("nginx"), need("openssl")
        self.dir = Path(tempfile.mkdtemp(prefix="recall-nginx-"))
        self.cert = self.dir / "cert.pem"
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.dir / "key.pem"), "-out", str(self.cert),
             "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.http_port, self.https_port = free_port(), free_port()
        site = (DEPLOY / "nginx" / "recall.conf").read_text()
        nodes = "\n".join(f"    server 127.0.0.1:{p} max_fails=0;" for p in upstreams)
        for old, new in [
            ("listen 80;", f"listen 127.0.0.1:{self.http_port};"),
            ("listen 443 ssl;", f"listen 127.0.0.1:{self.https_port} ssl;"),
            ("/etc/ssl/recall/fullchain.pem", str(self.cert)),
            ("/etc/ssl/recall/privkey.pem", str(self.dir / "key.pem")),
            ("    server 127.0.0.1:8000 max_fails=0;", nodes),
            ("allow 127.0.0.1;", f"allow {metrics_from};"),
        ]:
            assert site.count(old) == 1, old
            site = site.replace(old, new)
        (self.dir / "recall.conf").write_text(site)
        (self.dir / "nginx.conf").write_text(
            f"user root;\nworker_processes 1;\npid {self.dir}/nginx.pid;\n"
            f"error_log {self.dir}/error.log notice;\nevents {{}}\nhttp {{\n"
            f"    access_log {self.dir}/access.log;\n"
            f"    client_body_temp_path {self.dir}/body;\n"
            f"    proxy_temp_path {self.dir}/proxy;\n"
            f"    include {self.dir}/recall.conf;\n}}\n"
        )
        argv = [binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
                "-g", "daemon off;"]  # fmt: skip
        self.process = Process("nginx", argv, {"PATH": os.environ["PATH"]},
                               self.dir / "stdout.log")  # fmt: skip
        wait_for(self._listening, 20, "nginx to listen")

    def _listening(self) -> bool:
        assert self.process.alive(), (self.dir / "stdout.log").read_text()
        try:
            with http.client.socket.create_connection(
                ("127.0.0.1", self.https_port), 1
            ):
                return True
        except OSError:
            return False

    def error_log(self) -> str:
        return (self.dir / "error.log").read_text()

    def take_out(self, port: int, out: bool = True) -> None:
        """Mark a web node ``down`` in the upstream (or back up), and reload
        nginx (gracefully: requests in flight finish); returns once the new
        configuration serves."""
        site = self.dir / "recall.conf"
        line = f"    server 127.0.0.1:{port} max_fails=0"
        text = site.read_text().replace(f"{line} down;", f"{line};")
        site.write_text(text.replace(f"{line};", f"{line} down;") if out else text)
        started = self.error_log().count("start worker process")
        assert self.process.popen is not None
        os.kill(self.process.popen.pid, signal.SIGHUP)
        wait_for(
            lambda: self.error_log().count("start worker process") > started,
            20,
            "nginx to reload",
        )

    def statuses(self) -> list[int]:
        """The status of every request nginx answered, in order."""
        text = (self.dir / "access.log").read_text()
        return [int(m[1]) for m in re.finditer(r'" (\d{3}) ', text)]

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` (from any client)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            count += 1
    return count
