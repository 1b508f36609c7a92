"""Recall behind Debian's nginx with deploy/nginx/recall.conf (a certificate
made for the test): a worker's claim long-polls through it for 25 s and is
woken by a new batch; a 50 MB manifest upload works; plain HTTP is redirected,
and login, CSRF and Recall's own redirects work over https
(``RECALL_HTTPS=on``, ``RECALL_BEHIND_PROXY=on``); a client sending its body
slowly holds no gunicorn thread (nginx opens no connection to gunicorn until
the body is in); /metrics answers only the address the file allows."""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse

import pytest
from django.conf import settings
from django.utils import timezone

from batches.intake_records import Intake
from jobs.models import JobStatus
from tests.support.factories import jobs_of, make_batch, make_user, make_worker
from tests.support.stack import (
    DEPLOY,
    PY,
    ROOT,
    Gunicorn,
    Nginx,
    call,
    connections_to,
    direct_url,
    server_env,
    wait_for,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

METRICS_TOKEN = "m3tr1cs-" + "abcdefghijklmnopqrstuvwxyz0123456789"
LONG_POLL = 25


def test_the_nginx_file_matches_recalls_limits():
    conf = (DEPLOY / "nginx" / "recall.conf").read_text()
    body = int(re.search(r"client_max_body_size (\d+)m;", conf)[1]) * 1024 * 1024
    limit = settings.RECALL_MAX_MANIFEST_BYTES
    assert limit <= body <= limit + 1024 * 1024
    read = int(re.search(r"proxy_read_timeout (\d+)s;", conf)[1])
    from api.waiter import MAX_WAIT_SECONDS

    assert read > MAX_WAIT_SECONDS
    assert "proxy_request_buffering on;" in conf
    for header in ("X-Forwarded-Proto $scheme", "X-Forwarded-For"):
        assert f"proxy_set_header {header}" in conf


def https(
    port: int, timeout: float = 120, source: str | None = None
) -> http.client.HTTPSConnection:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return http.client.HTTPSConnection(
        "127.0.0.1", port, timeout=timeout, context=context,
        source_address=(source, 0) if source else None,
    )  # fmt: skip


class Browser:
    """Cookies and CSRF over https, as a browser keeps them."""

    def __init__(self, port: int):
        self.port, self.cookies = port, {}
        self.origin = f"https://127.0.0.1:{port}"

    def request(self, method: str, path: str, body: bytes = b"", headers=None):
        client = https(self.port)
        sent = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        sent.update(headers or {})
        client.request(method, path, body or None, sent)
        response = client.getresponse()
        text = response.read().decode(errors="replace")
        for value in response.headers.get_all("Set-Cookie") or []:
            name, rest = value.split("=", 1)
            self.cookies[name] = rest.split(";", 1)[0]
            assert "Secure" in value, value
        client.close()
        return response.status, response.getheader("Location"), text

    def form_token(self, path: str) -> str:
        status, _, page = self.request("GET", path)
        assert status == 200, page[:500]
        return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]


