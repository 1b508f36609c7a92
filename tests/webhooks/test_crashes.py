"""Deliveries survive crashes and never run twice at once (real commits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

from jobs import transitions
from jobs.models import WebhookAttempt, WebhookDelivery, WebhookEvent
from jobs.transitions.webhooks import INTERRUPTED
from jobs.webhooks import delivery
from tests.support.factories import claim, make_batch, make_endpoint, make_worker
from tests.support.receiver import Answer
from tests.support.threads import run_threads

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.django_db(transaction=True)


def _finish_batches(n: int) -> list[WebhookEvent]:
    worker = make_worker("w")
    for i in range(n):
        batch = make_batch(1, name=f"b{i}")
        job = claim(worker, transitions.now())
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "x"})
        assert WebhookEvent.objects.filter(batch=batch).count() == 1
    return list(WebhookEvent.objects.order_by("pk"))


def test_two_deliverers_at_once_never_send_the_same_attempt(receiver):
    make_endpoint(receiver.url)
    events = _finish_batches(12)

    def deliver(i, barrier):
        barrier.wait()
        sent = 0
        while (report := delivery.deliver()).as_dict() != delivery.Report().as_dict():
            sent += report.delivered
        return sent

    assert sum(run_threads(deliver, 4)) == 12

    ids = sorted(r.headers["webhook-id"] for r in receiver.received)
    assert ids == sorted(e.webhook_id for e in events)
    assert set(WebhookDelivery.objects.values_list("status", "attempts")) == {
        ("delivered", 1)
    }


@pytest.mark.postgres
@pytest.mark.slow
def test_a_sigkilled_cluster_mid_delivery_resumes_with_the_same_webhook_id(
    receiver, settings
):
    """The real django-q2 cluster takes the first attempt queued on commit; the
    receiver holds the request; the cluster is SIGKILLed. Once the attempt's
    lease runs out, the delivery is made again, with the same webhook-id."""
    make_endpoint(receiver.url)
    receiver.answers = [Answer(hang=True)]
    [event] = _finish_batches(1)  # commits, and queues the first attempt
    database = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": (
            f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}"
            f"/{database['NAME']}"
        ),
        "RECALL_WEBHOOK_ALLOW_PRIVATE": "on",
        "RECALL_WEBHOOK_TIMEOUT_SECONDS": "60",
        "LOG_LEVEL": "WARNING",
    }
    cluster = subprocess.Popen(
        [sys.executable, "manage.py", "qcluster"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        [first] = receiver.wait_for(1, timeout=60)
    finally:
        os.killpg(cluster.pid, signal.SIGKILL)
        cluster.wait(timeout=30)

    in_flight = WebhookDelivery.objects.get()
    assert (in_flight.status, in_flight.attempts) == ("pending", 1)
    assert in_flight.lease_token is not None
    # Not before its lease runs out (the killed cluster might still be alive)...
    assert delivery.deliver(now=in_flight.leased_until - timedelta(seconds=1)).lost == 0
    assert len(receiver.received) == 1
    # ...then again, as the next dispatcher would.
    report = delivery.deliver(now=in_flight.leased_until + timedelta(seconds=1))

    assert report.delivered == 1
    first, second = receiver.received
    assert (
        first.headers["webhook-id"] == second.headers["webhook-id"] == event.webhook_id
    )
    assert second.body == first.body
    done = WebhookDelivery.objects.get()
    assert (done.status, done.attempts) == ("delivered", 2)
    killed, resumed = WebhookAttempt.objects.order_by("number")
    assert (killed.finished_at, killed.error) == (None, INTERRUPTED)
    assert resumed.status_code == 200
