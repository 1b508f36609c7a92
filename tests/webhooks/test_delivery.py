"""Delivering webhooks to a real HTTP receiver (a server in a thread on
127.0.0.1): signatures checked by an independent implementation, the retry
schedule driven with an explicit clock, timeouts, connection errors, 410,
redirects, and nothing sent again after a 2xx."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
from datetime import timedelta

import pytest
from django.test.utils import override_settings
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from engine.tasks import deliver_webhooks
from engine.webhooks import delivery
from jobs import transitions
from jobs.models import (
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from tests.support.factories import T0, claim, later, make_batch, make_endpoint
from tests.support.receiver import Answer

pytestmark = pytest.mark.django_db


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """The Standard Webhooks check, written here from the specification alone
    (not with Recall's code): HMAC-SHA256 over "{id}.{timestamp}.{body}", keyed
    by the base64 after "whsec_", compared with every "v1," signature."""
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
    return any(
        version == "v1" and hmac.compare_digest(signature.encode(), expected)
        for version, _, signature in (
            part.partition(",") for part in headers["webhook-signature"].split(" ")
        )
    )


def finished_batch(worker, *, at=T0):
    """A one-item batch completed at ``at``: its batch.finished event."""
    batch = make_batch(1)
    job = claim(worker, at)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=at
    )
    return WebhookEvent.objects.get(batch=batch, type="batch.finished")


def the_delivery() -> WebhookDelivery:
    return WebhookDelivery.objects.get()


def test_a_delivery_is_signed_and_verifies_independently(worker, receiver):
    endpoint = make_endpoint(receiver.url)
    event = finished_batch(worker)

    assert delivery.deliver(now=later(1)).delivered == 1

    [request] = receiver.received
    assert request.path == "/hooks"
    assert request.body == event.body.encode()
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == event.webhook_id
    assert request.headers["webhook-timestamp"] == str(int(later(1).timestamp()))
    assert request.headers["webhook-signature"].startswith("v1,")
    assert verify(endpoint.secret, request.headers, request.body)
    assert not verify(make_endpoint().secret, request.headers, request.body)
    tampered = request.body.replace(b'"done":1', b'"done":2')
    assert not verify(endpoint.secret, request.headers, tampered)
    assert request.json["type"] == "batch.finished"


def test_secret_rotation_signs_with_both_for_the_documented_period(
    worker, receiver, settings
):
    settings.RECALL_WEBHOOK_ROTATION_HOURS = 24
    endpoint = make_endpoint(receiver.url)
    new = transitions.rotate_webhook_secret(endpoint, now=T0)
    finished_batch(worker)
    finished_batch(worker, at=later(24 * 3600))

    delivery.deliver(now=later(1))
    delivery.deliver(now=later(24 * 3600 + 1))

    during, after = receiver.received
    assert len(during.headers["webhook-signature"].split(" ")) == 2
    assert verify(new, during.headers, during.body)
    assert verify(endpoint.secret, during.headers, during.body)
    assert len(after.headers["webhook-signature"].split(" ")) == 1
    assert verify(new, after.headers, after.body)
    assert not verify(endpoint.secret, after.headers, after.body)


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[5, 300])
def test_retries_follow_the_configured_delays_then_give_up(worker, receiver):
    make_endpoint(receiver.url)
    event = finished_batch(worker)
    receiver.answers = [Answer(500), Answer(503, b"busy"), Answer(502)]

    assert delivery.deliver(now=T0).retrying == 1
    assert the_delivery().next_attempt_at == later(5)
    assert delivery.deliver(now=later(4)).as_dict() == delivery.Report().as_dict()
    assert delivery.deliver(now=later(5)).retrying == 1
    assert the_delivery().next_attempt_at == later(305)
    assert len(receiver.received) == 2
    assert delivery.deliver(now=later(304)).retrying == 0
    assert delivery.deliver(now=later(305)).gave_up == 1

    assert [r.headers["webhook-id"] for r in receiver.received] == [
        event.webhook_id
    ] * 3
    stamps = [int(r.headers["webhook-timestamp"]) for r in receiver.received]
    assert stamps == [int(t.timestamp()) for t in (T0, later(5), later(305))]
    done = the_delivery()
    assert (done.status, done.attempts, done.last_status_code) == ("failed", 3, 502)
    assert done.finished_at == later(305)
    assert done.last_error == "Gave up after 3 attempts. Last: "
    attempts = list(WebhookAttempt.objects.order_by("number"))
    assert [(a.number, a.status_code, a.started_at) for a in attempts] == [
        (1, 500, T0),
        (2, 503, later(5)),
        (3, 502, later(305)),
    ]
    assert attempts[1].response_excerpt == "busy"
    assert all(a.duration_ms is not None and a.finished_at for a in attempts)
    assert delivery.deliver(now=later(100_000)).as_dict() == delivery.Report().as_dict()
    assert len(receiver.received) == 3


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[5], RECALL_WEBHOOK_TIMEOUT_SECONDS=1)
def test_a_receiver_that_does_not_answer_in_time_is_retried(worker, receiver):
    make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(200, delay=3)]

    assert delivery.deliver(now=T0).retrying == 1

    attempt = WebhookAttempt.objects.get()
    assert attempt.status_code is None
    assert attempt.error == "Timed out after 1 s."
    assert 900 <= attempt.duration_ms < 2500
    assert the_delivery().next_attempt_at == later(5)
    assert delivery.deliver(now=later(5)).delivered == 1


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[5], RECALL_WEBHOOK_TIMEOUT_SECONDS=2)
def test_a_receiver_that_drips_its_answer_is_cut_at_the_timeout(worker, receiver):
    """The timeout is for the whole exchange, not for each read."""
    make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(hang=True)]

    assert delivery.deliver(now=T0).retrying == 1

    attempt = WebhookAttempt.objects.get()
    assert attempt.error == "Timed out after 2 s."
    assert attempt.duration_ms < 4000


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[5])
def test_a_connection_error_is_retried(worker, settings):
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    make_endpoint(f"http://127.0.0.1:{port}/hooks")
    finished_batch(worker)

    assert delivery.deliver(now=T0).retrying == 1

    attempt = WebhookAttempt.objects.get()
    assert attempt.status_code is None
    assert attempt.error.startswith("Connection failed: ")
    assert the_delivery().next_attempt_at == later(5)


def test_after_a_2xx_the_receiver_never_gets_another_attempt(worker, receiver):
    make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(204, b"")]

    assert delivery.deliver(now=T0).delivered == 1
    for seconds in (0, 5, 300, 10**6):
        assert delivery.deliver(now=later(seconds)).delivered == 0
    assert delivery.dispatch(budget=1).as_dict() == delivery.Report().as_dict()

    assert len(receiver.received) == 1
    done = the_delivery()
    assert (done.status, done.attempts, done.finished_at) == ("delivered", 1, T0)
    assert done.summary().startswith("delivered ")
    assert done.summary().endswith(", 1 attempt")


def test_a_410_disables_the_endpoint(worker, receiver):
    endpoint = make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(410, b"gone")]

    assert delivery.deliver(now=T0).gave_up == 1

    endpoint.refresh_from_db()
    assert endpoint.is_active is False
    assert endpoint.disabled_reason.startswith("The endpoint answered 410 Gone")
    assert the_delivery().status == "failed"
    finished_batch(worker)  # a later event is kept, but not sent while disabled
    assert WebhookDelivery.objects.count() == 1
    assert delivery.deliver(now=later(10)).as_dict() == delivery.Report().as_dict()
    assert len(receiver.received) == 1


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[5])
def test_redirects_are_not_followed(worker, receiver):
    make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(302, b"", {"Location": receiver.url + "/elsewhere"})]

    assert delivery.deliver(now=T0).retrying == 1

    assert [r.path for r in receiver.received] == ["/hooks"]
    assert WebhookAttempt.objects.get().status_code == 302


def test_the_response_excerpt_is_kept_short(worker, receiver):
    make_endpoint(receiver.url)
    finished_batch(worker)
    receiver.answers = [Answer(200, "é".encode() + b"x" * 5000 + b"\x00")]

    delivery.deliver(now=T0)

    attempt = WebhookAttempt.objects.get()
    assert attempt.response_excerpt == "é" + "x" * (delivery.EXCERPT_BYTES - 2)


def test_the_destination_is_checked_again_before_each_attempt(
    worker, receiver, settings
):
    """Created while private addresses were allowed; then they are not: the
    attempt is refused before any connection (``localhost`` resolves to
    loopback)."""
    port = receiver.server.server_address[1]
    make_endpoint(f"http://localhost:{port}/hooks")
    finished_batch(worker)
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = False

    assert delivery.deliver(now=T0).retrying == 1

    assert receiver.received == []
    error = WebhookAttempt.objects.get().error
    assert error.startswith("Destination refused: localhost resolves to ")
    assert "a loopback address" in error


def test_the_first_attempt_is_queued_for_the_cluster_when_the_event_commits(
    worker, receiver, django_capture_on_commit_callbacks
):
    make_endpoint(receiver.url)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        event = finished_batch(worker)
    assert len(callbacks) == 1
    [queued] = OrmQ.objects.all()
    task = SignedPackage.loads(queued.payload)
    assert task["func"] == "engine.tasks.deliver_webhooks"
    assert task["args"] == ([the_delivery().pk],)

    # What the cluster runs: the task, with ids only.
    report = deliver_webhooks(*task["args"])

    assert report["delivered"] == 1
    assert [r.headers["webhook-id"] for r in receiver.received] == [event.webhook_id]


def test_nothing_is_queued_when_the_transaction_rolls_back(
    worker, receiver, django_capture_on_commit_callbacks
):
    from django.db import transaction

    make_endpoint(receiver.url)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        try:
            with transaction.atomic():
                finished_batch(worker)
                raise RuntimeError("changed our mind")
        except RuntimeError:
            pass
    assert callbacks == []
    assert not OrmQ.objects.exists()
    assert not WebhookEvent.objects.exists()


@override_settings(RECALL_WEBHOOK_RETRY_SECONDS=[1, 1])
def test_the_dispatcher_honours_short_delays_in_real_time(worker, receiver):
    """dispatch() delivers, then stays while a retry falls due soon: the
    retries arrive about a second apart, the schedule's delays."""
    make_endpoint(receiver.url)
    finished_batch(worker, at=transitions.now())
    receiver.answers = [Answer(500), Answer(500)]

    report = delivery.dispatch([the_delivery().pk], budget=30)

    assert report.as_dict() == {"delivered": 1, "retrying": 2, "gave_up": 0, "lost": 0}
    first, second, third = receiver.wait_for(3)
    for earlier, later_one in ((first, second), (second, third)):
        assert 0.9 <= later_one.at - earlier.at <= 3.0
    assert the_delivery().status == "delivered"


def test_the_dispatcher_stays_only_while_an_attempt_falls_due_soon(worker):
    make_endpoint()
    finished_batch(worker, at=transitions.now())
    now = transitions.now()
    pending = the_delivery()

    WebhookDelivery.objects.filter(pk=pending.pk).update(
        next_attempt_at=now + timedelta(seconds=100)
    )
    assert 95 <= delivery.seconds_until_due() <= 100
    WebhookDelivery.objects.filter(pk=pending.pk).update(
        next_attempt_at=now + delivery.HORIZON + timedelta(seconds=30)
    )
    assert delivery.seconds_until_due() is None
    WebhookEndpoint.objects.update(is_active=False)
    WebhookDelivery.objects.filter(pk=pending.pk).update(next_attempt_at=now)
    assert delivery.seconds_until_due() is None  # disabled: waits for re-enabling


def test_a_test_event_goes_to_one_endpoint(receiver):
    endpoint = make_endpoint(receiver.url)
    make_endpoint("https://other.example/")

    event = transitions.send_test_webhook(endpoint, now=T0)
    delivery.deliver(now=T0)

    assert event.type == "webhook.test"
    [request] = receiver.received
    assert request.json["data"]["endpoint"] == {"id": endpoint.pk, "url": receiver.url}
    assert verify(endpoint.secret, request.headers, request.body)


def test_redelivery_sends_the_same_event_again_now(worker, receiver):
    make_endpoint(receiver.url)
    event = finished_batch(worker)
    delivery.deliver(now=T0)

    assert transitions.redeliver_webhooks([event.pk], now=later(60)) == 1
    delivery.deliver(now=later(60))

    first, again = receiver.received
    assert again.headers["webhook-id"] == first.headers["webhook-id"]
    assert again.body == first.body
    assert (the_delivery().status, the_delivery().attempts) == ("delivered", 2)


def test_redelivery_reaches_endpoints_added_since(worker, receiver):
    event = finished_batch(worker)
    assert not WebhookDelivery.objects.exists()
    make_endpoint(receiver.url)

    assert transitions.redeliver_webhooks([event.pk], now=later(1)) == 1
    delivery.deliver(now=later(1))

    assert [json.loads(r.body)["type"] for r in receiver.received] == ["batch.finished"]


def test_a_dispatcher_out_of_time_hands_over_to_the_successor_it_queues(worker):
    """Its budget spent with an attempt still due soon, the dispatcher queues
    one successor; scheduled dispatchers stand aside until that successor has
    started (or is stale), so there is one chain, never a pile of them."""
    from jobs.models import WebhookDispatch
    from jobs.transitions.webhook_writes import HANDOVER_STALE

    make_endpoint()
    finished_batch(worker, at=transitions.now())
    WebhookDelivery.objects.update(
        next_attempt_at=transitions.now() + timedelta(seconds=60)
    )

    assert delivery.dispatch(budget=0).as_dict() == delivery.Report().as_dict()

    state = WebhookDispatch.objects.get()
    assert (state.locked_by, len(state.handover)) == ("", 32)
    [queued] = OrmQ.objects.all()
    task = SignedPackage.loads(queued.payload)
    assert task["func"] == "engine.tasks.dispatch_webhooks"
    assert task["kwargs"] == {"handover": state.handover}
    assert not transitions.acquire_webhook_dispatcher("scheduled", ttl=timedelta(1))
    assert transitions.acquire_webhook_dispatcher(
        "successor", ttl=timedelta(seconds=5), handover=state.handover
    )
    transitions.release_webhook_dispatcher("successor")
    assert WebhookDispatch.objects.get().handover == ""

    # A successor that never starts stops counting after a while.
    WebhookDispatch.objects.update(
        handover="lost", handover_at=transitions.now() - HANDOVER_STALE
    )
    assert transitions.acquire_webhook_dispatcher("scheduled", ttl=timedelta(1))


def test_an_idle_dispatcher_stops_at_once(worker):
    from jobs.models import WebhookDispatch

    assert delivery.dispatch(budget=0).as_dict() == delivery.Report().as_dict()
    state = WebhookDispatch.objects.get()
    assert (state.locked_by, state.handover) == ("", "")
    assert not OrmQ.objects.exists()


def test_the_docs_verification_snippet_verifies_a_real_delivery(worker, receiver):
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "guides" / "webhooks.md"
    snippet = re.search(
        r"To verify, in Python:\n\n```python\n(.*?)```", page.read_text(), re.S
    )
    namespace: dict = {}
    exec(snippet.group(1), namespace)  # the documentation's own code
    endpoint = make_endpoint(receiver.url)
    finished_batch(worker, at=transitions.now())

    delivery.deliver()  # now: the database's clock, so the timestamp is fresh

    [request] = receiver.received
    assert namespace["verify"](endpoint.secret, request.headers, request.body)
    assert not namespace["verify"](
        endpoint.secret, request.headers, request.body + b" "
    )
