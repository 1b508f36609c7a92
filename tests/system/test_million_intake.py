"""A 1,000,000-item manifest uploaded through the web form, end to end: the real
gunicorn (gunicorn.conf.py) answers at once, the real django-q2 cluster takes
it in, and the progress page turns into the batch page.

Before, the request itself ran the intake: about a minute on PostgreSQL, past
gunicorn's 60-second timeout, which killed the worker mid-request.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from django.db import connection

from batches.intake_records import Intake
from batches.models import Batch, BatchItem
from harness.server import PY, ROOT, Process, Server, free_port
from jobs.models import Job
from tests.support.factories import make_user

ITEMS = int(os.environ.get("RECALL_MILLION_ITEMS", "1000000"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def _database_url() -> str:
    s = connection.settings_dict
    return f"postgres://{s['USER'] or 'root'}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def _multipart(fields: dict[str, str], manifest: Path, boundary: str) -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="manifest"; '
        f'filename="{manifest.name}"\r\nContent-Type: text/csv\r\n\r\n'.encode()
    )
    return b"".join(parts) + manifest.read_bytes() + f"\r\n--{boundary}--\r\n".encode()


def test_a_million_item_manifest_through_the_web_form(tmp_path):
    manifest = tmp_path / "million.csv"
    with open(manifest, "w") as f:
        f.write("source,duration_seconds,language\n")
        for i in range(ITEMS):
            f.write(f"s3://archive/audio/{i:07d}.flac,{30 + i % 600},en\n")
    make_user("ana", "Operators")
    from django.contrib.auth.models import User

    user = User.objects.get(username="ana")
    user.set_password("a-long-enough-password")
    user.save()
    port = free_port()  # the server's, in the environment the cluster shares
    env = {
        "PATH": os.environ["PATH"],
        "SECRET_KEY": os.environ["SECRET_KEY"],
        "DATABASE_URL": _database_url(),
        "RECALL_HTTPS": "off",
        "RECALL_BIND": f"127.0.0.1:{port}",
        "RECALL_STARTUP_SWEEP": "off",
        "RECALL_VAR_DIR": str(tmp_path / "var"),
        "RECALL_ACCESS_LOG": str(tmp_path / "access.log"),
        "LOG_LEVEL": "INFO",
    }
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=ROOT, env=env, check=True, timeout=120,
    )  # fmt: skip
    web = Server(env, tmp_path / "gunicorn.log", port=port)
    cluster = Process(
        "qcluster", [PY, "manage.py", "qcluster"], env, tmp_path / "cluster.log"
    )
    base = web.url
    try:
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        deadline = time.monotonic() + 60
        while True:
            try:
                page = opener.open(f"{base}/accounts/login/", timeout=5).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, (
                    tmp_path / "gunicorn.log"
                ).read_text()
                time.sleep(0.2)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        opener.open(
            f"{base}/accounts/login/",
            urllib.parse.urlencode(
                {"username": "ana", "password": "a-long-enough-password",
                 "csrfmiddlewaretoken": token}
            ).encode(),
            timeout=10,
        )  # fmt: skip
        page = opener.open(f"{base}/batches/new/", timeout=10).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        boundary = "recall-million"
        body = _multipart(
            {"csrfmiddlewaretoken": token, "name": "A million", "priority": "0"},
            manifest,
            boundary,
        )

        started = time.monotonic()
        answer = opener.open(
            urllib.request.Request(
                f"{base}/batches/new/",
                data=body,
                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
            ),
            timeout=60,
        )
        answered = time.monotonic() - started

        assert answer.status == 200
        assert re.fullmatch(rf"{base}/intakes/\d+/", answer.url), answer.url
        assert answered < 20, f"the upload took {answered:.1f}s to answer"
        seen = set()
        deadline = time.monotonic() + 240
        while True:
            response = opener.open(answer.url, timeout=30)
            page = response.read().decode()
            if "/batches/" in response.url:
                break
            seen.update(
                re.findall(r"<strong>(Checking every line|Every line is valid)", page)
            )
            assert time.monotonic() < deadline, (
                page + (tmp_path / "cluster.log").read_text()
            )
            time.sleep(1)
        assert "A million" in page
        assert "Checking every line" in seen  # the page showed the check going on
    finally:
        web.stop()
        cluster.stop()

    batch = Batch.objects.get()
    assert (batch.name, batch.total) == ("A million", ITEMS)
    assert Job.objects.filter(batch=batch).count() == ITEMS
    assert (
        BatchItem.objects.filter(batch=batch)
        .order_by("-pk")
        .values_list("source", flat=True)
        .first()
        == f"s3://archive/audio/{ITEMS - 1:07d}.flac"
    )
    assert Intake.objects.get().batch == batch
    assert "Traceback" not in (tmp_path / "gunicorn.log").read_text()
