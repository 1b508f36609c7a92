"""Long-poll claims against the real server (gunicorn.conf.py, the thread worker
of recall_site/gunicorn_worker.py): a waiting claim is held without a thread and
woken by the per-process probe when work comes (a new batch, a retry that falls
due, a released lease), answered 204 when its wait is over, dropped when its
client hangs up, and hundreds of them hold neither threads nor connections:
heartbeats go on at full speed."""

from __future__ import annotations

import contextlib
import glob
import http.client
import json
import os
import signal
import socket
import threading
import time

import pytest
from django.utils import timezone

from jobs import transitions
from jobs.models import Job, JobStatus, Lease, Worker
from recall_site.gunicorn_worker import probe_file
from tests.support.factories import assert_consistent, jobs_of, make_batch, make_worker
from tests.support.long_poll import Waiting, parked, post, woken_by_a_new_batch
from tests.support.metrics import samples
from tests.support.server import backends, start_server

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PROCESSES, THREADS = 2, 4


@contextlib.contextmanager
def serving(tmp_path, env: dict):
    """The server (2 processes x 4 threads) with ``env``: (process, port, log);
    stopped after, its log free of tracebacks."""
    process, port, log = start_server(tmp_path, PROCESSES, THREADS, env=env)
    try:
        yield process, port, log
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text, text


@pytest.fixture
def server(tmp_path):
    with serving(tmp_path, {"RECALL_RETRY_BACKOFF_SECONDS": "2"}) as (process, port, _):
        yield process, port


def test_a_new_batch_wakes_a_waiting_claim(server):
    _, port = server
    assert woken_by_a_new_batch(port) < 10


def test_a_retry_falling_due_wakes_a_waiting_claim(server):
    _, port = server
    first, second = make_worker("first"), make_worker("second")
    batch = make_batch(1, now=timezone.now())
    status, body, _ = post(port, first, "claim", {})
    assert status == 200
    job = body["job"]
    status, body, _ = post(
        port,
        first,
        f"jobs/{job['id']}/fail",
        {"lease_token": job["lease_token"], "error": "oom"},
    )
    assert (status, body) == (200, {"status": "queued"})
    due = Job.objects.get(pk=job["id"]).available_at  # 2 s on, the database's clock

    waiting = Waiting(port, second, 30)
    parked(second)
    assert transitions.now() < due
    status, body, _ = waiting.answer()
    answered = transitions.now()

    assert status == 200
    assert body["job"]["id"] == jobs_of(batch)[0].pk
    assert body["job"]["attempt"] == 2
    assert due <= answered
    assert (answered - due).total_seconds() < 2


def test_a_released_lease_wakes_a_waiting_claim(server):
    _, port = server
    holder, waiter = make_worker("holder"), make_worker("waiter")
    make_batch(1, now=timezone.now())
    status, body, _ = post(port, holder, "claim", {})
    assert status == 200
    job = body["job"]
    waiting = Waiting(port, waiter, 30)
    parked(waiter)

    status, body, _ = post(
        port, holder, f"jobs/{job['id']}/release", {"lease_token": job["lease_token"]}
    )
    released = time.monotonic()
    assert status == 200
    status, body, _ = waiting.answer()

    assert status == 200
    assert body["job"]["id"] == job["id"]
    assert time.monotonic() - released < 2
    assert Job.objects.get(pk=job["id"]).leased_by_id == waiter.pk


def test_a_wait_that_finds_nothing_ends_with_204(server):
    _, port = server
    worker = make_worker()

    status, body, took = post(port, worker, "claim", {"wait_seconds": 1.5})

    assert (status, body) == (204, None)
    assert 1.5 <= took < 2.5
    # A claim that does not wait still answers at once.
    status, body, took = post(port, worker, "claim", {})
    assert (status, body) == (204, None)
    assert took < 1


