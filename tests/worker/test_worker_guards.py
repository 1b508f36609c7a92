"""The reference worker's guards that need no Recall server: --source-root, the
plain-http warning, and logs that never show a token (against a small fake
server, as a real subprocess). No database: these also run in the SQLite pass."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.worker import WORKER_SCRIPT, load_worker_module

rw = load_worker_module()

WORKER_TOKEN = "wtok-" + "S3cr3t" * 6
LEASE_TOKEN = "ltok-" + "L3453" * 6


def make_job(source: str) -> object:
    return rw.Job.from_claim(
        {"job": {"id": 7, "lease_token": LEASE_TOKEN, "item": {"source": source}}}
    )


# --- --source-root ----------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """root/ with a file, a subfolder, and a symlink that leads out of root/."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "a.wav").write_bytes(b"RIFF")
    (outside / "secret.wav").write_bytes(b"RIFF")
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root / "sub")
    return root, outside


def test_local_sources_inside_the_root_get_their_real_path(tree, monkeypatch):
    root, _ = tree
    source_root = rw.SourceRoot(str(root))
    monkeypatch.chdir(root)
    real = str(root / "sub" / "a.wav")

    for source, path in (
        (real, real),
        (f"file://{real}", real),
        (f"file://localhost{real}", real),
        ("sub/a.wav", real),  # relative: to the worker's directory, like the engine's
        ("./sub/../sub/a.wav", real),
        (f"{root}/inner/a.wav", real),  # a symlink that stays inside
        (f"{root}/sub/new.wav", f"{root}/sub/new.wav"),  # not there: the engine says so
    ):
        checked = source_root.check(make_job(source))
        assert isinstance(checked, rw.Job), source
        assert checked.local_path == path


@pytest.mark.parametrize(
    "source",
    [
        "{outside}/secret.wav",
        "file://{outside}/secret.wav",
        "{root}/../outside/secret.wav",
        "file://{root}/%2e%2e/outside/secret.wav",
        "{root}/escape/secret.wav",  # a symlink inside that leads out
        "{root}-sibling/a.wav",  # a prefix of the root is not the root
        "file://fileserver/share/a.wav",  # another machine's file
        "/etc/passwd",
    ],
)
def test_local_sources_outside_the_root_fail_without_a_retry(tree, source):
    root, outside = tree
    source = source.format(root=root, outside=outside)

    outcome = rw.SourceRoot(str(root)).check(make_job(source))

    assert outcome == rw.Failure(
        f"The source {source!r} is outside --source-root {root} (after resolving "
        f"'..' and symbolic links); refused without a retry.",
        retryable=False,
    )


@pytest.mark.parametrize(
    "source", ["s3://bucket/a.wav", "https://cdn.example.com/a.wav", "gs://b/c.wav"]
)
def test_remote_sources_are_not_the_roots_business(tree, source):
    job = make_job(source)

    assert rw.SourceRoot(str(tree[0])).check(job) is job


def test_the_engine_gets_the_path_that_was_checked(tree):
    root, _ = tree
    job = rw.SourceRoot(str(root)).check(make_job(f"file://{root}/inner/a.wav"))

    values = rw._placeholder_values(job, "/tmp/out")

    assert values["source"] == f"file://{root}/inner/a.wav"
    assert values["source_path"] == str(root / "sub" / "a.wav")


def test_source_root_must_be_a_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), "--url", "http://127.0.0.1:9",
         "--token", WORKER_TOKEN, "--simulate", "--source-root", str(tmp_path / "no")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip

    assert result.returncode == 2
    assert "is not a directory" in result.stderr


