"""``recallctl submit --require KEY=VALUE``: the batch's requirements, sent as
``"requires"`` in the Operator API's POST /api/v1/batches (the pinned shape),
checked against a small fake server that records what it was sent. No
database: these also run in the SQLite pass. (Against the real server, with a
labelled worker: tests/worker/test_recallctl.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.worker import ROOT

RECALLCTL = ROOT / "worker" / "recallctl.py"
BATCH = {
    "id": 7,
    "name": "calls",
    "state": "running",
    "total": 1,
    "counts": {"done": 0, "failed": 0, "cancelled": 0},
    "percent_done": 0,
    "in_flight": 0,
    "eta_seconds": None,
}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw)
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        if body.get("requires", {}).get("gpu") == "A 100":
            status, answer = (
                400,
                {
                    "error": "bad_request",
                    "detail": "requires: value of 'gpu' must be 1 to 63 characters",
                },
            )
        else:
            status, answer = (
                201,
                {"batch": {**BATCH, "requires": body.get("requires", {})}},
            )
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def submit(server, tmp_path, *options: str) -> subprocess.CompletedProcess:
    manifest = tmp_path / "calls.txt"
    manifest.write_text("/calls/1.wav\n")
    return subprocess.run(
        [sys.executable, str(RECALLCTL), "submit", str(manifest), *options],
        env={
            "PATH": os.environ["PATH"],
            "RECALL_URL": f"http://127.0.0.1:{server.server_port}",
            "RECALL_API_TOKEN": "rct_test",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_each_require_is_one_requirement_of_the_batch(server, tmp_path):
    done = submit(server, tmp_path, "--require", "gpu=a100", "--require=model=large-v3")

    assert done.returncode == 0, done.stderr
    (body,) = server.bodies
    assert body["requires"] == {"gpu": "a100", "model": "large-v3"}
    assert done.stdout.splitlines()[-1] == "7"


def test_without_require_nothing_is_required(server, tmp_path):
    done = submit(server, tmp_path)

    assert done.returncode == 0, done.stderr
    assert "requires" not in server.bodies[0]


@pytest.mark.parametrize(
    ("pair", "message"),
    [("gpu", "--require 'gpu': expected KEY=VALUE"), ("=a100", "expected KEY=VALUE")],
)
def test_a_pair_that_is_not_key_value_is_refused_before_sending(
    server, tmp_path, pair, message
):
    done = submit(server, tmp_path, "--require", pair)

    assert done.returncode == 4
    assert message in done.stderr
    assert server.bodies == []


def test_a_key_given_twice_is_refused(server, tmp_path):
    done = submit(server, tmp_path, "--require=gpu=a100", "--require=gpu=h100")

    assert done.returncode == 4
    assert "--require: 'gpu' is given twice" in done.stderr


def test_the_servers_refusal_says_which_requirement(server, tmp_path):
    done = submit(server, tmp_path, "--require=gpu=A 100")

    assert done.returncode == 4
    assert done.stderr.strip() == (
        "recallctl: error: --require was refused: requires: value of 'gpu' must "
        "be 1 to 63 characters"
    )
