"""Deprecated and special IPv6/IPv4 ranges as webhook destinations: site-local
fec0::/10 is a private network, tunnel and translation addresses are judged by
the IPv4 address they carry, and "this network" and documentation ranges are
never a receiver. Literal addresses, so nothing here touches DNS or the network.
"""

from __future__ import annotations

import ipaddress

import pytest
from django.core.management import CommandError, call_command

from engine.webhooks.destinations import DestinationRefused, refusal, resolve
from jobs.models import WebhookEndpoint


def teredo(server: str, client: str, port: int = 40000) -> str:
    """A Teredo address (RFC 4380): 2001:0::/32, the server's IPv4, flags, then
    the client's port and IPv4 address, both inverted."""
    value = (
        (0x20010000 << 96)
        | (int(ipaddress.IPv4Address(server)) << 64)
        | (0x8000 << 48)
        | ((port ^ 0xFFFF) << 32)
        | (int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF)
    )
    return str(ipaddress.IPv6Address(value))


PUBLIC_SERVER = "65.54.227.120"

# Refused unless RECALL_WEBHOOK_ALLOW_PRIVATE=on.
PRIVATE = [
    "fec0::1",  # site-local (RFC 3879): accepted before
    "fec0:0:0:ffff::1",
    "feff:ffff:ffff:ffff::1",  # the top of fec0::/10
    "3fff::1",  # documentation (RFC 9637): accepted before
    "2002:a00:1::1",  # 6to4 carrying 10.0.0.1
    "2002:7f00:1::1",  # 6to4 carrying 127.0.0.1
    "2002:c0a8:101::1",  # 6to4 carrying 192.168.1.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "::ffff:10.0.0.1",  # IPv4-mapped
    "::ffff:172.16.0.1",
    teredo(PUBLIC_SERVER, "8.8.8.8"),  # Teredo is a tunnel, never a receiver
]

# Refused whatever RECALL_WEBHOOK_ALLOW_PRIVATE says.
ALWAYS = [
    "0.1.2.3",  # "this network": allowed with private addresses on before
    "0.255.255.255",
    "::ffff:0.1.2.3",
    teredo(PUBLIC_SERVER, "169.254.169.254"),  # metadata, inside Teredo: before
    teredo("169.254.169.254", "8.8.8.8"),
    teredo(PUBLIC_SERVER, "0.0.0.0"),
    "2002:a9fe:a9fe::1",  # 6to4 carrying the metadata address
    "64:ff9b::a9fe:a9fe",  # NAT64 of it
    "::ffff:169.254.169.254",
    "64:ff9b:1::a00:1",  # local-use NAT64 (RFC 8215): reserved
    "::a00:1",  # IPv4-compatible (deprecated): reserved
]


@pytest.mark.parametrize("address", PRIVATE)
def test_private_and_deprecated_ranges_are_refused_unless_allowed(address):
    ip = ipaddress.ip_address(address)

    why = refusal(ip, allow_private=False)

    assert why is not None, address
    assert "RECALL_WEBHOOK_ALLOW_PRIVATE=on" in why
    with pytest.raises(DestinationRefused, match=r"private|loopback"):
        resolve(f"https://[{address}]/hooks", allow_private=False)


@pytest.mark.parametrize("address", ALWAYS)
def test_special_ranges_and_what_tunnels_carry_are_always_refused(address):
    ip = ipaddress.ip_address(address)

    assert refusal(ip, allow_private=True) is not None, address
    assert refusal(ip, allow_private=False) is not None, address


def test_the_reason_names_what_a_tunnel_carries():
    why = refusal(
        ipaddress.ip_address(teredo(PUBLIC_SERVER, "169.254.169.254")),
        allow_private=True,
    )

    assert why == "a tunnel to 169.254.169.254, a cloud metadata address"
    assert refusal(ipaddress.ip_address("fec0::1"), allow_private=False) == (
        "a private address (set RECALL_WEBHOOK_ALLOW_PRIVATE=on to allow)"
    )


@pytest.mark.parametrize(
    "address",
    ["2002:808:808::1", "::ffff:8.8.8.8", "64:ff9b::808:808", "2606:4700::1111"],
)
def test_public_addresses_behind_tunnels_and_translators_stay_allowed(address):
    assert refusal(ipaddress.ip_address(address), allow_private=False) is None


@pytest.mark.django_db
def test_create_webhook_refuses_a_site_local_receiver(settings):
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = False

    with pytest.raises(CommandError, match=r"fec0::1, a private address"):
        call_command("create_webhook", "http://[fec0::1]:8080/hooks")

    assert not WebhookEndpoint.objects.exists()
