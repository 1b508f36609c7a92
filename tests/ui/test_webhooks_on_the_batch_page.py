"""The batch page shows the batch's webhook events and their delivery state,
and keeps refreshing until they are delivered."""

from __future__ import annotations

import pytest
from django.utils import timezone

from engine.webhooks import delivery
from jobs import transitions
from jobs.models import WebhookEvent, url_origin
from tests.support.factories import claim, make_batch, make_endpoint
from tests.support.receiver import Answer

pytestmark = pytest.mark.django_db


def _finish(worker, batch, *, fail=False):
    job = claim(worker, now=timezone.now())
    assert job.batch_id == batch.pk
    if fail:
        transitions.fail(
            job, job.lease_token, worker=worker, error="bad", retryable=False
        )
    else:
        transitions.complete(job, job.lease_token, worker=worker, result={"text": "x"})


def test_the_page_shows_each_delivery_and_refreshes_until_delivered(
    viewer_client, worker, receiver, settings
):
    settings.RECALL_WEBHOOK_RETRY_SECONDS = [0, 0]
    make_endpoint(receiver.url, events=("batch.finished", "item.failed"))
    batch = make_batch(2)
    _finish(worker, batch, fail=True)
    _finish(worker, batch)
    event = WebhookEvent.objects.get(type="batch.finished")

    pending = viewer_client.get(f"/batches/{batch.pk}/live")
    text = pending.content.decode()
    assert pending.status_code == 200  # still refreshing: deliveries pending
    assert event.webhook_id in text
    assert "pending: first attempt due now" in text
    assert (
        "item.failed</strong>: 1 delivery: 0 delivered, 1 pending, 0 given up" in text
    )

    receiver.answers = [Answer(500), Answer(500)]
    delivery.deliver()
    retrying = viewer_client.get(f"/batches/{batch.pk}/").content.decode()
    assert "retrying at " in retrying
    delivery.deliver()
    delivery.deliver()

    done = viewer_client.get(f"/batches/{batch.pk}/live")
    text = done.content.decode()
    assert done.status_code == 286  # final, and nothing left to deliver
    local = timezone.localtime(event.deliveries.get().finished_at).strftime("%H:%M")
    # A viewer sees the endpoint's origin only: its path may hold credentials.
    assert (
        f"{url_origin(receiver.url)}: <span data-delivery-state>delivered {local}, "
        f"2 attempts" in text
    )
    assert "1 delivery: 1 delivered, 0 pending, 0 given up" in text


def test_a_finish_without_endpoints_says_so(viewer_client, worker):
    batch = make_batch(1)
    _finish(worker, batch)

    page = viewer_client.get(f"/batches/{batch.pk}/").content.decode()

    assert "no endpoint subscribed" in page


def test_a_running_batch_shows_no_webhook_section(viewer_client):
    batch = make_batch(1)
    assert (
        'id="webhooks"'
        not in viewer_client.get(f"/batches/{batch.pk}/").content.decode()
    )
