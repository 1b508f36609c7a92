"""Where webhooks may be sent: the URL and address rules (no SSRF).

A destination is an ``http`` or ``https`` URL with a host name or address, no
credentials, no fragment. Every address its host resolves to is checked:

* always refused: link-local (169.254.0.0/16, fe80::/10) and cloud metadata
  addresses (169.254.169.254, fd00:ec2::254, 100.100.100.200, 168.63.129.16...),
  unspecified ("this network", 0.0.0.0/8), multicast, broadcast and reserved
  addresses, and IPv6 forms that wrap one of these (IPv4-mapped, NAT64, and
  the tunnel endpoints inside 6to4 and Teredo addresses);
* refused unless ``RECALL_WEBHOOK_ALLOW_PRIVATE=on``: loopback and private
  networks (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7, the deprecated
  site-local fec0::/10, ...), IPv6 forms that wrap one of those, and every
  address that is not global (Teredo, documentation ranges).

The special ranges are listed here rather than left to ``ipaddress``'s flags,
whose tables differ between Python releases (3.11.7 calls fec0::/10 global).

If any address is refused, the destination is. The check runs when an
endpoint is created or changed, and again before every attempt (DNS may
change); the delivery then connects to one of the checked addresses itself,
so no second lookup can point it elsewhere (DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2000

# Cloud metadata services that are not link-local (those are refused anyway).
METADATA = {
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack...
        "169.254.170.2",  # AWS ECS task metadata
        "fd00:ec2::254",  # AWS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "168.63.129.16",  # Azure's wire server
        "192.0.0.192",  # Oracle Cloud
    )
}
SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT
NAT64 = ipaddress.ip_network("64:ff9b::/96")
BROADCAST = ipaddress.ip_address("255.255.255.255")
# "This network" (RFC 791): Linux connects 0.x.y.z to the local host.
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
TEREDO = ipaddress.ip_network("2001::/32")
# Not global, whatever this Python's ipaddress says: site-local (deprecated by
# RFC 3879, routed inside a site like fc00::/7), Teredo (a tunnel, RFC 4380),
# and the documentation ranges (RFC 3849, RFC 9637).
NOT_GLOBAL = tuple(
    ipaddress.ip_network(n)
    for n in ("fec0::/10", "2001::/32", "2001:db8::/32", "3fff::/20")
)


class DestinationRefused(ValueError):
    """A URL Recall will not send webhooks to; the message says why."""


@dataclass(frozen=True)
class Destination:
    """A checked URL: where to connect (``addresses``) and what to ask for."""

    url: str
    scheme: str
    host: str
    port: int
    target: str  # path and query, as sent in the request line
    addresses: tuple[str, ...]


def parse(url: str) -> SplitResult:
    """The URL's parts, if its form is acceptable (no network access)."""
    if not isinstance(url, str) or not url:
        raise DestinationRefused("Give a URL.")
    if len(url) > MAX_URL_LENGTH:
        raise DestinationRefused(f"The URL is longer than {MAX_URL_LENGTH} characters.")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise DestinationRefused("The URL contains spaces or control characters.")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise DestinationRefused(f"Not a valid URL: {error}.") from error
    if parts.scheme not in ("http", "https"):
        raise DestinationRefused("Only http:// and https:// URLs are allowed.")
    if not parts.hostname:
        raise DestinationRefused("The URL has no host.")
    if parts.username is not None or parts.password is not None:
        raise DestinationRefused(
            "The URL must not contain credentials: the signature authenticates "
            "Recall to the receiver."
        )
    if parts.fragment:
        raise DestinationRefused("The URL must not have a #fragment.")
    if port == 0:
        raise DestinationRefused("The URL's port must be between 1 and 65535.")
    return parts


def refusal(address: IPAddress, *, allow_private: bool) -> str | None:
    """Why Recall will not connect to ``address``, or None if it may."""
    translated = _translated_ipv4(address)
    if translated is not None:  # the packets go to the IPv4 address itself
        return refusal(translated, allow_private=allow_private)
    for endpoint in _tunnel_endpoints(address):
        why = refusal(endpoint, allow_private=allow_private)
        if why is not None:
            return f"a tunnel to {endpoint}, {why}"
    if address in METADATA:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address"
    if (
        address.is_unspecified
        or address.is_multicast
        or address == BROADCAST
        or address in THIS_NETWORK
    ):
        return "not a unicast address"
    private = "(set RECALL_WEBHOOK_ALLOW_PRIVATE=on to allow)"
    if address.is_loopback:  # before is_reserved: ::1 is in a reserved block
        return None if allow_private else f"a loopback address {private}"
    if address.is_reserved:
        return "a reserved address"
    if not allow_private and (
        address.is_private
        or address in SHARED
        or not address.is_global
        or any(address in network for network in NOT_GLOBAL)
    ):
        return f"a private address {private}"
    return None


def _translated_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped or NAT64 address stands for: the
    connection ends there, so that address is the one to judge."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _tunnel_endpoints(address: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses a 6to4 or Teredo address carries: the tunnel
    delivers there, so each must be acceptable as well as the address."""
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address in TEREDO and address.teredo is not None:
        server, client = address.teredo
        return (server, client)
    return ()


def resolve(url: str, *, allow_private: bool | None = None) -> Destination:
    """Check ``url`` and every address its host resolves to; the checked
    destination, or DestinationRefused saying why not."""
    if allow_private is None:
        allow_private = settings.RECALL_WEBHOOK_ALLOW_PRIVATE
    parts = parse(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise DestinationRefused(f"Cannot resolve {host}: {error}.") from error
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        text = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 scope id is not ours
        address = ipaddress.ip_address(text)
        why = refusal(address, allow_private=allow_private)
        if why is not None:
            raise DestinationRefused(f"{host} resolves to {address}, {why}.")
        if text not in addresses:
            addresses.append(text)
    if not addresses:
        raise DestinationRefused(f"{host} resolves to no address.")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Destination(
        url=url,
        scheme=parts.scheme,
        host=host,
        port=port,
        target=target,
        addresses=tuple(addresses),
    )
