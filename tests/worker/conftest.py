"""Fixtures for the reference worker's tests: pytest-django's live server, the
worker started as a real subprocess against it, and a TCP proxy that can take
the server away (what they are made of: tests/support/worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from django.test.utils import override_settings
from pytest_django.live_server_helper import LiveServer

from jobs.models import Worker
from tests.support.worker import WORKER_SCRIPT, TcpProxy, WorkerProcess


@pytest.fixture(scope="session")
def live_server(request) -> Iterator[LiveServer]:
    """pytest-django's live server, started with the HTTPS redirect off.

    SecurityMiddleware reads SECURE_SSL_REDIRECT once, when the server thread
    loads its middleware, which is before any per-test settings override (the
    root conftest's included) can apply; the worker speaks plain HTTP to it.
    """
    addr = (
        request.config.getvalue("liveserver")
        or os.getenv("DJANGO_LIVE_TEST_SERVER_ADDRESS")
        or "localhost"
    )
    with override_settings(SECURE_SSL_REDIRECT=False):
        server = LiveServer(addr)  # returns once the middleware is loaded
    yield server
    server.stop()


@pytest.fixture
def start_worker(live_server, tmp_path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start the worker as a subprocess: ``start_worker(worker, *options)``.

    Polling and retry pauses are short so tests move fast; any option can be
    given again to override them. Every worker is stopped at teardown.
    """
    started: list[WorkerProcess] = []
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()

    def start(worker: Worker, *options: str, url: str | None = None) -> WorkerProcess:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(
            RECALL_URL=url or live_server.url,
            RECALL_TOKEN=worker.token,
            FAKE_ENGINE_DIR=str(engine_dir),
        )
        log_path = tmp_path / f"worker-{worker.name}-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER_SCRIPT),
                    "--poll-min=0.1",
                    "--poll-max=0.3",
                    "--retry-max=0.5",
                    "--http-timeout=5",
                    *options,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = WorkerProcess(proc, log_path)
        started.append(process)
        return process

    start.engine_dir = engine_dir  # type: ignore[attr-defined]
    yield start
    for process in started:
        process.stop()


@pytest.fixture
def proxy(live_server) -> Iterator[TcpProxy]:
    host, port = live_server.thread.host, live_server.thread.port
    server = TcpProxy((host, port))
    server.start()
    yield server
    server.stop()