# --- Plain http:// ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://recall.example.com",
        "http://127.0.0.1:8000",
        "http://127.8.9.10",
        "http://localhost:8000/",
        "http://LOCALHOST.",
        "http://app.localhost",
        "http://[::1]:8000",
    ],
)
def test_no_warning_for_https_or_this_machine(url):
    assert rw.plain_http_warning(url) is None


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://recall.example.com", "recall.example.com"),
        ("http://10.0.0.5:8000", "10.0.0.5"),
        ("http://[2001:db8::1]/", "2001:db8::1"),
    ],
)
def test_a_warning_for_plain_http_over_a_network(url, host):
    assert rw.plain_http_warning(url) == (
        f"RECALL_URL is plain http:// to {host!r}, which is not this machine: the "
        f"worker token and every transcript cross the network unencrypted; use "
        f"https://"
    )


@pytest.mark.skipif(
    subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0
    if shutil.which("unshare")
    else True,
    reason="needs `unshare -n` (root) for a network with no route anywhere",
)
def test_the_worker_warns_once_at_start_up(tmp_path):
    # In a network namespace of its own, with no route: the address is never
    # reached (no packet leaves), and every claim fails at once and is retried.
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-n", sys.executable, str(WORKER_SCRIPT),
             "--url", "http://192.0.2.10:8000", "--token", WORKER_TOKEN,
             "--simulate", "--retry-max=0.2"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_log(log, "claim failed", count=3)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)

    text = log.read_text()
    assert text.count("RECALL_URL is plain http:// to '192.0.2.10'") == 1
    assert text.count("unencrypted") == 1


# --- Tokens never logged -------------------------------------------------------------------


def test_the_redactor_removes_known_and_labelled_tokens():
    redactor = rw.Redactor()
    redactor.add(WORKER_TOKEN)
    redactor.add(LEASE_TOKEN)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(redactor)
    logger = logging.getLogger("test.redactor")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("token %s and %r", WORKER_TOKEN, {"lease_token": LEASE_TOKEN})
        logger.error("labelled: {'lease_token': 'unknown-one'} Bearer other-secret")
        logger.error('json: {"lease_token": "third", "x": 1}')
        try:
            raise RuntimeError(f"Authorization: Bearer {WORKER_TOKEN}")
        except RuntimeError:
            logger.exception("with a traceback")
    finally:
        logger.removeHandler(handler)

    text = out.getvalue()
    for secret in (WORKER_TOKEN, LEASE_TOKEN, "unknown-one", "other-secret", "third"):
        assert secret not in text
    lines = text.splitlines()
    assert lines[0] == "token [redacted] and {'lease_token': '[redacted]'}"
    assert lines[1] == "labelled: {'lease_token': '[redacted]'} Bearer [redacted]"
    assert lines[2] == 'json: {"lease_token": "[redacted]", "x": 1}'
    assert lines[-1] == "RuntimeError: Authorization: Bearer [redacted]"


class FakeRecall(BaseHTTPRequestHandler):
    """A server that says what the worker must never repeat: a claim that is
    malformed (the worker logs it) and errors that echo the worker's token."""

    calls = 0

    def do_POST(self):
        FakeRecall.calls += 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        if FakeRecall.calls % 2:
            status, body = (
                200,
                {"job": {"id": "not-a-number", "lease_token": LEASE_TOKEN}},
            )
        else:
            status, body = 503, {"error": "unavailable", "detail": f"saw {auth}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def wait_for_log(path: Path, text: str, *, count: int = 1, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the worker's log:\n{path.read_text()}")
        time.sleep(0.05)


def test_the_worker_never_logs_a_token(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRecall)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    log = tmp_path / "worker.log"
    env = {"PATH": os.environ["PATH"], "RECALL_TOKEN": WORKER_TOKEN}
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), "--simulate", "--log-level=DEBUG",
                 f"--url=http://127.0.0.1:{server.server_port}", "--poll-min=0.05",
                 "--poll-max=0.1", "--retry-max=0.1"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            wait_for_log(log, "claim: malformed response", count=2)
            wait_for_log(log, "claim failed (HTTP 503 unavailable: saw Bearer", count=2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
    finally:
        server.shutdown()

    text = log.read_text()
    assert WORKER_TOKEN not in text
    assert LEASE_TOKEN not in text
    assert "'lease_token': '[redacted]'" in text
    assert "saw Bearer [redacted]" in text