def test_a_claim_that_waited_is_counted_once_with_the_status_it_got(tmp_path):
    """The request metrics count a waiting claim when it is answered: a woken
    claim one 200, a wait that ends one 204 (not also the 204 the view kept
    when it parked); and the claim time is the server's work, not the wait."""
    env = {
        "RECALL_METRICS_TOKEN": "long-poll-metrics-token-5b8d21e07fa9c3",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    with serving(tmp_path, env) as (_, port, _):
        woken_by_a_new_batch(port)
        status, _, took = post(
            port, make_worker("patient"), "claim", {"wait_seconds": 1.5}
        )
        assert status == 204 and took >= 1.5

        client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        client.request(
            "GET",
            "/metrics",
            headers={"Authorization": f"Bearer {env['RECALL_METRICS_TOKEN']}"},
        )
        response = client.getresponse()
        scrape = samples(response.read())
        client.close()

    assert response.status == 200
    counted = {
        dict(key[1:])["status"]: value
        for key, value in scrape.items()
        if key[0] == "recall_api_requests_total"
        and dict(key[1:])["endpoint"] == "claim"
    }
    assert counted == {"200": 1.0, "204": 1.0}
    assert scrape[("recall_claim_seconds_count",)] == 2.0
    assert scrape[("recall_claim_seconds_sum",)] < 1.0


def test_bad_waits_are_400_through_the_server(server):
    _, port = server
    worker = make_worker()
    for value in (-1, 61, "5", True, None):
        status, body, took = post(port, worker, "claim", {"wait_seconds": value})
        assert status == 400
        assert body["error"] == "bad_request"
        assert took < 1


def test_a_waiting_claim_whose_client_hangs_up_leases_nothing(server):
    _, port = server
    gone, present = make_worker("gone"), make_worker("present")
    sock = socket.create_connection(("127.0.0.1", port))
    body = b'{"wait_seconds": 30}'
    sock.sendall(
        b"POST /api/v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {gone.token}\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    parked(gone)
    sock.close()
    time.sleep(0.3)  # the server sees the hang-up on its next loop

    batch = make_batch(1, now=timezone.now())
    status, answer, _ = post(port, present, "claim", {"wait_seconds": 10})

    assert status == 200
    assert answer["job"]["id"] == jobs_of(batch)[0].pk
    assert list(Lease.objects.values_list("worker__name", flat=True)) == ["present"]


def test_a_stopping_server_answers_its_waiting_claims_at_once(server):
    process, port = server
    workers = [make_worker(f"w{i}") for i in range(6)]
    waiting = [Waiting(port, w, 30) for w in workers]
    for worker in workers:
        parked(worker)

    process.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    answers = [w.answer() for w in waiting]

    assert [(status, body) for status, body, _ in answers] == [(204, None)] * 6
    assert time.monotonic() - stopped < 5  # not the 30 s wait, nor the grace
    # The shared probe answer and each process's nudge socket go with it.
    process.wait(timeout=30)
    assert glob.glob(probe_file(process.pid) + "*") == []


def test_many_waiting_claims_hold_no_thread_and_do_not_slow_heartbeats(server):
    """200 claims wait 8 s on 2 processes x 4 threads; once they all wait, a
    worker heartbeats its lease as fast as it can for 5 s. Every heartbeat is
    answered in well under a second, the server holds no more database
    connections than it has threads, and each waiting claim is answered 204
    when its 8 s are over."""
    _, port = server
    make_batch(1, now=timezone.now())
    busy = make_worker("busy")
    status, body, _ = post(port, busy, "claim", {})
    assert status == 200
    job = body["job"]
    idle = [make_worker(f"idle-{i}") for i in range(200)]
    waiting = [Waiting(port, worker, 8) for worker in idle]
    # Every claim has been tried once (each marks its worker seen), then parked.
    deadline = time.monotonic() + 30
    while (
        Worker.objects.filter(name__startswith="idle-", last_seen__isnull=False).count()
        < 200
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)

    beats: list[float] = []
    seen_backends: list[int] = []
    started = time.monotonic()
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": f"Bearer {busy.token}"}
    while time.monotonic() - started < 5:
        t0 = time.monotonic()
        client.request(
            "POST",
            f"/api/v1/jobs/{job['id']}/heartbeat",
            json.dumps({"lease_token": job["lease_token"]}),
            headers,
        )
        response = client.getresponse()
        response.read()
        assert response.status == 200
        beats.append(time.monotonic() - t0)
        seen_backends.append(backends())
        time.sleep(0.02)
    answers = [w.answer() for w in waiting]

    assert [(status, body) for status, body, _ in answers] == [(204, None)] * 200
    assert min(took for _, _, took in answers) >= 8
    assert len(beats) > 50
    beats.sort()
    assert beats[-1] < 1.0, beats[-5:]
    assert max(seen_backends) <= PROCESSES * THREADS
    assert Job.objects.get(pk=job["id"]).status == JobStatus.LEASED
    assert_consistent(timezone.now())


def test_one_wake_gives_each_waiting_claim_its_own_job_until_none_is_left(server):
    """30 claims wait on 2 processes; a batch of 20 comes. Each process's one
    claiming thread hands out what it can: 20 claims get 20 distinct jobs
    within the probe's reach, the other 10 wait on and get their 204."""
    _, port = server
    workers = [make_worker(f"w{i}") for i in range(30)]
    waiting = [Waiting(port, worker, 6) for worker in workers]
    parked(*workers)

    batch = make_batch(20, now=timezone.now())
    answers = [w.answer() for w in waiting]

    won = [
        (w, body)
        for w, (status, body, _) in zip(workers, answers, strict=True)
        if status == 200
    ]
    assert sorted(status for status, _, _ in answers) == [200] * 20 + [204] * 10
    assert sorted(body["job"]["id"] for _, body in won) == sorted(
        job.pk for job in jobs_of(batch)
    )
    for worker, body in won:
        job = Job.objects.get(pk=body["job"]["id"])
        assert (job.status, job.leased_by_id) == (JobStatus.LEASED, worker.pk)
        assert job.lease_token == body["job"]["lease_token"]
    # The ones that got no job waited their whole 6 s.
    assert min(took for status, _, took in answers if status == 204) >= 6
    assert_consistent(timezone.now())


def test_a_woken_claim_is_answered_as_the_view_answers_a_claim(server):
    """The 200 of a woken claim has the body shape and the headers (the
    middleware's among them) of a claim answered at once."""
    _, port = server
    early, late = make_worker("early"), make_worker("late")
    make_batch(2, now=timezone.now())

    def claim(worker: Worker, body: dict):
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        client.request(
            "POST",
            "/api/v1/claim",
            json.dumps(body),
            {"Authorization": f"Bearer {worker.token}"},
        )
        response = client.getresponse()
        payload = json.loads(response.read())
        client.close()
        return response.status, payload, dict(response.getheaders())

    status, direct, direct_headers = claim(early, {})
    assert status == 200
    # Pause the batch so the late claim parks, then resume it to wake it.
    batch = Job.objects.get(pk=direct["job"]["id"]).batch
    transitions.pause_batch(batch)
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(claim(late, {"wait_seconds": 20}))
    )
    thread.start()
    parked(late)
    transitions.resume_batch(batch)
    thread.join(timeout=30)

    status, woken, woken_headers = result[0]
    assert status == 200
    assert woken["job"].keys() == direct["job"].keys()
    assert woken["job"]["item"].keys() == direct["job"]["item"].keys()
    assert woken["job"]["id"] != direct["job"]["id"]
    ignored = {"Date", "Content-Length"}
    assert {k: v for k, v in woken_headers.items() if k not in ignored} == {
        k: v for k, v in direct_headers.items() if k not in ignored
    }


def test_a_worker_disabled_while_it_waits_is_refused_when_work_comes(server):
    """The woken claim re-authenticates: a worker disabled while its claim
    waited gets the view's 403, and no lease."""
    _, port = server
    worker = make_worker("soon-disabled")
    waiting = Waiting(port, worker, 20)
    parked(worker)
    transitions.set_worker_active(Worker.objects.get(pk=worker.pk), False)

    make_batch(1, now=timezone.now())
    status, body, took = waiting.answer()

    assert status == 403
    assert body["error"] == "forbidden"
    assert took < 5
    assert not Lease.objects.exists()


def test_without_nudge_sockets_a_waiting_claim_is_still_woken(tmp_path):
    """A temporary directory too long for a socket's path: the processes go
    without nudges and learn of work when the shared answer turns old."""
    long_tmp = tmp_path / ("t" * 120)
    long_tmp.mkdir()
    with serving(tmp_path, {"TMPDIR": str(long_tmp)}) as (_, port, log):
        woken_by_a_new_batch(port)
    assert "no nudge socket" in log.read_text()


def test_a_server_killed_outright_leaves_files_the_next_one_removes(tmp_path):
    """A master killed with SIGKILL (power loss) never runs ``on_exit``: its
    probe file, its processes' nudge sockets and its metrics directory stay.
    The next server to start with the same temporary directory removes them,
    and long-poll works."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "first").mkdir()
    process, port, _ = start_server(
        tmp_path / "first", PROCESSES, THREADS, env={"TMPDIR": str(tmp)}
    )
    private = tmp / f"recall-{os.getuid()}"  # the server's run directory
    answer = private / os.path.basename(probe_file(process.pid))
    metrics = private / f"metrics-{process.pid}"
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        worker = make_worker("gpu-killed-with-its-server")
        client.request(
            "POST",
            "/api/v1/claim",
            json.dumps({"wait_seconds": 30}),
            {"Authorization": f"Bearer {worker.token}"},
        )
        parked(worker)
        deadline = time.monotonic() + 10
        while not answer.exists():  # the first probe writes it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        left = {str(answer), *glob.glob(f"{answer}-*.sock")}
        assert len(left) == 1 + PROCESSES
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the master and its processes
        process.wait(timeout=30)
        client.close()
    assert all(os.path.exists(path) for path in left)
    assert metrics.is_dir()

    with serving(tmp_path, {"TMPDIR": str(tmp)}) as (_, port, log):
        assert not any(os.path.exists(path) for path in left)
        assert not metrics.exists()
        removed = log.read_text().count("left by a server no longer running")
        assert removed == len(left) + 1
        woken_by_a_new_batch(port)


def test_only_a_waiting_claim_that_can_serve_the_work_is_woken_for_it(server):
    """Two claims wait: the older one offers no labels, the newer one a GPU and
    asks for up to 3 jobs. A batch that requires the GPU comes: the newer
    claim gets both its jobs at once ({"jobs": [...]}), and the older one is
    not handed them, nor answered early: it waits its whole wait for a 204."""
    _, port = server
    plain, gpu = make_worker("plain"), make_worker("gpu")
    batch = make_batch(2, now=timezone.now())
    transitions.pause_batch(batch)
    batch.__class__.objects.filter(pk=batch.pk).update(requires={"gpu": "a100"})
    answers: dict = {}

    def wait(worker, body):
        answers[worker.name] = post(port, worker, "claim", body)

    threads = [
        threading.Thread(target=wait, args=(plain, {"wait_seconds": 4})),
        threading.Thread(
            target=wait,
            args=(gpu, {"wait_seconds": 20, "labels": {"gpu": "a100"}, "max_jobs": 3}),
        ),
    ]
    threads[0].start()
    parked(plain)
    threads[1].start()
    parked(gpu)
    transitions.resume_batch(batch)
    resumed = time.monotonic()
    for thread in threads:
        thread.join(timeout=40)

    status, body, _ = answers["gpu"]
    assert status == 200
    assert sorted(job["id"] for job in body["jobs"]) == [j.pk for j in jobs_of(batch)]
    assert time.monotonic() - resumed >= 0  # (the plain claim's wait, below)
    status, body, took = answers["plain"]
    assert (status, body) == (204, None)
    assert took >= 4
    assert not Job.objects.filter(leased_by=plain).exists()
    assert Worker.objects.get(pk=gpu.pk).labels == {"gpu": "a100"}
    assert_consistent(timezone.now())
