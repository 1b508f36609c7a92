"""Webhook secrets (format, encrypted at rest, SECRET_KEY rotation) and the
destination rules (no SSRF), without the network: nothing here connects."""

from __future__ import annotations

import base64
import ipaddress

import pytest

from engine.webhooks.destinations import DestinationRefused, refusal, resolve
from jobs import webhook_keys as webhook_secrets
from jobs.models import WebhookEndpoint
from tests.support.factories import make_endpoint


def test_a_secret_is_whsec_and_base64_of_32_random_bytes():
    secret = webhook_secrets.new_secret()

    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == 32
    assert webhook_secrets.new_secret() != secret


@pytest.mark.django_db
def test_the_secret_is_stored_encrypted_and_decrypts(settings):
    endpoint = make_endpoint()
    stored = WebhookEndpoint.objects.get(pk=endpoint.pk).secret_encrypted

    assert endpoint.secret not in stored
    assert endpoint.secret.removeprefix("whsec_") not in stored
    assert webhook_secrets.decrypt(stored) == endpoint.secret

    # SECRET_KEY rotated the Django way: the old key kept as a fallback.
    old = settings.SECRET_KEY
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "a-new-key" * 5, [old]
    assert webhook_secrets.decrypt(stored) == endpoint.secret
    settings.SECRET_KEY_FALLBACKS = []
    with pytest.raises(webhook_secrets.SecretUnreadable, match="SECRET_KEY"):
        webhook_secrets.decrypt(stored)


ALWAYS_REFUSED = [
    "169.254.169.254",
    "169.254.0.1",
    "fd00:ec2::254",
    "fe80::1",
    "100.100.100.200",
    "168.63.129.16",
    "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::1",
    "0.0.0.0",
    "::",
    "224.0.0.1",
    "255.255.255.255",
    "240.0.0.1",
]
PRIVATE = [
    "127.0.0.1",
    "127.1.2.3",
    "::1",
    "::ffff:127.0.0.1",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "100.64.0.1",
    "fc00::1",
]
PUBLIC = ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111"]


@pytest.mark.parametrize("address", ALWAYS_REFUSED)
def test_link_local_metadata_and_non_unicast_are_always_refused(address):
    ip = ipaddress.ip_address(address)
    assert refusal(ip, allow_private=True) is not None
    assert refusal(ip, allow_private=False) is not None


@pytest.mark.parametrize("address", PRIVATE)
def test_loopback_and_private_are_refused_unless_allowed(address):
    ip = ipaddress.ip_address(address)
    assert "RECALL_WEBHOOK_ALLOW_PRIVATE=on" in refusal(ip, allow_private=False)
    assert refusal(ip, allow_private=True) is None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address):
    assert refusal(ipaddress.ip_address(address), allow_private=False) is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/", "Only http:// and https://"),
        ("file:///etc/passwd", "Only http:// and https://"),
        ("https:///path", "no host"),
        ("https://user:pw@example.com/", "credentials"),
        ("https://example.com/#x", "fragment"),
        ("https://example.com:0/", "port"),
        ("https://example.com:99999/", "Not a valid URL"),
        ("https://exa mple.com/", "spaces"),
        ("https://example.com/\x00", "control"),
        ("", "Give a URL"),
        ("https://example.com/" + "a" * 2000, "longer than"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(url, why):
    with pytest.raises(DestinationRefused, match=why):
        resolve(url, allow_private=True)


def test_a_name_that_resolves_to_a_refused_address_is_refused():
    with pytest.raises(DestinationRefused, match=r"localhost resolves to .*loopback"):
        resolve("http://localhost:8080/hooks", allow_private=False)


def test_allowed_destinations_keep_the_checked_addresses():
    checked = resolve("http://localhost:8080/hooks?x=1", allow_private=True)

    assert (checked.scheme, checked.host, checked.port) == ("http", "localhost", 8080)
    assert checked.target == "/hooks?x=1"
    assert set(checked.addresses) <= {"127.0.0.1", "::1"}
    assert resolve("https://[::1]/", allow_private=True).port == 443
