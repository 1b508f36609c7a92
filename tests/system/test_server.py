"""The production server as configured (gunicorn.conf.py): gthread workers with
a persistent PostgreSQL connection per thread. Several processes and threads serve
the worker API at once; the hot path's prepared statements (jobs/pgsql.py) keep
working on their connections, and the server holds no more connections than
it has threads."""

from __future__ import annotations

import http.client
import json
import socket
import stat
import threading
import time

import pytest
from django.utils import timezone

from harness.server import free_port
from jobs.models import Job, JobStatus, Lease, LeaseEnd
from tests.support.factories import assert_consistent, make_batch, make_worker
from tests.support.server import backends, start_server

PROCESSES, THREADS = 2, 4

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def server(tmp_path):
    process, port, log = start_server(tmp_path, PROCESSES, THREADS)
    yield port, log
    process.terminate()
    process.wait(timeout=30)


def test_threads_keep_their_connections_and_the_hot_path_stays_correct(server):
    port, log = server
    batch = make_batch(240, now=timezone.now())
    workers = [make_worker(f"gpu-{i}") for i in range(12)]
    seen_backends: list[int] = []
    errors: list[str] = []

    def work(worker) -> None:
        headers = {"Authorization": f"Bearer {worker.token}"}
        while True:
            client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            client.request("POST", "/api/v1/claim", "{}", headers)
            response = client.getresponse()
            body = response.read()
            if response.status == 204:
                return
            if response.status != 200:
                errors.append(f"claim {response.status} {body[:200]!r}")
                return
            job = json.loads(body)["job"]
            for path, payload in (
                ("heartbeat", {"lease_token": job["lease_token"]}),
                (
                    "complete",
                    {"lease_token": job["lease_token"], "result": {"text": "ok"}},
                ),
            ):
                client.request(
                    "POST",
                    f"/api/v1/jobs/{job['id']}/{path}",
                    json.dumps(payload),
                    headers,
                )
                response = client.getresponse()
                response.read()
                if response.status != 200:
                    errors.append(f"{path} {response.status}")

    threads = [threading.Thread(target=work, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        seen_backends.append(backends())
        time.sleep(0.05)

    assert errors == []
    assert Job.objects.filter(batch=batch, status=JobStatus.COMPLETED).count() == 240
    assert (
        Lease.objects.filter(job__batch=batch, end_reason=LeaseEnd.COMPLETED).count()
        == 240
    )
    assert_consistent(timezone.now())
    # 12 clients at once, but never more connections than threads.
    assert 0 < max(seen_backends) <= PROCESSES * THREADS
    text = log.read_text()
    assert "Using worker: recall_site.gunicorn_worker.ThreadWorker" in text
    assert "Traceback" not in text


def test_a_process_with_no_free_thread_takes_no_new_connection(tmp_path):
    """2 processes x 2 threads; 3 requests hang (their bodies never come), so one
    process has no free thread. Every new request must still be answered at
    once, by the other process: the busy one is not listening."""
    process, port, _log = start_server(tmp_path, 2, 2)
    stuck = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(
                b"POST /api/v1/claim HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer nobody\r\nContent-Length: 100\r\n\r\n"
            )
            stuck.append(sock)
            time.sleep(0.3)  # accepted, and its thread waiting for the body
        took = []
        for _ in range(20):
            t0 = time.perf_counter()
            probe = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            probe.request("GET", "/healthz")
            assert probe.getresponse().status == 200
            took.append(time.perf_counter() - t0)
            probe.close()
    finally:
        for sock in stuck:
            sock.close()
        process.terminate()
        process.wait(timeout=30)

    assert max(took) < 1.0, took


def test_a_master_has_a_control_socket_only_at_a_path_of_its_own(tmp_path):
    """gunicorn's default control socket is one path for every master of a
    user, each taking it over: Recall's masters have none unless
    RECALL_CONTROL_SOCKET names one, and two named ones live side by side."""
    dirs = [tmp_path / name for name in ("a", "b", "plain")]
    for path in dirs:
        path.mkdir()
    ctl = [dirs[0] / "gunicorn.ctl", dirs[1] / "gunicorn.ctl"]
    servers = [
        start_server(dirs[0], 1, 2, env={"RECALL_CONTROL_SOCKET": str(ctl[0])}),
        start_server(dirs[1], 1, 2, env={"RECALL_CONTROL_SOCKET": str(ctl[1])}),
        start_server(dirs[2], 1, 2),
    ]
    try:

        def listening(path, log) -> bool:
            return f"Control socket listening at {path}" in log.read_text()

        deadline = time.monotonic() + 30
        while not all(listening(p, s[2]) for p, s in zip(ctl, servers, strict=False)):
            assert time.monotonic() < deadline, [s[2].read_text() for s in servers]
            time.sleep(0.05)
        assert all(stat.S_ISSOCK(path.stat().st_mode) for path in ctl)
        assert "Control socket" not in servers[2][2].read_text()

        servers[0][0].terminate()
        servers[0][0].wait(timeout=30)
        assert not ctl[0].exists()
        assert stat.S_ISSOCK(ctl[1].stat().st_mode)
    finally:
        for process, _, _ in servers:
            process.terminate()
            process.wait(timeout=30)


def test_a_database_down_at_start_up_is_one_line_and_the_server_serves(tmp_path):
    """The start-up sweep cannot reach the database: the master logs one line
    (a traceback is what the chaos verdict counts as a crash), starts its
    workers all the same, and /readyz answers why it is not ready."""
    down = f"postgres://root@127.0.0.1:{free_port()}/recall"
    process, port, log = start_server(
        tmp_path, 1, 2, env={"DATABASE_URL": down, "RECALL_STARTUP_SWEEP": "full"}
    )
    try:
        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        probe.request("GET", "/readyz")
        response = probe.getresponse()
        body = json.loads(response.read())
        probe.close()
    finally:
        process.terminate()
        process.wait(timeout=30)

    assert response.status == 503
    assert body["reasons"] == ["database unreachable: OperationalError"]
    text = log.read_text()
    assert text.count("start-up sweep failed, database unavailable: ") == 1
    assert "Traceback" not in text
