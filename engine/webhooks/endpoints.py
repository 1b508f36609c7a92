"""Creating webhook endpoints: the checks every door applies first.

``manage.py create_webhook`` and the admin both create endpoints here: the URL
must be a destination Recall may send to (``engine.webhooks.destinations``, DNS resolved
now) and the event types known; then the transition creates the endpoint and
its secret, which the caller shows once.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.webhooks.destinations import DestinationRefused, resolve
from jobs import transitions
from jobs.models import DEFAULT_EVENTS, SUBSCRIBABLE_EVENTS, WebhookEndpoint


class EndpointInvalid(ValueError):
    """A URL or a subscription Recall refuses; the message says why."""


def parse_events(text: str | Iterable[str] | None) -> list[str]:
    """Event types from ``"batch.finished,item.failed"`` (or a list); the
    default subscription when empty."""
    default = [str(e) for e in DEFAULT_EVENTS]
    if text is None:
        return default
    names = text.split(",") if isinstance(text, str) else list(text)
    events = [n.strip() for n in names if n.strip()]
    unknown = [e for e in events if e not in SUBSCRIBABLE_EVENTS]
    if unknown:
        raise EndpointInvalid(
            f"Unknown event type(s): {', '.join(unknown)}. Known: "
            f"{', '.join(SUBSCRIBABLE_EVENTS)}."
        )
    ordered = [str(e) for e in SUBSCRIBABLE_EVENTS if e in events]
    return ordered or default


def check_url(url: str) -> str:
    """The URL, stripped, if Recall may send to it now; EndpointInvalid if not."""
    url = url.strip()
    try:
        resolve(url)
    except DestinationRefused as refused:
        raise EndpointInvalid(str(refused)) from refused
    return url


def create_endpoint(
    url: str, *, events: Iterable[str] | str | None = None, description: str = ""
) -> tuple[WebhookEndpoint, str]:
    """Check, then create; returns the endpoint and its secret (shown once)."""
    checked_events = parse_events(events)
    checked_url = check_url(url)
    return transitions.create_webhook_endpoint(
        checked_url, events=checked_events, description=description.strip()
    )