def test_recall_behind_nginx(tmp_path):
    make_user("ana", "Operators")
    worker = make_worker("gpu-1")
    env = server_env(
        tmp_path,
        direct_url(),
        RECALL_HTTPS="on",
        RECALL_BEHIND_PROXY="on",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        RECALL_METRICS_TOKEN=METRICS_TOKEN,
    )
    subprocess.run(
        [PY, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=ROOT, env=env, check=True, timeout=120,
    )  # fmt: skip
    web = Gunicorn(tmp_path, env, processes=2, threads=2)
    proxy = Nginx([web.port], metrics_from="127.0.0.2")
    try:
        # A job to complete slowly later; then the claim that will wait.
        first = make_batch(1, name="first", now=timezone.now())
        status, claimed, _ = call(
            proxy.https_port, "POST", "/api/v1/claim", {}, token=worker.token,
            https=True,
        )  # fmt: skip
        assert status == 200, claimed
        answer: dict = {}

        def long_poll() -> None:
            started = time.monotonic()
            answer["result"] = call(
                proxy.https_port, "POST", "/api/v1/claim", {"wait_seconds": 60},
                token=worker.token, https=True, timeout=120,
            )  # fmt: skip
            answer["took"] = time.monotonic() - started

        poller = threading.Thread(target=long_poll)
        poller.start()
        poll_started = time.monotonic()

        # Plain HTTP: redirected to https by nginx; https: no redirect loop.
        plain = http.client.HTTPConnection("127.0.0.1", proxy.http_port, timeout=10)
        plain.request("GET", "/accounts/login/")
        response = plain.getresponse()
        assert response.status == 301
        assert response.getheader("Location") == "https://127.0.0.1/accounts/login/"
        # Straight to gunicorn without the proxy's header: Recall redirects.
        status, _, headers = call(web.port, "GET", "/accounts/login/")
        assert status == 301 and headers["location"].startswith("https://")

        browser = Browser(proxy.https_port)
        status, location, _ = browser.request("GET", "/batches/new/")
        assert (status, location) == (302, "/accounts/login/?next=/batches/new/")
        token = browser.form_token("/accounts/login/")
        login = urllib.parse.urlencode(
            {"username": "ana", "password": "pw", "csrfmiddlewaretoken": token}
        ).encode()
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        # CSRF over https: a POST from another origin is refused...
        status, _, _ = browser.request(
            "POST", "/accounts/login/", login,
            {**form, "Origin": "https://evil.example"},
        )  # fmt: skip
        assert status == 403
        # ...and one from Recall's own page is accepted and redirected.
        status, location, _ = browser.request(
            "POST", "/accounts/login/", login, {**form, "Origin": browser.origin}
        )
        assert (status, location) == (302, "/overview/")

        # A 50 MB manifest through nginx and the web form.
        line = "https://media.example.org/archive/field-recordings/{:07d}.flac,90\n"
        count = 50 * 1024 * 1024 // len(line.format(0)) + 1
        manifest = ("source,duration_seconds\n" + "".join(
            line.format(n) for n in range(count)
        )).encode()  # fmt: skip
        assert len(manifest) >= 50 * 1024 * 1024
        token = browser.form_token("/batches/new/")
        boundary = "recall-upload"
        fields = {"csrfmiddlewaretoken": token, "name": "Big", "priority": "0"}
        upload = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'
            f"{v}\r\n".encode()
            for k, v in fields.items()
        )
        upload += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="manifest"; '
            f'filename="big.csv"\r\nContent-Type: text/csv\r\n\r\n'
        ).encode()
        upload += manifest + f"\r\n--{boundary}--\r\n".encode()
        sent = time.monotonic()
        status, location, page = browser.request(
            "POST", "/batches/new/", upload,
            {"Content-Type": f"multipart/form-data; boundary={boundary}",
             "Origin": browser.origin},
        )  # fmt: skip
        uploaded = time.monotonic() - sent
        assert status == 302, page[:2000]
        intake = Intake.objects.get()
        assert location == f"/intakes/{intake.pk}/"
        print(
            f"nginx: a {len(manifest) / 2**20:.1f} MiB manifest uploaded in "
            f"{uploaded:.1f} s ({count} items)"
        )

        # A client trickling its body: nginx holds it, gunicorn sees nothing
        # until the last byte, then answers at once.
        job = claimed["job"]
        body = json.dumps(
            {"lease_token": job["lease_token"], "result": {"text": "slow " * 40}}
        ).encode()
        before = connections_to(web.port)  # the long poll's
        raw = socket.create_connection(("127.0.0.1", proxy.https_port), timeout=30)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        slow = context.wrap_socket(raw, server_hostname="localhost")
        slow.sendall(
            (
                f"POST /api/v1/jobs/{job['id']}/complete HTTP/1.1\r\n"
                f"Host: 127.0.0.1:{proxy.https_port}\r\n"
                f"Authorization: Bearer {worker.token}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
        )
        most = 0
        trickle_started = time.monotonic()
        piece = len(body) // 8 + 1
        for start in range(0, len(body) - piece, piece):  # all but the last
            slow.sendall(body[start : start + piece])
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:  # watched, not slept
                most = max(most, connections_to(web.port) - before)
        trickled = time.monotonic() - trickle_started
        slow.sendall(body[start + piece :])
        reply = b""
        while chunk := slow.recv(65536):
            reply += chunk
        slow.close()
        print(
            f"nginx: a body trickled over {trickled:.1f} s; connections from nginx "
            f"to gunicorn meanwhile, beyond the {before} before: {most}"
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert most == 0
        assert jobs_of(first)[0].status == JobStatus.COMPLETED

        # /metrics: only from the address the file names (127.0.0.2 here).
        status, _, _ = call(
            proxy.https_port, "GET", "/metrics", https=True, token=METRICS_TOKEN
        )
        assert status == 403
        allowed = https(proxy.https_port, source="127.0.0.2")
        allowed.request("GET", "/metrics", headers={
            "Authorization": f"Bearer {METRICS_TOKEN}"})  # fmt: skip
        scrape = allowed.getresponse()
        assert scrape.status == 200
        assert b"recall_" in scrape.read()

        # The claim has waited 25 s through nginx: a new batch wakes it.
        wait_for(
            lambda: time.monotonic() - poll_started >= LONG_POLL or None,
            LONG_POLL + 5,
            "the long poll's 25 s",
        )
        assert "result" not in answer
        woken = time.monotonic()
        second = make_batch(1, name="second", now=timezone.now())
        poller.join(timeout=40)
        status, got, _ = answer["result"]
        print(
            f"nginx: a claim waited {answer['took']:.1f} s through nginx, woken "
            f"{time.monotonic() - woken:.2f} s after the batch came"
        )
        assert status == 200, got
        assert got["job"]["id"] == jobs_of(second)[0].pk
        assert time.monotonic() - woken < 3
        assert answer["took"] >= LONG_POLL
    finally:
        error_log = proxy.error_log()
        proxy.stop()
        web.stop()
    problems = [
        line
        for line in error_log.splitlines()
        if re.search(r"\[(error|crit|alert|emerg)\]", line)
        and "access forbidden by rule" not in line  # the refused /metrics
    ]
    assert problems == [], problems
    assert "Traceback" not in web.log.read_text(), web.log.read_text()
