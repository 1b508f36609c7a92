"""Database outage: while PostgreSQL is down the API answers 503 JSON, and once
it is back the same gunicorn processes serve again, with nothing half-written.

Runs its own PostgreSQL server and a real gunicorn (harness/), so the
shared test database is never touched.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from harness.pgserver import PrivatePostgres, available
from harness.server import ROOT, Server

METRICS_TOKEN = "outage-metrics-token-3f6a90c8e1b2d47"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not available(), reason="PostgreSQL server binaries not installed"
    ),
]


def _env(database_url: str, **extra: str) -> dict:
    return {
        "PATH": os.environ["PATH"],
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DATABASE_URL": database_url,
        "RECALL_HTTPS": "off",
        "RECALL_VAR_DIR": str(ROOT / "var"),
        "DATABASE_CONNECT_TIMEOUT": "2",
        **extra,
    }


def _manage(env: dict, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _request(base: str, path: str, token: str | None = None, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        base + path,
        data=data,
        headers=headers,
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        raw = error.read()
        return error.code, json.loads(raw) if raw.startswith(b"{") else raw.decode()


def _scrape(base: str) -> tuple[int, str]:
    request = urllib.request.Request(
        base + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _wait_until(check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        if (result := check()) is not None:
            return result
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def server():
    pg = PrivatePostgres()
    pg.start()
    url = pg.create_database()
    env = _env(url)
    _manage(env, "migrate", "-v0")
    token = _manage(env, "create_worker", "outage-worker").strip().splitlines()[-1]
    manifest = ROOT / "var" / "outage-manifest.txt"
    manifest.parent.mkdir(exist_ok=True)
    manifest.write_text("/a.wav\n/b.wav\n/c.wav\n")
    _manage(env, "create_batch", "outage", str(manifest))
    web = Server(
        _env(
            url,
            WEB_CONCURRENCY="2",
            RECALL_STARTUP_SWEEP="quick",
            RECALL_METRICS_TOKEN=METRICS_TOKEN,
        ),
        pg.dir / "gunicorn.log",
    )
    log = open(web.log)  # noqa: SIM115 (closed below)
    base = web.url
    try:
        _wait_until(lambda: True if _alive(base) else None)
        yield {
            "pg": pg,
            "base": base,
            "token": token,
            "env": env,
            "gunicorn": web.popen,
            "log": log,
        }
    finally:
        web.stop()
        log.close()
        pg.destroy()


def _alive(base: str) -> bool:
    try:
        urllib.request.urlopen(base + "/healthz", timeout=1).close()
        return True
    except OSError:
        return False


def _booted_workers(log) -> int:
    log.seek(0)
    return log.read().count("Booting worker")


def test_api_answers_503_while_the_database_is_down_and_recovers(server):
    base, token, pg = server["base"], server["token"], server["pg"]
    status, body = _request(base, "/api/v1/claim", token, {})
    assert status == 200
    held = body["job"]
    # Both processes have booted (the second may still be starting here).
    _wait_until(lambda: True if _booted_workers(server["log"]) == 2 else None)
    workers_before = _booted_workers(server["log"])

    pg.stop("immediate")  # a crash, not a clean shutdown

    for path, payload in [
        ("/api/v1/claim", {}),
        (f"/api/v1/jobs/{held['id']}/heartbeat", {"lease_token": held["lease_token"]}),
        (
            f"/api/v1/jobs/{held['id']}/complete",
            {"lease_token": held["lease_token"], "result": {"text": "x"}},
        ),
    ]:
        status, body = _request(base, path, token, payload)
        assert status == 503, (path, body)
        assert body["error"] == "unavailable"
    status, body = _request(base, "/readyz")
    assert status == 503
    assert body["reasons"][0].startswith("database unreachable")
    assert _request(base, "/healthz") == (200, {"status": "ok"})
    # No database figures to give: a scrape fails rather than report zeros.
    assert _scrape(base) == (503, "The database is unavailable.\n")

    pg.start()

    # The same processes reconnect on their own; the lease held through the
    # outage is still live and its completion is accepted.
    def complete():
        answer = _request(
            base,
            f"/api/v1/jobs/{held['id']}/complete",
            token,
            {"lease_token": held["lease_token"], "result": {"text": "done"}},
        )
        return None if answer[0] == 503 else answer

    assert _wait_until(complete) == (200, {"status": "completed"})
    status, body = _request(base, "/api/v1/claim", token, {})
    server["log"].seek(0)
    assert status == 200, server["log"].read()[-6000:]
    log = server["log"]
    booted = _booted_workers(log)
    log.seek(0)
    assert booted == workers_before, log.read()[-5000:]
    # The 503s were counted, by the processes that answered them.
    status, text = _scrape(base)
    assert status == 200
    for endpoint in ("claim", "heartbeat", "complete"):
        assert (
            f'recall_api_requests_total{{endpoint="{endpoint}",status="503"}}' in text
        )
    assert 'recall_api_requests_total{endpoint="claim",status="200"} 2.0' in text
    assert server["gunicorn"].poll() is None
    check = subprocess.run(
        [sys.executable, "manage.py", "recall_check"],
        cwd=ROOT,
        env=server["env"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout
    log = server["log"]
    log.seek(0)
    assert "Internal Server Error" not in log.read()
