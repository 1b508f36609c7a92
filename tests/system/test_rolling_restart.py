"""Rolling restarts behind one address: two web nodes (gunicorn, 2 processes x
4 threads each) behind nginx with deploy/nginx/recall.conf, 16 reference
workers claiming through nginx over https. While they work, each node gets
gunicorn's graceful reload (SIGHUP), then each is stopped (SIGTERM) and
started again, one after the other, as docs/operations/production.md says.
Then both serve 100 more jobs and the workers stop (releasing their leases).
Nothing may be lost: every lease completed or released, none expired, no
job's completion accepted twice, every item done or queued, and no 5xx from
nginx or gunicorn."""

from __future__ import annotations

import re
import signal
import time

import pytest
from django.db.models import Count
from django.utils import timezone

from batches.models import BatchItem, ItemStatus
from engine.manifests import create_batch
from jobs.models import Lease, LeaseEnd
from tests.support.factories import make_worker
from tests.support.stack import (
    Gunicorn,
    Nginx,
    direct_url,
    reference_worker,
    server_env,
    wait_for,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

WORKERS = 16
ITEMS = 1200
LEASE = 15


def done() -> int:
    return BatchItem.objects.filter(status=ItemStatus.DONE).count()


def test_rolling_restarts_behind_nginx_lose_nothing(tmp_path):
    env = server_env(
        tmp_path,
        direct_url(),
        RECALL_BEHIND_PROXY="on",
        RECALL_LEASE_SECONDS=str(LEASE),
        ALLOWED_HOSTS="127.0.0.1,localhost",
    )
    nodes: list[Gunicorn] = []
    workers: list = []
    proxy = None
    steps: list[str] = []
    statuses: list[int] = []
    at_end = 0
    try:
        nodes += [Gunicorn(tmp_path, env, processes=2, threads=4) for _ in range(2)]
        proxy = Nginx([node.port for node in nodes])
        lines = [f"file:///audio/rolling/{n:05d}.wav\n" for n in range(ITEMS)]
        create_batch("rolling", lambda: iter(lines), now=timezone.now())
        url = f"https://127.0.0.1:{proxy.https_port}"
        tokens = [make_worker(f"gpu-{i}").token for i in range(WORKERS)]
        options = ("--poll-max", "1", "--retry-max", "1")
        workers += [
            reference_worker(
                tmp_path, f"worker-{i}", token, url, *options, ca=proxy.cert
            )
            for i, token in enumerate(tokens)
        ]
        wait_for(lambda: done() >= 50, 60, "the workers to get going")
        for node in nodes:  # gunicorn's graceful reload, one node at a time
            started, before = time.monotonic(), done()
            node.reload()
            steps.append(
                f"reload :{node.port} {time.monotonic() - started:.1f} s "
                f"({done() - before} done meanwhile)"
            )
            # The next step once this one is over, as an operator would go on:
            # the new processes have taken work (20 more jobs, a second or so).
            reloaded = done()
            wait_for(lambda r=reloaded: done() >= r + 20, 30, "20 more jobs")
        for node in nodes:  # a full stop and start, one node at a time:
            started, before = time.monotonic(), done()
            node.stop()  # refuses new connections (nginx goes to the other)
            stopped = time.monotonic() - started  # and finishes what it has
            node.start()
            node.wait_healthy()
            steps.append(
                f"stop :{node.port} {stopped:.1f} s, start "
                f"{time.monotonic() - started - stopped:.1f} s "
                f"({done() - before} done meanwhile)"
            )
        at_end = done()
        assert at_end < ITEMS - 100, "the batch ran out before the restarts were over"
        # Both restarted nodes serve: 100 more jobs, then the workers stop
        # (each releases the lease it holds).
        wait_for(lambda: done() >= at_end + 100, 60, "100 more jobs")
    finally:
        for worker in workers:  # all at once: each releases its lease
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.popen is not None
            worker.popen.wait(timeout=30)
        for node in nodes:
            node.stop()
        if proxy is not None:
            statuses = proxy.statuses()
            proxy.stop()
    print(
        f"rolling: {'; '.join(steps)}; {at_end} of {ITEMS} done by then, "
        f"{done()} when the workers stopped"
    )
    print(f"rolling: nginx answered {len(statuses)} requests: "
          f"{sorted(set(statuses))}")  # fmt: skip

    assert [s for s in statuses if s >= 500] == []
    for node in nodes:
        served = [
            int(m[1]) for m in re.finditer(r'" (\d{3}) ', node.access_log.read_text())
        ]
        assert served and max(served) < 500
        assert "Traceback" not in node.log.read_text(), node.log.read_text()
    ends = dict(
        Lease.objects.values_list("end_reason").annotate(n=Count("id")).order_by()
    )
    print(f"rolling: leases by how they ended: {ends}")
    assert ends.get(LeaseEnd.EXPIRED, 0) == 0
    assert ends.get(LeaseEnd.FORCED, 0) == 0
    assert set(ends) <= {LeaseEnd.COMPLETED, LeaseEnd.RELEASED}
    assert ends[LeaseEnd.COMPLETED] == done()
    assert Lease.objects.filter(ended_at__isnull=True).count() == 0
    assert (
        BatchItem.objects.exclude(
            status__in=[ItemStatus.DONE, ItemStatus.QUEUED]
        ).count()
        == 0
    )
    twice = (
        Lease.objects.filter(end_reason=LeaseEnd.COMPLETED)
        .values("job")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    assert list(twice) == []
    for worker in workers:
        log = worker.log.read_text()
        assert "Traceback" not in log, log
