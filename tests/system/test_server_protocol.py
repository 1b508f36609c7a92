"""HTTP as clients speak it, against the real server, now that its event loop
reads every request before a thread serves it (recall_site/request_reading.py):
pipelined and kept-alive requests, chunked bodies, ``Expect: 100-continue``,
bodies too large, heads too large, and large bodies that wait on disk: a
completion of 6 MB and a manifest upload through the web form."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
from django.utils import timezone

from batches.models import Batch
from jobs.models import Job, JobStatus
from recall_site.request_reading import MEMORY_BODY_BYTES
from tests.support.factories import make_batch, make_user, make_worker
from tests.support.raw_clients import (
    call,
    closed_by_server,
    connect,
    read_response,
    request_bytes,
    serving,
)
from tests.support.server import ROOT, served_database_url

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def server(tmp_path):
    with serving(tmp_path, 2, 4) as (port, _):
        yield port


def test_pipelined_requests_are_answered_in_order_and_the_connection_kept(server):
    sock = connect(server)
    get = request_bytes("GET", "/healthz", close=False)
    sock.sendall(get + get + b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    first, second = read_response(sock), read_response(sock)
    sock.sendall(b"\r\n")  # the third one's end comes later
    third = read_response(sock)
    sock.sendall(get)
    fourth = read_response(sock)
    sock.close()

    assert [r[0] for r in (first, second, fourth)] == [200, 200, 200]
    assert json.loads(first[2]) == {"status": "ok"}
    assert third[0] in (200, 503)  # readyz: answered, whatever it says
    assert json.loads(third[2])["status"] in ("ok", "unavailable")


def test_a_chunked_body_is_read_before_the_view_runs(server):
    worker = make_worker()
    sock = connect(server)
    sock.sendall(
        b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {worker.token}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n"
    )
    sock.sendall(b"0\r\n\r\n")
    status, _, body = read_response(sock)
    sock.close()

    assert (status, body) == (204, b"")


def test_expect_100_continue_gets_its_interim_answer_before_the_body(server):
    worker = make_worker()
    body = b'{"wait_seconds": 0}'
    sock = connect(server)
    sock.sendall(
        request_bytes("POST", "/api/v1/claim", body, token=worker.token)[: -len(body)]
        .replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    )  # fmt: skip
    sock.settimeout(10)
    interim = sock.recv(25)
    sock.sendall(body)
    status, _, answer = read_response(sock)
    sock.close()

    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert (status, answer) == (204, b"")


def test_a_body_declared_too_large_is_refused_unread_and_the_connection_closed(
    server,
):
    worker = make_worker()
    sock = connect(server)
    sock.sendall(
        b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {worker.token}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n{"
    )
    status, headers, body = read_response(sock)
    closed = closed_by_server(sock, timeout=5)
    sock.close()

    assert (status, json.loads(body)["error"]) == (413, "payload_too_large")
    assert headers["connection"] == "close" and closed


def test_a_head_over_64_kib_is_a_431(server):
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    sock.sendall(b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 200) for n in range(400)))
    status, _, body = read_response(sock)
    sock.close()

    assert (status, json.loads(body)["error"]) == (431, "headers_too_large")


def test_a_completion_of_6_mb_waits_on_disk_and_is_stored(server):
    worker = make_worker()
    make_batch(1, now=timezone.now())
    status, body, _ = call(server, "POST", "/api/v1/claim", b"{}", token=worker.token)
    job = json.loads(body)["job"]
    text = "word " * (6 * 1024 * 1024 // 5)
    payload = json.dumps({"lease_token": job["lease_token"], "result": {"text": text}})

    status, body, _ = call(
        server,
        "POST",
        f"/api/v1/jobs/{job['id']}/complete",
        payload.encode(),
        token=worker.token,
    )

    assert (status, json.loads(body)) == (200, {"status": "completed"})
    stored = Job.objects.get(pk=job["id"])
    assert stored.status == JobStatus.COMPLETED
    assert stored.result["text"] == text


def test_a_manifest_upload_through_the_web_form_passes_through_the_spool(tmp_path):
    """A 5 MB manifest (a body larger than what stays in memory: it waits in a
    spool file while the event loop reads it), taken in within the request."""
    lines = [f"s3://bucket/audio/{n:06d}.flac" for n in range(160_000)]
    manifest = ("\n".join(lines) + "\n").encode()
    assert len(manifest) > MEMORY_BODY_BYTES
    make_user("ana", "Operators")
    env = {
        "RECALL_BACKGROUND_INTAKE_BYTES": str(10 * 1024 * 1024),
        "DATABASE_URL": served_database_url(),
    }
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=ROOT,
        env={**os.environ, **env, "RECALL_VAR_DIR": str(tmp_path)},
        check=True,
        timeout=120,
    )
    with serving(tmp_path, 2, 4, env=env) as (port, _):
        base = f"http://127.0.0.1:{port}"
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        page = opener.open(f"{base}/accounts/login/", timeout=30).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]
        opener.open(
            f"{base}/accounts/login/",
            urllib.parse.urlencode(
                {"username": "ana", "password": "pw", "csrfmiddlewaretoken": token}
            ).encode(),
            timeout=30,
        )
        page = opener.open(f"{base}/batches/new/", timeout=30).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]
        boundary = "recall-upload"
        fields = {"csrfmiddlewaretoken": token, "name": "Uploaded", "priority": "0"}
        body = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'
            f"{v}\r\n".encode()
            for k, v in fields.items()
        )
        body += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="manifest"; '
            f'filename="m.txt"\r\nContent-Type: text/plain\r\n\r\n'
        ).encode()
        body += manifest + f"\r\n--{boundary}--\r\n".encode()
        answer = opener.open(
            urllib.request.Request(
                f"{base}/batches/new/",
                data=body,
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            ),
            timeout=120,
        )

        assert answer.status == 200
        batch = Batch.objects.get(name="Uploaded")
        assert answer.url == f"{base}/batches/{batch.pk}/"
        assert batch.total == 160_000
