"""Webhook URLs often carry the receiver's credentials (a token in the path or
the query string). Only people with ``jobs.view_webhookendpoint`` see them
whole; everyone else sees scheme, host and port, on every page that names an
endpoint: the batch page and its live fragment, the admin's event page (its
deliveries and a test event's body), the attempts list, and the admin log
(old entries included, rewritten by a migration)."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client

from engine.webhooks import delivery
from jobs import transitions
from jobs.models import WebhookEndpoint, WebhookEvent, url_origin
from tests.support.factories import T0, claim, make_batch, make_endpoint, make_user

pytestmark = pytest.mark.django_db

# A documentation address: refused as a destination, so a delivery attempt is
# recorded without any connection or DNS lookup.
URL = "https://203.0.113.7:8443/recall/PATHTOKEN-9f2c?key=QUERYSECRET-41d0&x=1"
ORIGIN = "https://203.0.113.7:8443"
SECRETS = ("PATHTOKEN-9f2c", "QUERYSECRET-41d0")


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def grant(user, *names: str):
    for name in names:
        app_label, codename = name.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user


def hidden(text: str) -> bool:
    return not any(secret in text for secret in SECRETS)


@pytest.fixture
def finished(worker):
    """A finished batch whose batch.finished delivery to URL has had an
    attempt (refused: a documentation address), and the endpoint."""
    endpoint = make_endpoint(URL)
    batch = make_batch(1)
    job = claim(worker, T0)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    delivery.deliver(now=T0)
    return batch, endpoint


def test_the_origin_is_scheme_host_and_port_only():
    assert url_origin(URL) == ORIGIN
    assert url_origin("http://[2001:db8::1]/a?b=c") == "http://[2001:db8::1]"
    assert url_origin("https://Hooks.Example.com/x") == "https://hooks.example.com"
    assert url_origin("https://[::1") == "(a URL that cannot be shown)"
    assert url_origin("javascript:alert(1)") == "(a URL that cannot be shown)"


@pytest.mark.parametrize("group", ["Viewers", "Operators"])
def test_the_batch_page_shows_viewers_and_operators_only_the_origin(finished, group):
    batch, _ = finished
    client = client_for(make_user("someone", group))

    for path in (f"/batches/{batch.pk}/", f"/batches/{batch.pk}/live"):
        page = client.get(path).content.decode()
        assert f"{ORIGIN}: <span data-delivery-state>" in page, path
        assert hidden(page), path


def test_the_batch_page_shows_the_whole_url_to_those_who_may_see_endpoints(finished):
    batch, _ = finished
    user = grant(make_user("hooks-admin", "Viewers"), "jobs.view_webhookendpoint")

    page = client_for(user).get(f"/batches/{batch.pk}/").content.decode()

    assert "203.0.113.7:8443/recall/PATHTOKEN-9f2c?key=QUERYSECRET-41d0&amp;x=1" in page


def test_the_admin_event_page_and_attempts_list_show_only_the_origin(finished):
    batch, endpoint = finished
    test_event = transitions.send_test_webhook(endpoint, now=T0)
    assert URL in test_event.body  # the receiver is told its own URL
    finish = WebhookEvent.objects.get(batch=batch)
    staff = make_user("auditor", is_staff=True)
    grant(staff, "jobs.view_webhookevent", "jobs.view_webhookattempt")
    client = client_for(staff)

    for event in (finish, test_event):
        page = client.get(f"/admin/jobs/webhookevent/{event.pk}/change/")
        assert page.status_code == 200
        text = page.content.decode()
        assert hidden(text), event.type
        assert f"endpoint {endpoint.pk}: {ORIGIN}" in text  # the delivery inline
    test_page = client.get(f"/admin/jobs/webhookevent/{test_event.pk}/change/")
    assert f"&quot;url&quot;:&quot;{ORIGIN}&quot;" in test_page.content.decode()

    attempts = client.get("/admin/jobs/webhookattempt/")
    assert attempts.status_code == 200
    text = attempts.content.decode()
    assert "Destination refused" in text  # the attempt is listed ...
    assert f"endpoint {endpoint.pk}: {ORIGIN}" in text
    assert hidden(text)  # ... without the URL's secrets

    # With the endpoint permission the event's body is whole.
    grant(staff, "jobs.view_webhookendpoint")
    whole = client_for(staff).get(f"/admin/jobs/webhookevent/{test_event.pk}/change/")
    assert "QUERYSECRET-41d0" in whole.content.decode()


def test_the_admin_log_names_endpoints_by_origin_old_entries_included(finished):
    _, endpoint = finished
    boss = make_user("boss", superuser=True)
    client_for(boss).post(
        "/admin/jobs/webhookendpoint/",
        {
            "action": "disable_endpoints",
            "_selected_action": [str(endpoint.pk)],
            "index": "0",
        },
    )
    assert LogEntry.objects.get().object_repr == f"endpoint {endpoint.pk}: {ORIGIN}"
    # An entry logged before this change named the endpoint by its whole URL.
    LogEntry.objects.create(
        user=boss,
        content_type=ContentType.objects.get_for_model(WebhookEndpoint),
        object_id=str(endpoint.pk),
        object_repr=URL,
        action_flag=CHANGE,
        change_message="Rotated the secret.",
    )
    migration = importlib.import_module(
        "jobs.migrations.0011_webhook_urls_out_of_the_admin_log"
    )
    migration.forget_whole_urls(apps, None)

    reader = grant(make_user("reader", is_staff=True), "admin.view_logentry")
    log = client_for(reader).get("/admin/admin/logentry/").content.decode()

    assert [e.object_repr for e in LogEntry.objects.order_by("pk")] == [
        f"endpoint {endpoint.pk}: {ORIGIN}"
    ] * 2
    assert hidden(log)
    assert hidden(str(WebhookEndpoint.objects.get()))


def test_the_endpoint_admin_still_shows_whole_urls_to_those_allowed(finished):
    staff = grant(make_user("hooks", is_staff=True), "jobs.view_webhookendpoint")

    listing = client_for(staff).get("/admin/jobs/webhookendpoint/").content.decode()

    assert "PATHTOKEN-9f2c?key=QUERYSECRET-41d0" in listing


def test_delivery_logs_name_the_endpoint_by_its_origin(worker, caplog):
    endpoint = make_endpoint(URL)
    make_batch(1)
    job = claim(worker, T0)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )

    with caplog.at_level("INFO", logger="recall.webhooks"):
        delivery.deliver(now=T0)

    assert f"to endpoint {endpoint.pk}: {ORIGIN}, attempt 1" in caplog.text
    assert hidden(caplog.text)
