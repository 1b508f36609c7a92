"""Webhooks in the admin: add an endpoint (the secret shown once), refuse a bad
destination, disable, re-enable, rotate the secret, send a test event,
redeliver events, and read every attempt. Permissions gate each action."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from engine.webhooks import delivery
from jobs import transitions
from jobs import webhook_keys as webhook_secrets
from jobs.models import (
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from tests.support.admin import act, messages_of
from tests.support.factories import T0, claim, make_batch, make_endpoint
from tests.support.receiver import Answer

pytestmark = pytest.mark.django_db

ENDPOINTS = "/admin/jobs/webhookendpoint/"
EVENTS = "/admin/jobs/webhookevent/"
ATTEMPTS = "/admin/jobs/webhookattempt/"


def test_adding_an_endpoint_shows_its_secret_once(staff, settings):
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    _user, client = staff(
        "ops", "jobs.add_webhookendpoint", "jobs.view_webhookendpoint"
    )

    response = client.post(
        f"{ENDPOINTS}add/",
        {
            "url": " http://127.0.0.1:9/hooks ",
            "events": ["batch.finished", "item.failed"],
            "description": "pipeline",
        },
    )

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    [(endpoint, secret)] = response.context["secrets"]
    assert secret.encode() in response.content
    stored = WebhookEndpoint.objects.get()
    assert stored.pk == endpoint.pk
    assert (stored.url, stored.events, stored.description) == (
        "http://127.0.0.1:9/hooks",
        "batch.finished,item.failed",
        "pipeline",
    )
    assert webhook_secrets.decrypt(stored.secret_encrypted) == secret
    page = client.get(f"{ENDPOINTS}{stored.pk}/change/")
    assert secret.encode() not in page.content
    assert not LogEntry.objects.filter(change_message__contains=secret).exists()
    assert secret not in str(dict(client.session))


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://169.254.169.254/latest/", "cloud metadata"),
        ("http://localhost:8080/", "loopback"),
        ("gopher://example.com/", "Only http"),
    ],
)
def test_a_refused_destination_is_an_error_on_the_form(staff, url, why):
    _, client = staff("ops", "jobs.add_webhookendpoint", "jobs.view_webhookendpoint")

    response = client.post(
        f"{ENDPOINTS}add/", {"url": url, "events": ["batch.finished"]}
    )

    assert response.status_code == 200
    assert why in str(response.context["adminform"].form.errors["url"])
    assert not WebhookEndpoint.objects.exists()


def test_disable_and_re_enable(staff):
    endpoint = make_endpoint()
    _, client = staff("ops", "jobs.change_webhookendpoint", "jobs.view_webhookendpoint")

    act(client, "disable_endpoints", [endpoint.pk], confirm=False, url=ENDPOINTS)
    endpoint.refresh_from_db()
    assert endpoint.is_active is False
    assert endpoint.disabled_reason == "Disabled by ops in the admin."

    response = act(
        client, "enable_endpoints", [endpoint.pk], confirm=False, url=ENDPOINTS
    )
    endpoint.refresh_from_db()
    assert (endpoint.is_active, endpoint.disabled_reason) == (True, "")
    assert messages_of(response)[-1] == "Re-enabled 1 endpoint."


def test_rotating_a_secret_confirms_then_shows_the_new_one_once(staff):
    endpoint = make_endpoint()
    _, client = staff("ops", "jobs.view_webhookendpoint", "jobs.rotate_webhook_secret")

    page = act(client, "rotate_secrets", [endpoint.pk], confirm=False, url=ENDPOINTS)
    assert page.context["confirmation"].counts == [
        ("Endpoints selected: new secrets", 1)
    ]
    assert WebhookEndpoint.objects.get().previous_secret_encrypted == ""

    response = act(client, "rotate_secrets", [endpoint.pk], confirm=True, url=ENDPOINTS)

    [(_, new)] = response.context["secrets"]
    assert "no-store" in response["Cache-Control"]
    stored = WebhookEndpoint.objects.get()
    assert webhook_secrets.decrypt(stored.secret_encrypted) == new
    assert webhook_secrets.decrypt(stored.previous_secret_encrypted) == endpoint.secret
    assert transitions.webhook_signing_secrets(stored) == [new, endpoint.secret]


def test_rotation_needs_its_permission(staff):
    endpoint = make_endpoint()
    _, client = staff(
        "viewer", "jobs.view_webhookendpoint", "jobs.change_webhookendpoint"
    )

    act(client, "rotate_secrets", [endpoint.pk], confirm=True, url=ENDPOINTS)

    assert WebhookEndpoint.objects.get().previous_secret_encrypted == ""
    page = client.get(ENDPOINTS)
    actions = [
        value for value, _ in page.context["action_form"].fields["action"].choices
    ]
    assert "rotate_secrets" not in actions
    assert "send_test" not in actions


def test_a_test_event_is_delivered_to_the_endpoint(staff, receiver):
    endpoint = make_endpoint(receiver.url)
    _, client = staff("ops", "jobs.view_webhookendpoint", "jobs.send_test_webhook")

    act(client, "send_test", [endpoint.pk], confirm=False, url=ENDPOINTS)
    delivery.deliver()

    [request] = receiver.received
    assert request.json["type"] == "webhook.test"
    assert WebhookEvent.objects.get().webhook_id == request.headers["webhook-id"]


def test_events_attempts_and_redelivery(staff, receiver, worker):
    make_endpoint(receiver.url)
    batch = make_batch(1)
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    receiver.answers = [Answer(500, b"oops")]
    delivery.deliver(now=T0)
    event = WebhookEvent.objects.get()
    _, client = staff(
        "ops",
        "jobs.view_webhookevent",
        "jobs.view_webhookattempt",
        "jobs.redeliver_webhookevent",
    )

    listing = client.get(EVENTS, {"q": str(batch.pk)})
    assert list(listing.context["cl"].result_list) == [event]
    assert list(
        client.get(EVENTS, {"q": event.webhook_id}).context["cl"].result_list
    ) == [event]
    page = client.get(f"{EVENTS}{event.pk}/change/")
    assert page.status_code == 200
    assert b"retrying at" in page.content
    attempts = client.get(ATTEMPTS)
    [attempt] = attempts.context["cl"].result_list
    assert (attempt.status_code, attempt.response_excerpt) == (500, "oops")
    assert b"oops" in attempts.content

    response = act(client, "redeliver", [event.pk], confirm=False, url=EVENTS)
    delivery.deliver()

    assert messages_of(response)[0].startswith("Redelivering 1 event(s): 1 delivery")
    assert [r.headers["webhook-id"] for r in receiver.received] == [
        event.webhook_id
    ] * 2
    assert WebhookDelivery.objects.get().status == "delivered"
    assert WebhookAttempt.objects.count() == 2


def test_events_and_attempts_are_read_only(staff):
    _, client = staff("ops", "jobs.view_webhookevent", "jobs.view_webhookattempt")
    assert client.get(f"{EVENTS}add/").status_code == 403
    assert client.get(f"{ATTEMPTS}add/").status_code == 403


def test_bad_search_input_is_never_a_500(staff):
    _, client = staff("ops", "jobs.view_webhookevent", "jobs.view_webhookattempt")
    for term in ("99999999999999999999999", "\x00", "msg_%", "é"):
        assert client.get(EVENTS, {"q": term}).status_code == 200
        assert client.get(ATTEMPTS, {"q": term}).status_code == 200
